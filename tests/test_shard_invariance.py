"""Results do not depend on the number of devices: a sharded stage gives the same numbers on
1 shard as on 4 (issue 32 item 4; pita/models/seeds.py says how).

The unit tests run the real collect and evaluate stage functions in-process over a temporary
run folder (a tiny goal-walk Llama as π_ref, a random value head as the guide), once as one
shard and once as four uneven shards, merge both with the real merge stages and compare
every record. Sampled tokens, rewards, cuts and labels must be equal; log-probs may differ
in the last float bits (a row padded in another batch goes through matmuls of another
shape), so KL values are compared to 1e-5 (fp32 rounding, summed over a response). The slow test runs one small experiment on
fake:1 and on fake:4 through the command line and compares every row of the summary.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import random
from dataclasses import replace
from pathlib import Path

import pytest

from tests.conftest import run_cli_later, run_dirs

torch = pytest.importorskip("torch")

from pita.datasets import build_task  # noqa: E402
from tests.test_baselines import GOAL_WALK as BASELINES_WALK  # noqa: E402

GOAL_WALK = {**BASELINES_WALK, "test_size": 10}  # the baselines' small graph, fewer test prompts
ONE = [(0.0, 1.0)]
FOUR = [(0.0, 0.1), (0.1, 0.5), (0.5, 0.55), (0.55, 1.0)]  # uneven, as the planner weights them
TIMING = ("eval_wall_s", "wall_s", "collect_s")  # seconds: the only numbers allowed to differ
FLOAT_TOL = dict(rel=1e-5, abs=1e-5)  # fp32 log-probs summed over a response


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory) -> Path:
    """tasks/pretrain/model: a tiny Llama taught random walks for a few steps (some samples
    succeed) + the tokenizer; tasks/train/value_model: a value model with a random head (so
    guided decoding really moves the tokens)."""
    from transformers import LlamaModel

    from pita.models.tiny import build_tiny_llama
    from pita.models.value_model import ValueModel
    from pita.stages.pretrain import teacher_forcing_batch

    run = tmp_path_factory.mktemp("shards")
    task = build_task(GOAL_WALK)
    tok = task.tokenizer
    arch = dict(n_layer=1, d_model=32, n_head=2)
    model = build_tiny_llama(
        len(tok), **arch, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, seed=0
    ).train()
    optim, rng = torch.optim.AdamW(model.parameters(), lr=1e-2), random.Random(0)
    for _ in range(30):
        ids, mask, labels = teacher_forcing_batch(task.pretrain_batch(rng, 64), tok.pad_token_id)
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        optim.step()
        optim.zero_grad()
    folder = run / "tasks" / "pretrain" / "model"
    model.eval().save_pretrained(folder)
    task.save_tokenizer(str(folder))
    torch.manual_seed(1)
    guide = ValueModel(LlamaModel(model.config), len(tok), loss_type="bce", head_type="q")
    torch.nn.init.normal_(guide.head.weight, std=1.0)
    guide.save(run / "tasks" / "train" / "value_model")
    return run


def _stage(
    run: Path, tag: str, algo: str, stage: str, fn, shards: list, inputs: dict, overrides: list
) -> Path:
    """Run `fn` as the shards `shards` of (algo, stage), then its merge; returns the merge's
    folder. Each run gets its own folder names under `tag`, like two run folders."""
    from pita.algos.registry import ALGORITHMS
    from pita.core.tasks import TaskSpec, task_id
    from pita.experiment.cli import compose_config
    from pita.runtime.context import StageContext
    from pita.stages.collect import collect_merge
    from pita.stages.evaluate import evaluate_merge

    cfg = compose_config([f"algos.{algo}.enabled=true", *overrides])
    common = dict(
        algo=algo,
        algo_schema=ALGORITHMS[algo].schema_path,
        dataset="goal_walk",
        family="tiny",
        round=1 if "guide" in inputs else 0,
        stage=stage,
        fn="-",
        dataset_cfg=GOAL_WALK,
        family_cfg={"reference_arch": {"n_layer": 1, "d_model": 32, "n_head": 2}},
    )

    def ctx(task: TaskSpec, folder: str) -> StageContext:
        out = run / "tasks" / folder
        out.mkdir(parents=True)
        logger = logging.getLogger(f"test.shards.{folder}")
        return StageContext(task=task, cfg=cfg, run_dir=run, out_dir=out, logger=logger)

    folders = []
    for s, rng in enumerate(shards):
        tid = task_id(algo, "goal_walk", "tiny", common["round"], stage, s)
        spec = TaskSpec(
            id=tid,
            shard=s,
            num_shards=len(shards),
            shard_range=rng,
            inputs={"reference": "pretrain", **inputs},
            **common,
        )
        c = ctx(spec, f"{tag}/{tid}")
        result = fn(c)
        (c.out_dir / "result.json").write_text(json.dumps(result))
        folders.append(f"{tag}/{tid}")
    merge = TaskSpec(
        id=task_id(algo, "goal_walk", "tiny", common["round"], stage),
        inputs={"reference": "pretrain", "shards": folders},
        **{**common, "stage": f"{stage}_merge"},
    )
    c = ctx(merge, f"{tag}/{merge.id}")
    (collect_merge if stage == "collect" else evaluate_merge)(c)
    return c.out_dir


def _same_row(a: dict, b: dict) -> None:
    """Every column equal; floats to FLOAT_TOL (their last bits follow the batch shape)."""
    assert a.keys() == b.keys()
    for key in a:
        if key in TIMING:
            continue
        x, y = a[key], b[key]
        if isinstance(x, float) and math.isfinite(x):
            assert y == pytest.approx(x, **FLOAT_TOL), key
        else:
            assert x == y, key


# --- generation: a row's sample is its own --------------------------------------------------------


def test_a_rows_sample_depends_only_on_its_prompt_and_seed(run_folder):
    """The same rows sampled in one call, or a few at a time in another order and batch size,
    give the same tokens: nothing about a row depends on what shares its batch."""
    from transformers import AutoModelForCausalLM

    from pita.models.generation import generate
    from pita.models.seeds import example_seed

    task = build_task(GOAL_WALK)
    model = AutoModelForCausalLM.from_pretrained(run_folder / "tasks" / "pretrain" / "model")
    examples = task.test_examples()
    prompts = [list(ex.prompt_ids) for ex in examples for _ in range(3)]
    prompts[5] = prompts[5][1:]  # one shorter prompt: batches differ in their left padding
    seeds = [example_seed(7, "test", i) for i in range(len(prompts))]
    kw = dict(
        max_new_tokens=task.max_new_tokens,
        pad_token_id=task.tokenizer.pad_token_id,
        eos_token_id=task.tokenizer.eos_token_id,
    )
    whole = generate(model, prompts, batch_size=len(prompts), row_seeds=seeds, **kw)
    pieces: dict[int, list[int]] = {}
    for part in (range(20, 30), range(0, 20)):  # another order, another batch size
        rows = list(part)[::-1]
        out = generate(
            model,
            [prompts[i] for i in rows],
            batch_size=3,
            row_seeds=[seeds[i] for i in rows],
            **kw,
        )
        pieces.update(zip(rows, out.responses))
    assert [pieces[i] for i in range(len(prompts))] == whole.responses
    assert len({tuple(r) for r in whole.responses}) > 5  # the rows really sample
    with pytest.raises(ValueError, match="row_seeds"):
        generate(model, prompts, batch_size=4, row_seeds=seeds[:-1], **kw)


# --- collect --------------------------------------------------------------------------------------


def test_collect_records_are_the_same_on_one_and_four_shards(run_folder):
    """PITA's guided roll-in, cut, roll-out and Bradley–Terry labels, merged: byte for byte
    the same records from one shard (batches of 4) as from four uneven shards."""
    from pita.algos.pita_algo import collect

    overrides = [
        "data_collection.max_examples=12",
        "algos.PITA.samples_per_example=3",
        "generation.batch_size=4",
    ]
    inputs = {"guide": "train"}
    one = _stage(run_folder, "c1", "PITA", "collect", collect, ONE, inputs, overrides)
    four = _stage(run_folder, "c4", "PITA", "collect", collect, FOUR, inputs, overrides)
    records = (one / "records.jsonl").read_text()
    assert records == (four / "records.jsonl").read_text()
    rows = [json.loads(line) for line in records.splitlines()]
    assert len(rows) == 36 and {r["roll_in"] for r in rows} == {"guided"}
    assert len({r["label"] for r in rows}) == 2  # both labels drawn: the test can see a change


def test_ground_truth_recipe_keeps_each_examples_first_wrong_try_however_tries_are_batched(
    run_folder,
):
    """Try t of an example is seeded by (example, t): the first wrong one is the same whether
    the tries come in big batches for all examples or in small ones for a shard's few."""
    from transformers import AutoModelForCausalLM

    from pita.algos.collector import RolloutCollector, ground_truth_pairs

    task = build_task(GOAL_WALK)

    class HalfRight:  # a judge that accepts about half the responses: tries vary per example
        tokenizer = task.tokenizer

        def rewards(self, examples, responses):
            return [float(sum(r) % 2 == 0) for r in responses]

    model = AutoModelForCausalLM.from_pretrained(run_folder / "tasks" / "pretrain" / "model")
    examples = [replace(ex, target_ids=[0]) for ex in task.train_examples()[:16]]

    def run(batch: int, parts: list[range]) -> tuple[list[dict], int]:
        collector = RolloutCollector(
            model,
            HalfRight(),
            batch_size=batch,
            max_new_tokens=task.max_new_tokens,
            pad_token_id=task.tokenizer.pad_token_id,
            eos_token_id=task.tokenizer.eos_token_id,
            seed=11,
        )
        records, dropped = [], 0
        for part in parts:
            got = ground_truth_pairs(
                collector, list(part), [examples[i] for i in part], max_tries=4
            )
            records, dropped = records + got[0], dropped + got[1]
        return records, dropped

    whole = run(64, [range(16)])
    assert run(3, [range(0, 5), range(5, 6), range(6, 16)]) == whole
    records, dropped = whole
    assert 0 < dropped < 16 and len(records) == 2 * (16 - dropped)


