"""The star-graph task G(d, l, N): generator, text form, splits, reward, trap metrics."""

import json
import random

import pytest

from pita.datasets import Task, build_task, validate_dataset_cfg
from pita.datasets.star_graph import (
    StarGraph,
    StarGraphTask,
    generate_graph,
    num_distinct_graphs,
)
from pita.models.loading import load_tokenizer


@pytest.fixture(scope="module")
def task() -> StarGraphTask:
    return build_task(
        {
            "name": "star_graph",
            "degree": 2,
            "path_length": 5,
            "num_nodes": 20,
            "train_size": 500,
            "test_size": 300,
            "seed": 0,
        }
    )


def arms_of(graph: StarGraph) -> list[list[int]]:
    nxt = {}
    for u, v in graph.edges:
        nxt.setdefault(u, []).append(v)
    arms = []
    for first in nxt[graph.source]:
        arm = [graph.source, first]
        while arm[-1] in nxt:
            assert len(nxt[arm[-1]]) == 1, "only the source branches"
            arm.append(nxt[arm[-1]][0])
        arms.append(arm)
    return arms


@pytest.mark.parametrize("d,l,n", [(2, 5, 20), (5, 5, 50), (3, 8, 50), (2, 2, 3), (4, 3, 9)])
def test_generator_shape(d, l, n):
    rng = random.Random(d * 100 + l)
    for _ in range(50):
        g = generate_graph(rng, d, l, n)
        assert len(g.edges) == d * (l - 1)
        arms = arms_of(g)
        assert len(arms) == d, "d arms leave the source"
        assert all(len(a) == l for a in arms), "each arm has l nodes"
        inner = [v for a in arms for v in a[1:]]
        assert len(set(inner)) == len(inner) and g.source not in inner, "arms are disjoint"
        assert all(0 <= v < n for v in inner)
        assert g.source != g.goal
        assert list(g.path) in arms and g.path[0] == g.source and g.path[-1] == g.goal
        assert sum(g.goal in a for a in arms) == 1


def test_edges_are_shuffled():
    rng = random.Random(0)
    graphs = [generate_graph(rng, 2, 5, 20) for _ in range(50)]
    assert len({g.edges[0] for g in graphs}) > 10
    assert any(g.edges[0][0] != g.source for g in graphs), "edge order is not arm order"


def test_text_round_trip(task):
    g = task.graph_of(task.test_examples()[0])
    text = g.to_text()
    assert text.count("|") == len(g.edges) - 1 and text.count("=") == 1 and "/" in text
    assert StarGraph.from_text(text) == g
    prompt_only = StarGraph.from_text(g.prompt_text())
    assert prompt_only == g, "the path is recovered from the edges"
    fixed = StarGraph.from_text("0,1|1,2|0,3|3,4/0,4=0,3,4")
    assert fixed.edges == ((0, 1), (1, 2), (0, 3), (3, 4)) and fixed.path == (0, 3, 4)
    with pytest.raises(ValueError, match="not a star-graph text"):
        StarGraph.from_text("0-1/0,1=")


def test_tokens(task):
    ex = task.test_examples()[0]
    g = task.graph_of(ex)
    assert len(ex.prompt_ids) == 27 == task.prompt_length  # 3·d·(l−1) + 3 for G(2,5)
    assert ex.target_ids == [*g.path, task.eos_id] and task.max_new_tokens == 6
    tok = task.tokenizer
    assert tok(g.prompt_text())["input_ids"] == ex.prompt_ids, "commas dropped, |/= isolated"
    assert tok(g.to_text())["input_ids"] == ex.prompt_ids + ex.target_ids[:-1]
    decoded = tok.decode(ex.prompt_ids)
    assert decoded.endswith(f"/ {g.source} {g.goal} =") and "," not in decoded
    assert len(tok) == 20 + 3 + 3  # nodes, | = /, eos pad unk
    assert tok.padding_side == "left" and tok.bos_token_id is None
    json.dumps(ex.meta)
    assert isinstance(task, Task)


def test_tokenizer_save_load(task, tmp_path):
    task.save_tokenizer(str(tmp_path))
    tok = load_tokenizer(str(tmp_path))
    g = task.graph_of(task.train_examples()[0])
    assert tok(g.to_text())["input_ids"] == task.tokenizer(g.to_text())["input_ids"]
    assert tok.padding_side == "left" and tok.eos_token_id == task.eos_id


