"""Data collection and rounds of the value-guided chains (Q#, PITA, Q#-HF):
token-consistent records, per-row roll-out budgets, preference labels, and a 2-round
chain through run_parallel.py in which round 1 rolls in with round 0's guide and
warm-starts from round 0's checkpoint."""

from __future__ import annotations

import csv
import json
import math
import random

import pytest
import torch

from pita.algos.collector import RolloutCollector, preference_label, preference_pairs
from pita.datasets.goal_walk import GoalWalkTask
from pita.models.tiny import build_tiny_llama
from tests.conftest import only, run_ok


@pytest.fixture(scope="module")
def task():
    return GoalWalkTask(num_nodes=8, out_degree=2, walk_length=3, seed=1)


def _collect(task, *, pairs: bool, samples: int = 8, seed: int = 0, hook=None):
    tok = task.tokenizer
    ref = build_tiny_llama(
        len(tok),
        n_layer=1,
        d_model=32,
        n_head=4,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        seed=seed,
    )
    torch.nn.init.normal_(ref.lm_head.weight, std=0.3)  # varied lengths: EOS sometimes early
    gen = RolloutCollector(
        ref,
        task,
        batch_size=16,
        max_new_tokens=task.max_new_tokens,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        roll_in_hook_factory=hook,
        reward_batch_size=7,
        seed=seed,
    )
    examples = task.train_examples()[:6]
    return examples, gen.collect(
        list(range(6)), examples, samples, pairs=pairs, bradley_terry_beta=10.0
    )


def test_records_are_token_consistent(task):
    from pita.algos.qsharp import reward_targets, training_items
    from pita.algos.value_training import build_targets

    examples, records = _collect(task, pairs=True)
    assert len(records) == 6 * 8
    budget = task.max_new_tokens
    for rec in records:
        ex = examples[rec["example"]]
        assert rec["prompt"] == ex.prompt_ids and rec["roll_in"] == "reference"
        response = rec["prefix"] + rec["rollout"]
        # the reward is the verifier's on exactly the stored ids (prefix + roll-out)
        assert rec["reward"] == task.rewards([ex], [response])[0]
        # the roll-in is prefix + original; the cut keeps c <= |y| - 2 tokens (h in 1..|y|-1)
        roll_in = rec["prefix"] + rec["original"]
        assert len(rec["prefix"]) <= max(0, len(roll_in) - 2)
        assert rec["reward_original"] == task.rewards([ex], [roll_in])[0]
        # each roll-out has its own budget: never longer than what the cut left
        assert len(response) <= budget and len(rec["rollout"]) >= 1
        if task.eos_id not in rec["rollout"]:
            assert len(response) == budget  # only the budget stops a row without EOS

    # the trained ids are the scored ids, token for token
    class Algo:
        loss_type, num_atoms, V_min, V_max = "bce", 11, 0.0, 1.0

    items = training_items(records, reward_targets([r["reward"] for r in records], Algo))
    for (prompt, response, start, target, _), rec in zip(items, records):
        assert prompt + response == rec["prompt"] + rec["prefix"] + rec["rollout"]
        assert start == 0 and target == [rec["reward"]]  # round 0: the whole response is π_ref's
    pad = task.tokenizer.pad_token_id
    data = build_targets(items, pad)
    rows, width = {tuple(r) for r in data["ids"].tolist()}, data["ids"].shape[1]
    assert all(tuple(p + s + [pad] * (width - len(p) - len(s))) in rows for p, s, *_ in items)


def test_guided_roll_in_is_marked_and_trains_from_the_cut(task):
    from transformers import LlamaModel

    from pita.algos.guidance import hook_factory
    from pita.algos.qsharp import training_items
    from pita.models.tiny import tiny_llama_config
    from pita.models.value_model import ValueModel

    vm = ValueModel(
        LlamaModel(tiny_llama_config(len(task.tokenizer), n_layer=1, d_model=32, n_head=4)),
        len(task.tokenizer),
    )
    factory = hook_factory(vm, 2.0, "bernoulli")
    _, records = _collect(task, pairs=False, samples=2, hook=factory)
    assert {r["roll_in"] for r in records} == {"guided"}
    assert factory.stats.forwards == factory.stats.steps > 0
    items = training_items(records, [[r["reward"]] for r in records])
    assert [i[2] for i in items] == [len(r["prefix"]) for r in records]