# --- evaluate -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "algo, inputs",
    [
        ("reference", {}),  # π_ref under two rules (KL 0 by construction)
        ("QSharp", {"policy": "train"}),  # guided at η 0 and 5: teacher-forced KL, value forwards
        ("DPO", {"policy": "pretrain"}),  # a trained policy's row (π_ref's weights stand in)
    ],
)
def test_evaluate_samples_and_rows_are_the_same_on_one_and_four_shards(run_folder, algo, inputs):
    from pita.stages.evaluate import evaluate_shard

    overrides = [
        "algos.QSharp.enabled=true",  # the reference adds a row under Q#'s guided rule
        "evaluation.num_samples=3",
        "evaluation.batch_size=4",
        "evaluation.etas=[0.0,5.0]",
    ]
    tag = f"e-{algo}"
    one = _stage(run_folder, tag + "1", algo, "evaluate", evaluate_shard, ONE, inputs, overrides)
    four = _stage(run_folder, tag + "4", algo, "evaluate", evaluate_shard, FOUR, inputs, overrides)

    def samples(merge: Path) -> list[dict]:
        shards = sorted(p for p in merge.parent.iterdir() if p.name.startswith(merge.name + "."))
        recs = [
            json.loads(x) for s in shards for x in (s / "samples.jsonl").read_text().splitlines()
        ]
        return sorted(recs, key=lambda r: (r["eta"] is None, r["eta"] or 0, r["example"]))

    a, b = samples(one), samples(four)
    assert len(a) == len(b) == 30 * (2 if algo != "DPO" else 1)
    for x, y in zip(a, b):
        _same_row(x, y)
    rows_1 = json.loads((one / "metrics.json").read_text())
    rows_4 = json.loads((four / "metrics.json").read_text())
    assert len(rows_1) == len(rows_4) == (1 if algo == "DPO" else 2)
    for x, y in zip(rows_1, rows_4):
        _same_row(x, y)
    if algo == "QSharp":  # guidance moved the samples: the comparison covers the guided path
        by_eta = {r["eta"]: [s["response"] for s in a if s["eta"] == r["eta"]] for r in rows_1}
        assert by_eta[0.0] != by_eta[5.0]