def test_splits_are_seeded_and_disjoint(task):
    train, test = task.train_examples(), task.test_examples()
    assert len(train) == 500 and len(test) == 300
    test_keys = {task.graph_of(e).key() for e in test}
    assert not test_keys & {task.graph_of(e).key() for e in train}
    again = StarGraphTask(train_size=500, test_size=300)
    assert [e.prompt_ids for e in again.test_examples()] == [e.prompt_ids for e in test]
    other = StarGraphTask(train_size=500, test_size=300, seed=1)
    assert [e.prompt_ids for e in other.test_examples()] != [e.prompt_ids for e in test]


def test_splits_disjoint_when_collisions_are_likely():
    # G(2,2,4): only 24 distinct graphs, so train draws often hit test graphs and are skipped
    small = StarGraphTask(degree=2, path_length=2, num_nodes=4, train_size=200, test_size=5)
    assert num_distinct_graphs(2, 2, 4) == 24
    test_keys = small.test_keys()
    assert all(small.graph_of(e).key() not in test_keys for e in small.train_examples())
    batch = small.pretrain_batch(random.Random(0), 200)
    for prompt, target in batch:
        g = StarGraph.from_text(_to_text(small, prompt))
        assert g.key() not in test_keys
        assert target == [*g.path, small.eos_id]


def _to_text(task, prompt_ids):
    """Prompt ids back to the text form: "u v | u v / s g =" -> "u,v|u,v/s,g="."""
    toks = task.tokenizer.convert_ids_to_tokens(prompt_ids)
    out, nums = [], []
    for t in toks:
        if t.isdigit():
            nums.append(t)
            continue
        if nums:
            out.append(",".join(nums))
            nums = []
        out.append(t)
    return "".join(out)


def test_num_distinct_graphs_by_enumeration():
    rng = random.Random(0)
    seen = {generate_graph(rng, 2, 3, 5).key() for _ in range(20000)}
    assert len(seen) == num_distinct_graphs(2, 3, 5) == 5 * 4 * 3 * 2


def test_pretrain_batch_fresh(task):
    batch = task.pretrain_batch(random.Random(7), 64)
    assert len(batch) == 64
    assert all(len(p) == 27 and len(t) == 6 and t[-1] == task.eos_id for p, t in batch)
    assert batch == task.pretrain_batch(random.Random(7), 64)
    assert batch != task.pretrain_batch(random.Random(8), 64)


def test_rewards_and_trap_metrics(task):
    ex = task.test_examples()[0]
    g = task.graph_of(ex)
    eos, pad = task.eos_id, task.tokenizer.pad_token_id
    wrong_arm = next(a for a in arms_of(g) if a != list(g.path))
    path = list(g.path)
    responses = [
        [*path, eos],  # exact: 1
        [*path, eos, pad, pad],  # padding after EOS ignored: 1
        [*path],  # no EOS: 0 (first step right)
        [*path[:-1], path[-2], eos],  # first step right, wrong later: 0
        [*wrong_arm, eos],  # the trap: wrong first step: 0
        [*path, path[-1], eos],  # too long: 0
        [eos],  # empty: 0
    ]
    examples = [ex] * len(responses)
    assert task.rewards(examples, responses) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert [task.first_step_correct(ex, r) for r in responses] == [
        True,
        True,
        True,
        True,
        False,
        True,
        False,
    ]
    assert task.accuracy_after_first_step(examples, responses) == pytest.approx(2 / 5)
    metrics = task.extra_metrics(examples, responses)
    assert metrics == {
        "first_step_acc": pytest.approx(5 / 7),
        "acc_after_first_step": pytest.approx(2 / 5),
    }
    answers = task.answers(examples, responses)
    assert answers[0] == answers[1] == ",".join(map(str, path)) and answers[2] == ""
    # no right first step: the conditional metric is left out (a stage's result must be finite)
    wrong = [
        r
        for r, ok in zip(
            responses, [task.first_step_correct(e, r) for e, r in zip(examples, responses)]
        )
        if not ok
    ]
    assert task.extra_metrics(examples[: len(wrong)], wrong) == {"first_step_acc": 0.0}
    assert task.extra_metrics([], []) == {}


def test_trapped_policy_numbers(task):
    """A 'model' that guesses the arm and then follows edges: ≈ 1/d exact, 1.0 after step 1."""
    rng = random.Random(0)
    examples = task.test_examples()
    responses = [[*rng.choice(arms_of(task.graph_of(e))), task.eos_id] for e in examples]
    acc = sum(task.rewards(examples, responses)) / len(examples)
    assert acc == pytest.approx(0.5, abs=0.08)
    metrics = task.extra_metrics(examples, responses)
    assert metrics["acc_after_first_step"] == 1.0
    assert metrics["first_step_acc"] == pytest.approx(acc)


