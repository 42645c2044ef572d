"""The TRL baselines: DPO pairs and training, GRPO (verifier and proxy reward), the reward model.

Unit tests build a StageContext over a temporary run folder holding a tiny random Llama as
π_ref (no pretraining: a random policy is enough to check that training moves the weights
and writes a checkpoint `from_pretrained` loads); the end-to-end test runs the real command
line with DPO, GRPO and GRPO-HF at smoke size.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tests.conftest import only, run_cli, run_dirs, task_spec

torch = pytest.importorskip("torch")
pytest.importorskip("trl")

from pita.algos.dpo import preference_pairs  # noqa: E402
from pita.datasets import build_task  # noqa: E402

GOAL_WALK = {
    "name": "goal_walk",
    "num_nodes": 8,
    "out_degree": 2,
    "walk_length": 3,
    "seed": 0,
    "test_size": 20,
}


# --- pair construction ------------------------------------------------------------------------


def test_binary_pairs_match_each_failure_with_a_success():
    responses = [[1, 9], [2, 9], [1, 9], [3, 9], [4, 9], [2, 9]]
    rewards = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    pairs = preference_pairs(responses, rewards, binary=True, max_pairs=8)
    # distinct failures [2,9] and [4,9], each against a distinct success in turn
    assert pairs == [([1, 9], [2, 9]), ([3, 9], [4, 9])]
    assert preference_pairs(responses, rewards, binary=True, max_pairs=1) == [([1, 9], [2, 9])]
    # all right or all wrong (no target): nothing to prefer
    assert preference_pairs([[1], [2]], [1.0, 1.0], binary=True, max_pairs=8) == []
    assert preference_pairs([[1], [2]], [0.0, 0.0], binary=True, max_pairs=8) == []


def test_star_graph_pairs_are_ground_truth_against_the_wrong_sample():
    task = build_task({"name": "star_graph", "train_size": 4, "test_size": 10})
    ex = task.train_examples()[0]
    wrong_arm = [n for n in range(task.num_nodes) if n not in ex.meta["path"]][:4]
    wrong = [ex.meta["source"], *wrong_arm, task.eos_id]
    responses = [wrong, wrong, list(ex.target_ids)]
    rewards = task.rewards([ex] * 3, responses)
    assert rewards == [0.0, 0.0, 1.0]
    # a correct sample is the target itself; without one, the target is still the chosen side
    for resp, rew in ((responses, rewards), (responses[:2], rewards[:2])):
        pairs = preference_pairs(resp, rew, binary=True, max_pairs=8, target=ex.target_ids)
        assert pairs == [(list(ex.target_ids), wrong)]


def test_real_valued_pairs_prefer_the_higher_reward():
    responses = [[1], [2], [3], [4], [5]]
    rewards = [0.2, 0.9, 0.5, 0.5, 0.1]
    pairs = preference_pairs(responses, rewards, binary=False, max_pairs=8)
    assert pairs == [([2], [5]), ([3], [1])]  # 0.9 > 0.1, 0.5 > 0.2; the middle one has no partner
    assert (
        preference_pairs([[1], [2]], [0.5, 0.5], binary=False, max_pairs=8) == []
    )  # ties: no preference
    assert preference_pairs(responses, rewards, binary=False, max_pairs=1) == [([2], [5])]


# --- the reward adapters --------------------------------------------------------------------------


def test_task_reward_adapter_takes_trl_style_calls():
    from pita.algos.grpo import ProxyReward, TaskReward

    task = build_task(GOAL_WALK)
    examples = task.train_examples()
    ex = examples[3]
    s, g = ex.meta["source"], ex.meta["goal"]
    walk = _walk_to(task, s, g)
    good, bad = [*walk, task.eos_id], [*walk]  # the second has no EOS: reward 0
    completion_ids = [good, bad, good]
    reward = TaskReward(task, examples)
    out = reward(
        prompts=["START ..."] * 3,
        completions=["a", "b", "c"],
        completion_ids=completion_ids,
        example=[3, 3, 0],
        trainer_state=None,
        log_extra=lambda *a: None,
        log_metric=lambda *a: None,
    )
    assert out == task.rewards([ex, ex, examples[0]], completion_ids)
    assert out[:2] == [1.0, 0.0]

    class FakeScorer:
        def score(self, prompts, responses):
            self.seen = (prompts, responses)
            return [float(len(r)) for r in responses]

    scorer, logged = FakeScorer(), {}
    proxy = ProxyReward(scorer, examples, task)
    out = proxy(
        prompts=["x"] * 2,
        completions=["a", "b"],
        completion_ids=[good, bad],
        example=[3, 3],
        log_metric=lambda name, value: logged.update({name: value}),
    )
    assert out == [4.0, 3.0] and scorer.seen[0] == [ex.prompt_ids] * 2
    assert logged == {"true_reward": 0.5}


def _walk_to(task, s: int, g: int) -> list[int]:
    """A walk of the task's length from s to g (exists: g is reachable in exactly L steps)."""
    paths = [[s]]
    for _ in range(task.walk_length):
        paths = [p + [v] for p in paths for v in task.graph[p[-1]]]
    return next(p[1:] for p in paths if p[-1] == g)


