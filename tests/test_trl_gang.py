"""Issue 31 item 2, the TRL stages on a gang: 2 gloo ranks against one process.

The gang's ranks are the accelerate processes TRL expects (pita.algos.trl_common.run_on_gang
through pita.runtime.gang.run_stage: RANK / WORLD_SIZE / LOCAL_RANK / MASTER_* set and the
process group up), so accelerate runs `MULTI_CPU` (DDP); each rank takes half of every
batch in the same order, so the loss curve and the final weights match one process up to
float reduction order (TOLERANCE), and so does what evaluation would make of them.

A 2-rank launch costs most of such a test (each rank imports TRL), so one launch trains
several stages in turn (`_stages_on_rank`): DPO (an epoch over 44 pairs in batches of 8: not
a multiple, `trl_common.whole_batches`) and GRPO in the default set; RPO with the reward
model, and GRPO-HF, in slow ones. GRPO matches one process because each completion is
sampled from its own seed (prompt, step, place in its group: `grpo._row_seeds`), not from
TRL's per-rank stream (`set_seed(seed, device_specific=True)`, seed + rank).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tests.test_baselines import GOAL_WALK, _ctx, _run_folder

torch = pytest.importorskip("torch")
pytest.importorskip("trl")

# What "2 ranks match one process" means, on any x86 CPU. The data split is exact (the same
# examples in every step's global batch); the float sums are not: one process's batch of 8
# and two ranks' batches of 4 run other GEMM shapes, so other kernels (AVX-512 or AVX2, per
# CPU) round near-zero gradients differently, and Adam turns any gradient, however small,
# into a step of up to `lr` per weight. A fixed 1e-5 on the weights held on one CPU (gap
# 2.0e-6) and failed on an AMD EPYC without AVX-512 (3.06e-5, RPO + reward model). So:
# - the loss per step and logged floats: within TOLERANCE (relative and absolute);
# - every weight: within WEIGHT_SHARE of the most Adam can move it, `lr x steps`. A wrong
#   split (a rank training on the other half, or on the whole batch) moves weights by a large
#   share of that bound (`test_a_wrong_data_split_fails_the_weight_bound`: 179 %); reduction
#   order moves them by under 1 %: 0.013 % (DPO), 0.051 % (RPO), 0.004 % (reward model) on
#   this project's Intel machine, and the AMD case's 3.06e-5 is 0.77 % of RPO's 4e-3 (0.26 %
#   of the reward model's 1.2e-2).
TOLERANCE = 1e-4
WEIGHT_SHARE = 0.02
OVERRIDES = [
    "algos.DPO.steps=0",  # an epoch over the 44 pairs (`_pairs`): 5 whole batches of 8
    "algos.DPO.epochs=1",
    "algos.DPO.batch_size=8",
    "algos.DPO.lr=1e-3",
    "algos.RPO.steps=4",
    "algos.RPO.batch_size=8",
    "algos.RPO.lr=1e-3",
    "algos.RPO.sft_weight=1.0",
    "algos.GRPO-HF.reward_epochs=1",
    "algos.GRPO-HF.reward_lr=3e-3",
    "algos.GRPO-HF.batch_size=8",
    "algos.GRPO.steps=2",
    "algos.GRPO.batch_size=8",
    "algos.GRPO.num_generations=4",
    "algos.GRPO.lr=1e-2",
    "algos.GRPO-HF.steps=2",
    "algos.GRPO-HF.num_generations=4",
    "algos.GRPO-HF.lr=1e-2",
]
# (name, algo, stage, dotted per-rank body, inputs)
DPO_STAGES = [
    ("dpo", "DPO", "train", "pita.algos.dpo:_train", {"data": ["collect"]}),
    ("rpo", "RPO", "train", "pita.algos.dpo:_train", {"data": ["collect"]}),
    (
        "rm",
        "GRPO-HF",
        "reward_model",
        "pita.algos.reward_model:_train_reward_model",
        {"data": ["collect"]},
    ),
]
GRPO_STAGES = [
    ("grpo", "GRPO", "train", "pita.algos.grpo:_train", {}),
    ("grpo_hf", "GRPO-HF", "train", "pita.algos.grpo:_train_hf", {"reward_model": "rm"}),
]


def _pairs(run: Path) -> None:
    """Deterministic preference pairs (chosen ends with node 1, rejected with node 2), one per
    training prompt: 44, not a multiple of the batch of 8 (the reward model holds 4 out and
    trains on 40). A last, partial batch is where k ranks would differ from one process
    (accelerate fills it up on every rank by wrapping around, as DistributedSampler does):
    every k draws whole batches instead (`trl_common.whole_batches`)."""
    from pita.datasets import build_task

    task = build_task(GOAL_WALK)
    data = run / "tasks" / "collect"
    data.mkdir(parents=True)
    with open(data / "pairs.jsonl", "w") as f:
        for i, ex in enumerate(task.train_examples()):
            mid = [i % 8, (i * 3) % 8]
            record = {
                "example": i,
                "prompt": ex.prompt_ids,
                "chosen": [*mid, 1, task.eos_id],
                "rejected": [*mid, 2, task.eos_id],
            }
            f.write(json.dumps(record) + "\n")


def _resolve(dotted: str):
    import importlib

    module, _, name = dotted.partition(":")
    return getattr(importlib.import_module(module), name)


def _stage_ctx(base, name: str, algo: str, stage: str, inputs: dict):
    """`base` (a rank's context) for one of the stages, with its own task and folder. The
    task id is the same in both run folders: it seeds the stage (`ctx.seed`)."""
    from pita.algos.registry import ALGORITHMS

    task = dataclasses.replace(
        base.task,
        id=name,
        algo=algo,
        algo_schema=ALGORITHMS[algo].schema_path,
        stage=stage,
        inputs={"reference": "pretrain", **inputs},
    )
    out = base.run_dir / "tasks" / task.id
    out.mkdir(parents=True, exist_ok=True)
    return dataclasses.replace(base, task=task, out_dir=out, settings=None)  # typed anew


def _stages_on_rank(ctx, dist, stages: list) -> dict:
    """Each of `stages` in turn on this rank of the gang (one launch for several stages)."""
    from accelerate.state import PartialState

    results = {}
    for name, algo, stage, body, inputs in stages:
        results[name] = _resolve(body)(_stage_ctx(ctx, name, algo, stage, inputs), dist)
    results["_state"] = str(PartialState().distributed_type.value)
    return results


def _one_process(run: Path, stages: list, overrides: list[str] = OVERRIDES) -> dict:
    """The same stages through their stage functions, in this process (no gang)."""
    results = {}
    for name, algo, stage, body, inputs in stages:
        module, _, fn = body.partition(":")
        base = _ctx(run, algo, stage, {}, overrides, f"base_{name}")
        ctx = _stage_ctx(base, name, algo, stage, inputs)
        results[name] = _resolve(f"{module}:{fn.lstrip('_')}")(ctx)
    return results


def _gang(run: Path, stages: list) -> dict:
    from pita.runtime.gang import run_stage

    base = _ctx(run, "DPO", "train", {}, OVERRIDES, "gang")
    return run_stage(base, _stages_on_rank, stages, world_size=2)


def _run_folders(tmp_path: Path) -> tuple[Path, Path]:
    """Two copies of a run folder holding π_ref and the pairs: one for one process, one for
    the gang (the same task ids in both; each task's checkpoints stay in its own run)."""
    import shutil

    one = _run_folder(tmp_path / "one", steps=20)
    _pairs(one)
    two = tmp_path / "two"
    shutil.copytree(one, two)
    return one, two


def _losses(folder: Path) -> list[float]:
    rows = [json.loads(line) for line in (folder / "train_log.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def _weights(folder: Path, reward: bool = False) -> dict:
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    cls = AutoModelForSequenceClassification if reward else AutoModelForCausalLM
    return cls.from_pretrained(folder).state_dict()


def _max_weight_gap(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _adam_bound(name: str, steps: int) -> float:
    """The most Adam moves one weight in `steps` steps of stage `name`: about lr per step
    (|m / sqrt(v)| <= 1 for a steady gradient; bias correction keeps the first steps there)."""
    lr = {"dpo": 1e-3, "rpo": 1e-3, "rm": 3e-3, "grpo": 1e-2, "grpo_hf": 1e-2}[name]  # OVERRIDES
    return lr * steps


def _assert_weights_match(name: str, steps: int, a: dict, b: dict) -> float:
    """Every weight of `a` and `b` within WEIGHT_SHARE of Adam's bound; the share it used."""
    share = _max_weight_gap(a, b) / _adam_bound(name, steps)
    assert share <= WEIGHT_SHARE, f"{name}: weights {share:.2%} of lr x steps apart"
    return share


def _sampled_row(folder: Path) -> tuple[list, float]:
    """What evaluation makes of a policy: seeded samples of the test prompts, mean reward."""
    from transformers import AutoModelForCausalLM

    from pita.datasets import build_task
    from pita.models.generation import generate

    task = build_task(GOAL_WALK)
    examples = task.test_examples()
    out = generate(
        AutoModelForCausalLM.from_pretrained(folder).eval(),
        [e.prompt_ids for e in examples],
        max_new_tokens=task.max_new_tokens,
        batch_size=64,
        pad_token_id=task.tokenizer.pad_token_id,
        eos_token_id=task.tokenizer.eos_token_id,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        generator=torch.Generator(device="cpu").manual_seed(0),
    )
    rewards = task.rewards(examples, out.responses)
    return out.responses, sum(rewards) / len(rewards)


@pytest.mark.parametrize(
    "names",
    [
        pytest.param(("dpo", "grpo"), id="dpo-grpo"),  # the default set keeps one launch
        pytest.param(("rpo", "rm"), id="rpo-reward_model", marks=pytest.mark.slow),
    ],
)
def test_trl_stages_on_two_ranks_match_one_process(tmp_path, names):
    """Issue 45: results never depend on the devices. DPO over 44 pairs in batches of 8 (an
    epoch: 5 whole batches on any k, `whole_batches`) and GRPO (completions seeded per
    prompt, step and place in the group, `grpo._row_seeds`) on 2 ranks log the loss curve,
    end with the weights and give the evaluation row of one process."""
    stages = [s for s in DPO_STAGES + GRPO_STAGES if s[0] in names]
    run_one, run_two = _run_folders(tmp_path)
    one = _one_process(run_one, stages)
    two = _gang(run_two, stages)
    assert two["_state"] == "MULTI_CPU"  # accelerate's own word for what ran: DDP on CPU
    _assert_two_match_one(run_one, run_two, one, two, stages)
    if "dpo" in names:  # an epoch of whole batches: 40 of the 44 pairs, on any k
        assert one["dpo"]["steps"] == 5
    if "rm" in names:
        assert one["rm"]["heldout_accuracy"] == two["rm"]["heldout_accuracy"]


def _assert_two_match_one(run_one: Path, run_two: Path, one: dict, two: dict, stages) -> None:
    """Each stage's step count, loss curve (TOLERANCE), weights (WEIGHT_SHARE of Adam's
    bound) and, for a policy, its seeded evaluation row: the same from 2 ranks as from one."""
    start = _weights(run_one / "tasks/pretrain/model")
    for name, _, _, _, _ in stages:
        assert one[name]["distributed"] == {"distributed_type": "NO", "num_processes": 1}
        assert two[name]["distributed"] == {"distributed_type": "MULTI_CPU", "num_processes": 2}
        assert one[name]["steps"] == two[name]["steps"] >= 1
        folder_one, folder_two = run_one / "tasks" / name, run_two / "tasks" / name
        curve_one, curve_two = _losses(folder_one), _losses(folder_two)
        assert len(curve_one) == len(curve_two) >= 1
        assert curve_two == pytest.approx(curve_one, rel=TOLERANCE, abs=TOLERANCE)
        reward = name == "rm"
        artifact = "reward_model" if reward else "model"
        w_one = _weights(folder_one / artifact, reward)
        _assert_weights_match(
            name, one[name]["steps"], w_one, _weights(folder_two / artifact, reward)
        )
        if not reward:  # it trained: the weights moved far more than the tolerance
            assert _max_weight_gap(w_one, start) > 1e-3
            # the results row: the same samples and reward
            assert _sampled_row(folder_one / "model") == _sampled_row(folder_two / "model")
        for key in ("reward", "kl"):  # GRPO's: the same completions, scored the same
            if key in one[name]:
                assert two[name][key] == pytest.approx(one[name][key], rel=TOLERANCE, abs=TOLERANCE)


@pytest.mark.slow  # two one-process DPO runs: ~15 s here
def test_a_wrong_data_split_fails_the_weight_bound(tmp_path):
    """The weight bound can fail for what it is about: DPO on half of each global batch (what
    a rank would train on if its gradients were never all-reduced: batch 4 instead of 8, the
    same steps) ends far outside WEIGHT_SHARE of one process's batch-8 weights."""
    import shutil

    stages = [s for s in DPO_STAGES if s[0] == "dpo"]
    run_one, run_half = _run_folders(tmp_path)
    shutil.rmtree(run_half / "tasks" / "dpo", ignore_errors=True)
    one = _one_process(run_one, stages)
    _one_process(run_half, stages, [*OVERRIDES, "algos.DPO.batch_size=4", "algos.DPO.steps=5"])
    w_one = _weights(run_one / "tasks" / "dpo" / "model")
    w_half = _weights(run_half / "tasks" / "dpo" / "model")
    with pytest.raises(AssertionError, match="of lr x steps apart"):
        _assert_weights_match("dpo", one["dpo"]["steps"], w_one, w_half)


# a task the run may grow (a stop channel: data_parallel), checkpoints off (saved only when
# the run asks); 5 steps of 8 pairs stay in the first epoch (44 pairs: a partial last batch
# is where k ranks differ, `_pairs`; the reward model's 40: one epoch); a log every 4 steps,
# so the stops below land between two logs and the last step after the last
GROWN = [
    "training.parallel_strategy=data_parallel",
    "training.checkpoint_every=0",
    "training.checkpoint_every_minutes=0",
    "algos.DPO.steps=5",
    "algos.DPO.trl={logging_steps:4}",
    "algos.GRPO-HF.reward_trl={logging_steps:4}",
    "algos.GRPO.steps=5",
    "algos.GRPO.trl={logging_steps:4}",
]
_CLOCK_KEYS = ("elapsed", "runtime", "per_second", "time")


def _stopping(ctx, dist, stages: list) -> dict:
    """Each of `stages` in turn on this rank (one launch for several stages, as
    `_stages_on_rank`): its result, or the step it stopped at when the run asked."""
    from pita.core.errors import StoppedAtCheckpoint

    results: dict = {}
    for name, algo, stage, body, inputs in stages:
        try:
            results[name] = _resolve(body)(_stage_ctx(ctx, name, algo, stage, inputs), dist)
        except StoppedAtCheckpoint as stopped:
            results[name] = stopped.step
    return results


def _attempt(run: Path, stages: list, k: int, tag: str, stop_at: int | None = None) -> dict:
    """One attempt of each of `stages` (DPO_STAGES) on k ranks, each resuming from its newest
    checkpoint in a fresh folder, as the worker gives each attempt: its result, or the step
    it stopped at. `stop_at`: the run asks each to stop at a checkpoint
    (`TaskPaths.stop_request`) once it reports that step (one process), or before it starts
    (a gang: after its first step)."""
    import shutil

    from pita.core.paths import TaskPaths
    from pita.runtime.gang import run_stage

    base = _ctx(run, "DPO", "train", {}, [*OVERRIDES, *GROWN], tag)
    requests = [TaskPaths(run, s[0]).stop_request for s in stages]
    for name, *_ in stages:
        shutil.rmtree(run / "tasks" / name, ignore_errors=True)
    try:
        if k > 1:
            for request in requests if stop_at is not None else []:
                request.write_text("{}")
            return run_stage(base, _stopping, stages, world_size=k)
        if stop_at is None:
            return _stopping(base, None, stages)
        ask, out = f"step {stop_at}/", {}
        for stage, request in zip(stages, requests):

            def heartbeat(line: str, request: Path = request) -> None:
                if line.startswith(ask):
                    request.write_text("{}")

            out.update(_stopping(dataclasses.replace(base, heartbeat=heartbeat), None, [stage]))
        return out
    finally:
        for request in requests:  # the run removes its request before the next dispatch
            request.unlink(missing_ok=True)


def _logged(folder: Path) -> list[dict]:
    """train_log.jsonl without its clocks."""
    rows = (folder / "train_log.jsonl").read_text().splitlines()
    return [
        {k: v for k, v in json.loads(r).items() if not any(c in k for c in _CLOCK_KEYS)}
        for r in rows
    ]


@pytest.mark.long
@pytest.mark.slow  # each stage on one process twice, two 2-rank launches: ~30-90 s here
def test_trl_stages_stopped_and_resumed_on_other_ranks_match_an_uninterrupted_run(
    tmp_path, monkeypatch
):
    """Growth's premise for the TRL stages it grows (pita/algos/registry.py `growable_stages`): DPO,
    GRPO and the reward model, each asked to stop at step 2 on one process, resumed on 2 ranks
    (a resize) and asked to stop after step 3, resumed on 2 ranks to the end (a retry, or a
    fallback to the old gang), each from the Trainer's own checkpoint
    (`resume_from_checkpoint`), log every row and end with the result and the weights of an
    uninterrupted one-process run, within TOLERANCE. Both stops land between two logs (each
    rank holds its share of the loss not logged yet, TRL its per-step metrics:
    `checkpoint._loop_state` keeps the gang's), the last step after the last log
    (`trl_common.last_step_logged`: else `train_loss` takes rank 0's share)."""
    from pita.runtime import context

    monkeypatch.setattr(context, "PROGRESS_EVERY_S", 0.0)  # every step's progress line
    stages = [s for s in DPO_STAGES + GRPO_STAGES if s[0] in ("dpo", "rm", "grpo")]
    run_one, run_two = _run_folders(tmp_path)
    whole = _attempt(run_one, stages, 1, "whole")
    assert _attempt(run_two, stages, 1, "first", stop_at=2) == {"dpo": 2, "rm": 2, "grpo": 2}
    assert _attempt(run_two, stages, 2, "second", stop_at=3) == {"dpo": 3, "rm": 3, "grpo": 3}
    grown = _attempt(run_two, stages, 2, "third")
    start = _weights(run_one / "tasks" / "pretrain" / "model")
    for name, artifact in (("dpo", "model"), ("rm", "reward_model"), ("grpo", "model")):
        one, two = whole[name], grown[name]
        assert two["distributed"] == {"distributed_type": "MULTI_CPU", "num_processes": 2}
        assert one["steps"] == two["steps"] == 5
        rows_one, rows_two = _logged(run_one / "tasks" / name), _logged(run_two / "tasks" / name)
        assert [r["step"] for r in rows_one] == [r["step"] for r in rows_two] == [4, 5, 5]
        for a, b in zip(rows_one, rows_two):
            assert a.keys() == b.keys()
            off = [k for k in a if a[k] != pytest.approx(b[k], rel=TOLERANCE, abs=TOLERANCE)]
            assert not off, (off, a, b)
        for key, value in one.items():
            if isinstance(value, float):
                assert two[key] == pytest.approx(value, rel=TOLERANCE, abs=TOLERANCE), key
        reward = name == "rm"
        w_one = _weights(run_one / "tasks" / name / artifact, reward)
        w_two = _weights(run_two / "tasks" / name / artifact, reward)
        _assert_weights_match(name, one["steps"], w_one, w_two)
        saved = {p.name for p in (run_two / "tasks" / f"{name}.checkpoints").glob("checkpoint-*")}
        assert saved == {"checkpoint-3"}  # only where asked: no save at the last step
        if not reward:  # it trained: the weights moved far more than the tolerance
            assert _max_weight_gap(w_one, start) > 1e-3


@pytest.mark.slow
def test_grpo_hf_on_two_ranks_matches_one_process(tmp_path):
    """GRPO-HF (the proxy reward model's score as the reward) on 2 ranks: what one process
    makes, as GRPO in the default set (`test_trl_stages_on_two_ranks_match_one_process`)."""
    import shutil

    stages = GRPO_STAGES[1:]
    run_one, run_two = _run_folders(tmp_path)
    _one_process(run_one, DPO_STAGES[2:])  # the reward model GRPO-HF scores with: tasks/rm
    shutil.copytree(run_one / "tasks" / "rm", run_two / "tasks" / "rm")
    one = _one_process(run_one, stages)
    two = _gang(run_two, stages)
    assert two["_state"] == "MULTI_CPU"
    _assert_two_match_one(run_one, run_two, one, two, stages)
    assert one["grpo_hf"]["steps"] == 2


def _strategy_on_rank(ctx, dist) -> dict:
    """What a rank of a TRL task's gang is told to run."""
    return {"strategy": dist.strategy, "world_size": dist.world_size}


def test_a_trl_task_under_fsdp_on_cpu_runs_ddp_and_its_log_says_so_in_one_line(tmp_path, caplog):
    """The planner gave the TRL task strategy ddp (no FSDP on CPU): its ranks are told
    data_parallel, and the task log has the one line the dry run prints."""
    import logging

    from pita.algos.trl_common import cpu_fsdp_note, run_on_gang

    ctx = _ctx(tmp_path, "DPO", "train", {}, ["training.parallel_strategy=fsdp"], "dpo_train")
    ctx.task.gpus, ctx.task.strategy = 2, "ddp"
    with caplog.at_level(logging.INFO, logger=ctx.logger.name):
        got = run_on_gang(ctx, _strategy_on_rank)
    assert got == {"strategy": "data_parallel", "world_size": 2}
    lines = [r.getMessage() for r in caplog.records]
    assert lines.count(cpu_fsdp_note("dpo_train")) == 1
    assert not [ln for ln in lines if "FSDP2" in ln]


def test_fsdp2_arguments_reach_a_trl_config_only_for_a_sharded_task_on_cuda(tmp_path):
    """What only a GPU can run is at least a TrainingArguments transformers accepts."""
    from trl import DPOConfig

    from pita.algos.trl_common import fsdp_kwargs

    ctx = _ctx(tmp_path, "DPO", "train", {}, [], "dpo_train")
    assert fsdp_kwargs(ctx, on_cuda=True) == {}  # strategy none
    ctx.task.strategy = "fsdp"
    assert fsdp_kwargs(ctx, on_cuda=False) == {}  # never on CPU
    kwargs = fsdp_kwargs(ctx, on_cuda=True)
    args = DPOConfig(output_dir=str(tmp_path / "scratch"), use_cpu=True, report_to="none", **kwargs)
    assert args.fsdp_config["version"] == 2 and args.fsdp_config["reshard_after_forward"]