@pytest.mark.parametrize(
    "cfg,key",
    [
        ({"degree": 1}, "degree"),
        ({"path_length": 1}, "path_length"),
        ({"num_nodes": 8}, "num_nodes"),  # G(2,5) needs >= 9
        ({"degree": 5, "path_length": 5, "num_nodes": 20}, "num_nodes"),
        ({"train_size": 0}, "train_size"),
        ({"test_size": 0}, "test_size"),
        ({"degree": 2, "path_length": 2, "num_nodes": 3, "test_size": 4}, "test_size"),
        ({"nodes": 20}, "nodes"),
    ],
)
def test_validation_names_the_key(cfg, key):
    with pytest.raises(ValueError) as e:
        validate_dataset_cfg({"name": "star_graph", **cfg})
    assert str(e.value).startswith(f"dataset.{key}=") and "\n" not in str(e.value)
    with pytest.raises(ValueError, match=f"dataset.{key}="):
        build_task({"name": "star_graph", **cfg})


# --- the official Q# data recipe: ground truth vs the first wrong π_ref sample -------------


class _ScriptedCollector:
    """A RolloutCollector whose sampler is scripted per prompt: `answers[prompt]` is the list
    of responses its successive samples return (the last one repeats)."""

    def __new__(cls, task, answers, batch_size=8):
        from types import SimpleNamespace

        from pita.algos.collector import RolloutCollector

        class Scripted(RolloutCollector):
            calls: list[int] = []

            def _generate(self, prompts, *, top_k, hook_factory, seeds):
                self.calls.append(len(prompts))
                out = []
                for p in prompts:
                    seq = answers[tuple(p)]
                    count = self.drawn.get(tuple(p), 0)
                    self.drawn[tuple(p)] = count + 1
                    out.append(list(seq[min(count, len(seq) - 1)]))
                return SimpleNamespace(responses=out)

        col = Scripted(
            None,
            task,
            batch_size=batch_size,
            max_new_tokens=task.max_new_tokens,
            pad_token_id=task.tokenizer.pad_token_id,
            eos_token_id=task.tokenizer.eos_token_id,
            reward_batch_size=5,
        )
        col.drawn = {}
        return col


@pytest.mark.parametrize("pairs", [False, True])
def test_ground_truth_vs_first_wrong_records(task, pairs):
    from pita.algos.collector import ground_truth_pairs
    from pita.algos.pita_algo import preference_items
    from pita.algos.qsharp import reward_targets, training_items

    examples = task.train_examples()[:6]
    eos = task.tokenizer.eos_token_id
    answers = {}
    for j, ex in enumerate(examples):
        gt = list(ex.target_ids)
        wrong_a = [gt[0], (gt[1] + 1) % 20, *gt[2:]]  # a wrong first step
        wrong_b = [gt[0], gt[1], eos]  # stops early
        if j == 0:
            answers[tuple(ex.prompt_ids)] = [gt]  # always right: dropped after max_tries
        else:  # right j - 1 times, then wrong_a, then wrong_b: the FIRST wrong one is kept
            answers[tuple(ex.prompt_ids)] = [gt] * (j - 1) + [wrong_a, wrong_b]
    col = _ScriptedCollector(task, answers, batch_size=8)
    records, dropped = ground_truth_pairs(
        col, list(range(10, 16)), examples, max_tries=4, pairs=pairs
    )
    assert dropped == 2  # example 0 (never wrong) and example 5 (right 4 times = max_tries)
    assert col.drawn[tuple(examples[0].prompt_ids)] == 4  # never more than max_tries samples
    kept = [1, 2, 3, 4]
    assert [r["example"] for r in records] == [10 + j for j in kept for _ in range(2)]
    for j, (gt_rec, wrong_rec) in zip(kept, zip(records[::2], records[1::2])):
        ex = examples[j]
        assert gt_rec["rollout"] == ex.target_ids and gt_rec["reward"] == 1.0
        assert wrong_rec["rollout"] == [
            ex.target_ids[0],
            (ex.target_ids[1] + 1) % 20,
            *ex.target_ids[2:],
        ]
        assert wrong_rec["reward"] == 0.0 == task.rewards([ex], [wrong_rec["rollout"]])[0]
        for rec in (gt_rec, wrong_rec):
            assert (
                rec["prefix"] == []
                and rec["roll_in"] == "reference"
                and rec["prompt"] == ex.prompt_ids
            )
        if pairs:  # PITA: the ground truth is preferred; each record's label is its own reward
            assert gt_rec["label"] == 1.0 and wrong_rec["label"] == 0.0
            assert (
                gt_rec["original"] == wrong_rec["rollout"]
                and wrong_rec["original"] == gt_rec["rollout"]
            )
    # Q# and PITA (bce) both train every target token against the sequence label
    q_items = training_items(
        records,
        reward_targets(
            [r["reward"] for r in records], _Algo(loss_type="bce", V_min=0.0, V_max=1.0)
        ),
    )
    assert all(start == 0 for _, _, start, _, _ in q_items)
    if pairs:
        p_items = preference_items(records, "bce")
        assert [(i[1], i[2], i[3]) for i in p_items] == [(i[1], i[2], i[3]) for i in q_items]