# --- stages on a temporary run folder --------------------------------------------------------------


def _run_folder(tmp_path: Path, steps: int = 60) -> Path:
    """tasks/pretrain holds a tiny Llama taught random walks for a few steps (so that some of
    its samples succeed) + the goal-walk tokenizer, like the pretrain stage's output."""
    import random

    from pita.models.tiny import build_tiny_llama
    from pita.stages.pretrain import teacher_forcing_batch

    task = build_task(GOAL_WALK)
    tok = task.tokenizer
    model = build_tiny_llama(
        len(tok),
        n_layer=1,
        d_model=32,
        n_head=2,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        seed=0,
    ).train()
    optim, rng = torch.optim.AdamW(model.parameters(), lr=1e-2), random.Random(0)
    for _ in range(steps):
        ids, mask, labels = teacher_forcing_batch(task.pretrain_batch(rng, 64), tok.pad_token_id)
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        optim.step()
        optim.zero_grad()
    model.eval()
    folder = tmp_path / "tasks" / "pretrain" / "model"
    model.save_pretrained(folder)
    task.save_tokenizer(str(folder))
    return tmp_path


def _ctx(run_dir: Path, algo: str, stage: str, inputs: dict, overrides: list[str], name: str):
    from pita.experiment.cli import compose_config
    from pita.runtime.context import StageContext

    cfg = compose_config([f"algos.{algo}.enabled=true", *overrides])
    task = task_spec(
        name,
        algo=algo,
        stage=stage,
        fn="-",
        inputs={"reference": "pretrain", **inputs},
        dataset_cfg=GOAL_WALK,
        family_cfg={"reference_arch": {"n_layer": 1, "d_model": 32, "n_head": 2}},
    )
    key = str(cfg.training.parallel_strategy)
    if key != "auto":  # the gang strategy the planner gives a training stage (its world: 1)
        task.strategy = key
    out = run_dir / "tasks" / name
    out.mkdir(parents=True)
    logger = logging.getLogger(f"test.baselines.{name}")
    return StageContext(task=task, cfg=cfg, run_dir=run_dir, out_dir=out, logger=logger)