# --- end to end -----------------------------------------------------------------------------------


@pytest.mark.long
@pytest.mark.slow
def test_an_experiment_gives_the_same_rows_on_one_and_four_devices(tmp_path):
    """experiment=smoke with the reference and Q# (collect sharded, value training, guided
    evaluation sharded) on fake:1 and fake:4: every row of results/summary.csv equal."""
    rows, runs = {}, {}
    for n in (1, 4):  # both at once: they share nothing
        cwd = tmp_path / f"fake{n}"
        cwd.mkdir()
        args = [
            "experiment=smoke",
            "algos=[reference,QSharp]",
            "pretrain.steps=20",  # smaller still than smoke: the sizes do not matter here
            "algos.QSharp.steps=10",
            "dataset.test_size=20",
            f"system.devices=fake:{n}",
            "executor.progress=false",
        ]
        runs[n] = (
            cwd,
            run_cli_later(args, cwd, env={"PITA_CACHE_DIR": str(cwd / "cache")}, timeout=600),
        )
    for n, (cwd, future) in runs.items():
        proc = future.result()
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        [run_dir] = run_dirs(cwd, "smoke")
        plan = json.loads((run_dir / "plan.json").read_text())
        shards = [
            t for t in plan["tasks"] if t["id"].startswith("QSharp.goal_walk.tiny.r0.collect.s")
        ]
        assert len(shards) == n  # the planner shards by device count: the point of the test
        with open(run_dir / "results" / "summary.csv") as f:
            rows[n] = list(csv.DictReader(f))
    assert len(rows[1]) == len(rows[4]) == 4
    for a, b in zip(rows[1], rows[4]):
        _same_row({k: _number(v) for k, v in a.items()}, {k: _number(v) for k, v in b.items()})


def _number(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text