class _Algo(dict):
    __getattr__ = dict.__getitem__

    def __init__(self, **kw):
        super().__init__(kw)


def test_ground_truth_recipe_needs_a_known_answer(task):
    from pita.algos.collector import ground_truth_pairs
    from pita.datasets.base import Example

    col = _ScriptedCollector(task, {}, batch_size=8)
    with pytest.raises(
        ValueError, match="recipe=ground_truth_vs_first_wrong needs a task with a known answer"
    ):
        ground_truth_pairs(col, [0], [Example([1, 2], None, {})], max_tries=3)


@pytest.mark.long
@pytest.mark.slow
def test_star_graph_paper_config_runs_at_toy_size(tmp_path):
    """`experiment=star_graph_paper` (the GPU table) wired end to end at toy sizes on CPU:
    every row (reference, Q#, PITA, Q#-HF, DPO, RPO, GRPO) trains and is evaluated, the
    value rows with the V-type head, the official recipe and the hold-out diagnostics."""
    import csv

    from tests.conftest import run_ok

    args = [
        "experiment=star_graph_paper",
        "experiment.name=paper_toy",
        "executor.progress=false",
        "executor.cpu_workers=1",  # one worker importing torch, not one per core
        "model.memory_gb=0.5",
        "experiment.datasets=[star_graph]",
        "dataset=star_graph",  # dataset.* keys set the selected dataset (issue 45 item 1)
        "dataset.num_nodes=20",
        *[
            f"model.{m}.{k}={v}"
            for m in ("reference_arch", "guide_arch")
            for k, v in (("n_layer", 1), ("d_model", 32), ("n_head", 4))
        ],
        "pretrain.steps=20",
        "pretrain.batch_size=32",
        "generation.batch_size=64",
        "evaluation.batch_size=64",
        "evaluation.max_prompts=20",
        "data_collection.max_examples=48",
        "data_collection.max_tries=5",
        "algos.GRPO.steps=2",
        "algos.GRPO.batch_size=16",
        "algos.GRPO.num_generations=4",
        "algos.DPO.batch_size=16",
        "algos.RPO.batch_size=16",
        "algos.DPO.epochs=1",
        "algos.RPO.epochs=1",
        "algos.QSharp.probe_steps=10",
        "algos.PITA.probe_steps=10",
        *[
            f"algos.{a}.{k}={v}"
            for a in ("QSharp", "PITA", "QSharp-HF")
            for k, v in (("epochs", 1), ("holdout_fraction", 0.2))
        ],
    ]
    run_dir = run_ok(args, tmp_path, "paper_toy", timeout=900)
    with open(run_dir / "results" / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["algo"] for r in rows} == {
        "reference",
        "QSharp",
        "PITA",
        "QSharp-HF",
        "DPO",
        "RPO",
        "GRPO",
    }
    assert all(
        r["first_step_acc"] != "" and r["kl"] != "" for r in rows
    )  # acc_after_first_step may be blank
    tasks = run_dir / "tasks"
    for algo in ("QSharp", "PITA"):
        result = json.loads(
            (tasks / f"{algo}.star_graph.tiny.r0.train" / "result.json").read_text()
        )
        assert (
            result["value_head"] == "v"
            and "heldout_acc" in result
            and "probe_heldout_acc" in result
        )
        collect = (
            json.loads((tasks / f"{algo}.star_graph.tiny.r0.collect" / "stats.json").read_text())
            if (tasks / f"{algo}.star_graph.tiny.r0.collect" / "stats.json").is_file()
            else None
        )
        if collect is not None:  # pairs: half the records are ground truths (reward 1)
            assert collect["reward_sum"] * 2 == collect["records"]