def _params(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _changed(before: dict, folder: Path) -> list[str]:
    from transformers import AutoModelForCausalLM

    after = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    return [k for k in before if not torch.equal(before[k], after[k])]


def test_dpo_collect_and_train_write_a_loadable_policy(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pita.algos import dpo

    run = _run_folder(tmp_path)
    # collect: a random policy's samples are mostly wrong; the pairs need a success per prompt
    ctx = _ctx(run, "DPO", "collect", {}, ["algos.DPO.samples_per_example=64"], "collect")
    result = dpo.collect(ctx)
    records = [json.loads(line) for line in (ctx.out_dir / "pairs.jsonl").read_text().splitlines()]
    assert result["pairs"] == len(records) > 0
    task = build_task(GOAL_WALK)
    examples = task.train_examples()
    for r in records[:50]:  # chosen succeeds, rejected fails, prompt ids are the example's
        ex = examples[r["example"]]
        assert r["prompt"] == ex.prompt_ids
        assert task.rewards([ex, ex], [r["chosen"], r["rejected"]]) == [1.0, 0.0]

    ref = run / "tasks" / "pretrain" / "model"
    before = _params(AutoModelForCausalLM.from_pretrained(ref))
    ctx = _ctx(
        run,
        "DPO",
        "train",
        {"data": ["collect"]},
        [
            "algos.DPO.lr=1e-2",
            "algos.DPO.epochs=1",
            "algos.DPO.batch_size=16",
            "algos.DPO.sft_weight=1.0",
        ],
        "train",
    )
    result = dpo.train(ctx)
    assert result["pairs"] == len(records) and result["steps"] >= 1
    assert _changed(before, ctx.out_dir / "model")
    assert (
        AutoTokenizer.from_pretrained(ctx.out_dir / "model").get_vocab()
        == task.tokenizer.get_vocab()
    )
    assert (ctx.out_dir / "train_log.jsonl").is_file()


def test_grpo_trains_on_a_reward_function_and_writes_a_loadable_policy(tmp_path):
    from pita.algos.grpo import run_grpo

    run = _run_folder(tmp_path)
    before = _params(
        __import__("transformers").AutoModelForCausalLM.from_pretrained(
            run / "tasks/pretrain/model"
        )
    )
    ctx = _ctx(
        run,
        "GRPO",
        "train",
        {},
        [
            "algos.GRPO.steps=2",
            "algos.GRPO.batch_size=16",
            "algos.GRPO.num_generations=4",
            "algos.GRPO.lr=1e-2",
        ],
        "train",
    )
    task = build_task(GOAL_WALK)
    calls = []

    def first_token_parity(completion_ids, example, **kwargs):  # dense, so every group has a signal
        calls.append(len(completion_ids))
        return [float(ids[0] % 2) if ids else 0.0 for ids in completion_ids]

    result = run_grpo(ctx, task, task.train_examples(), first_token_parity)
    assert result["steps"] == 2 and calls and all(n == 16 for n in calls)
    assert _changed(before, ctx.out_dir / "model")


def test_reward_model_learns_an_easy_preference_and_scores_it(tmp_path):
    from pita.algos.reward_model import load_reward_scorer, pairwise_accuracy, train_reward_model

    run = _run_folder(tmp_path)
    task = build_task(GOAL_WALK)
    a, b = 1, 2  # chosen responses end with node a before EOS, rejected ones with node b
    data = run / "tasks" / "collect"
    data.mkdir(parents=True)
    with open(data / "pairs.jsonl", "w") as f:
        for i, ex in enumerate(task.train_examples()):
            mid = [i % 8, (i * 3) % 8]
            f.write(
                json.dumps(
                    {
                        "example": i,
                        "prompt": ex.prompt_ids,
                        "chosen": [*mid, a, task.eos_id],
                        "rejected": [*mid, b, task.eos_id],
                    }
                )
                + "\n"
            )
    ctx = _ctx(
        run,
        "GRPO-HF",
        "reward_model",
        {"data": ["collect"]},
        [
            "algos.GRPO-HF.reward_epochs=20",
            "algos.GRPO-HF.reward_lr=3e-3",
            "algos.GRPO-HF.batch_size=32",
        ],
        "reward_model",
    )
    result = train_reward_model(ctx)
    assert result["heldout_pairs"] > 0 and result["heldout_accuracy"] > 0.8, result
    assert (ctx.out_dir / "reward_model" / "config.json").is_file()

    scorer = load_reward_scorer(ctx, ctx.out_dir)  # the task folder; its reward_model/ is found
    assert load_reward_scorer(ctx, ctx.out_dir / "reward_model") is scorer  # through the worker LRU
    records = [json.loads(line) for line in (data / "pairs.jsonl").read_text().splitlines()]
    assert pairwise_accuracy(scorer, records) > 0.8


# --- end to end --------------------------------------------------------------------------------------


@pytest.mark.long
@pytest.mark.slow
def test_dpo_grpo_and_grpo_hf_chains_through_the_command_line(tmp_path):
    name = "baselines_smoke"
    res = run_cli(
        [
            *only("DPO", "GRPO", "GRPO-HF"),
            f"experiment.name={name}",
            "executor.progress=false",
            "executor.cpu_workers=1",  # one worker importing torch, not one per core
            "pretrain.steps=30",
            "pretrain.batch_size=64",
            "evaluation.max_prompts=20",
            "dataset.test_size=50",
            "evaluation.num_samples=2",
            "data_collection.max_examples=32",
            "algos.DPO.epochs=1",
            "algos.DPO.samples_per_example=8",
            "algos.GRPO.steps=2",
            "algos.GRPO.batch_size=16",
            "algos.GRPO.num_generations=4",
            "algos.GRPO-HF.steps=2",
            "algos.GRPO-HF.batch_size=16",
            "algos.GRPO-HF.num_generations=4",
            "algos.GRPO-HF.samples_per_example=8",
            "algos.GRPO-HF.reward_epochs=1",
            "rounds_of_training=2",
        ],
        cwd=tmp_path,
        timeout=240,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    run = run_dirs(tmp_path, name)[-1]
    rows = (run / "results" / "summary.csv").read_text().splitlines()
    header = rows[0].split(",")
    algos = {r.split(",")[header.index("algo")] for r in rows[1:]}
    assert (
        algos == {"DPO", "GRPO", "GRPO-HF"} and len(rows) == 1 + 3 * 2
    )  # every chain, both rounds
    for r in rows[1:]:
        values = dict(zip(header, r.split(",")))
        assert values["pass@1"] != "" and values["kl"] != ""
    tasks = run / "tasks"
    for chain in ("DPO", "GRPO", "GRPO-HF"):
        model = tasks / f"{chain}.goal_walk.tiny.r0.train" / "model"
        assert (model / "config.json").is_file() and (model / "tokenizer.json").is_file()
        # round 1 starts from round 0's policy; the KL / DPO reference stays π_ref
        r1 = json.loads((tasks / f"{chain}.goal_walk.tiny.r1.train" / "result.json").read_text())
        assert r1["start"] == str(model)
        log = (tasks / f"{chain}.goal_walk.tiny.r1.train" / "log.txt").read_text()
        assert f"reference {tasks / 'pretrain.goal_walk.tiny' / 'model'}" in log
    # round 1 of DPO samples its pairs with round 0's policy
    collect_log = (tasks / "DPO.goal_walk.tiny.r1.collect.s00" / "log.txt").read_text()
    assert f"sampling with {tasks / 'DPO.goal_walk.tiny.r0.train' / 'model'}" in collect_log