def test_preference_labels_and_pairs():
    rng = random.Random(0)
    assert preference_label(1.0, 0.0, 10.0, rng) == (1.0, 1.0)
    assert preference_label(0.0, 1.0, 10.0, rng) == (0.0, 0.0)
    draws = [preference_label(0.0, 0.0, 10.0, rng) for _ in range(2000)]
    assert all(p == 0.5 for _, p in draws) and 0.45 < sum(lab for lab, _ in draws) / 2000 < 0.55
    label, prob = preference_label(0.7, 0.5, 10.0, rng)
    assert prob == pytest.approx(1 / (1 + math.exp(-2.0))) and label in (0.0, 1.0)
    recs = [
        {
            "example": 0,
            "prompt": [1],
            "prefix": [2],
            "rollout": [3, 9],
            "original": [4, 9],
            "label": 1.0,
        },
        {
            "example": 0,
            "prompt": [1],
            "prefix": [2],
            "rollout": [3, 9],
            "original": [4, 9],
            "label": 0.0,
        },
        {
            "example": 1,
            "prompt": [1],
            "prefix": [],
            "rollout": [5, 9],
            "original": [5, 9],
            "label": 1.0,
        },
    ]
    pairs = preference_pairs(recs)
    assert pairs == [
        {"example": 0, "prompt": [1], "chosen": [2, 3, 9], "rejected": [2, 4, 9]},
        {"example": 0, "prompt": [1], "chosen": [2, 4, 9], "rejected": [2, 3, 9]},
    ]


def test_pita_items():
    from pita.algos.pita_algo import preference_items

    recs = [
        {"prompt": [1], "prefix": [2], "rollout": [3, 9], "original": [4, 9], "label": 1.0},
        {"prompt": [1], "prefix": [2], "rollout": [3, 9], "original": [3, 8], "label": 0.0},
    ]
    assert preference_items(recs, "bce") == [
        ([1], [2, 3, 9], 1, [1.0], None),
        ([1], [2, 3, 9], 1, [0.0], None),
    ]
    assert preference_items(recs, "bradley_terry") == [
        ([1], [2, 3], 1, [1.0], 4)
    ]  # same first token: no signal


def _rows(run_dir):
    with open(run_dir / "results" / "summary.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow  # an end-to-end run that trains for real: not in the quick set
def test_two_round_chain_through_run_parallel(tmp_path):
    """Round 1 collects with round 0's guide and its train stage loads round 0's checkpoint;
    the training data of round 1 is rounds 0 and 1 (DAgger)."""
    args = [
        "experiment=smoke",
        "experiment.name=chain",
        "executor.progress=false",
        "executor.cpu_workers=1",  # one worker importing torch, not one per core
        "rounds_of_training=2",
        *only("reference", "QSharp", "PITA"),
        "pretrain.steps=30",
        "dataset.test_size=50",
        "evaluation.max_prompts=20",
        "data_collection.max_examples=16",
    ]
    for algo in ("QSharp", "PITA"):
        args += [
            f"algos.{algo}.steps=20",
            f"algos.{algo}.samples_per_example=2",
            f"algos.{algo}.batch_size=32",
        ]
    run_dir = run_ok(args, tmp_path, "chain", timeout=300)
    rows = _rows(run_dir)
    for algo in ("QSharp", "PITA"):
        got = {(r["round"], float(r["eta"])) for r in rows if r["algo"] == algo}
        assert got == {("0", 0.0), ("0", 5.0), ("1", 0.0), ("1", 5.0)}, got
        tasks = run_dir / "tasks"
        r1 = json.loads((tasks / f"{algo}.goal_walk.tiny.r1.train" / "result.json").read_text())
        assert (
            r1["init"] == f"previous:{algo}.goal_walk.tiny.r0.train"
        )  # round 2 loads round 1's checkpoint
        r0 = json.loads((tasks / f"{algo}.goal_walk.tiny.r0.train" / "result.json").read_text())
        assert r0["init"] == "reference" and r1["records"] == 2 * r0["records"]  # rounds 0 + 1
        shard = json.loads(
            (tasks / f"{algo}.goal_walk.tiny.r1.collect.s00" / "result.json").read_text()
        )
        assert shard["guided"] is True and shard["value_forwards"] == shard["decode_steps"] > 0
        assert (
            tasks / f"{algo}.goal_walk.tiny.r1.train" / "value_model" / "model.safetensors"
        ).is_file()
