"""A local family (byte-level BPE trained here, random-weight Llamas, GSM8K-format data):
the TRL trainers work in token space, and every algorithm runs end to end through
run_parallel.py with comparable rows (see tests/local_family.py for the fixture)."""

from __future__ import annotations

import csv
import dataclasses
import math
import random
from concurrent.futures import Future
from pathlib import Path

import pytest

from tests.conftest import ALGOS, run_cli_later, run_dirs


def _trl_args(config_cls, tmp_path, **extra):
    """A minimal CPU config for one TRL step (fp32, no checkpointing, no reporting)."""
    names = {f.name for f in dataclasses.fields(config_cls)}
    ckpt = (
        "activation_checkpointing"
        if "activation_checkpointing" in names
        else "gradient_checkpointing"
    )
    return config_cls(
        output_dir=str(tmp_path / "trainer"),
        per_device_train_batch_size=4,
        max_steps=1,
        learning_rate=1e-3,
        use_cpu=True,
        bf16=False,
        fp16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
        **{ckpt: False},
        **extra,
    )


def _random_ids(rng: random.Random, tok, n: int) -> list[int]:
    """Ids a random-weight model could sample: any non-special token."""
    return [rng.randrange(len(tok.all_special_ids), len(tok)) for _ in range(n)]


def _not_round_tripping(tok, ids_list) -> int:
    return sum(
        tok(tok.decode(ids), add_special_tokens=False)["input_ids"] != list(ids) for ids in ids_list
    )


def test_dpo_trains_on_the_sampled_token_ids(local_family, tmp_path):
    """Preference pairs whose text does not tokenize back to the sampled ids (the failure of
    issue 12) reach DPO's collator as exactly those ids, and a step trains on them."""
    from datasets import Dataset
    from trl import DPOConfig

    from pita.algos.dpo import check_token_dataset, pairs_as_ids, token_dpo_trainer
    from pita.models.loading import load_causal_lm, load_tokenizer

    tok = load_tokenizer(str(local_family.reference))
    rng = random.Random(0)
    records = [
        {
            "example": i,
            "prompt": tok("Ann has 3 apples.")["input_ids"],
            "chosen": _random_ids(rng, tok, 6),
            "rejected": _random_ids(rng, tok, 5) + [tok.eos_token_id],
        }
        for i in range(8)
    ]
    assert (
        _not_round_tripping(tok, [r["chosen"] for r in records]) >= 6
    )  # text would change most of them
    ids = pairs_as_ids(records, tok.eos_token_id)
    assert ids["chosen_ids"][0] == records[0]["chosen"] + [
        tok.eos_token_id
    ]  # EOS added where missing
    assert ids["rejected_ids"][0] == records[0]["rejected"]  # never twice

    policy, ref = (load_causal_lm(str(local_family.reference), dtype="float32") for _ in range(2))
    before = {k: v.clone() for k, v in policy.named_parameters()}
    trainer = token_dpo_trainer()(
        model=policy,
        ref_model=ref,
        args=_trl_args(DPOConfig, tmp_path, beta=0.1, max_length=None),
        train_dataset=Dataset.from_dict(ids),
        processing_class=tok,
    )
    check_token_dataset(trainer.train_dataset, ids)  # the trainer holds our ids, unchanged
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    row = batch["input_ids"][0][batch["attention_mask"][0].bool()].tolist()
    assert row == ids["prompt_ids"][0] + ids["chosen_ids"][0]
    trainer.train()
    assert math.isfinite(trainer.state.log_history[-1]["train_loss"])
    assert any(not (p == before[k]).all() for k, p in policy.named_parameters())

    tampered = {**ids, "chosen_ids": [ids["chosen_ids"][1], *ids["chosen_ids"][1:]]}
    with pytest.raises(RuntimeError, match="chosen_ids differ from the collected token ids"):
        check_token_dataset(trainer.train_dataset, tampered)


def test_grpo_generates_from_the_prompt_ids(local_family, tmp_path, monkeypatch):
    """GRPO's generation starts from each example's own prompt ids (not re-tokenized text),
    also for prompts whose text would tokenize differently. pita samples GRPO's completions
    itself (`pita.algos.grpo._seeded_completions`: one seed per row), so the prompts are
    read where pita's sampler receives them."""
    from trl import GRPOConfig

    import pita.models.generation as generation
    from pita.algos.grpo import prompt_dataset, token_grpo_trainer
    from pita.datasets.base import Example
    from pita.models.loading import load_causal_lm, load_tokenizer

    tok = load_tokenizer(str(local_family.reference))
    rng = random.Random(1)
    examples = [Example([tok.bos_token_id, *_random_ids(rng, tok, 5)], None, {}) for _ in range(4)]
    assert _not_round_tripping(tok, [e.prompt_ids[1:] for e in examples]) >= 2
    policy = load_causal_lm(str(local_family.reference), dtype="float32")
    seen_prompts: list[list[int]] = []
    generate = generation.generate

    def recording_generate(model, prompts, *args, **kwargs):
        seen_prompts.extend(list(p) for p in prompts)
        return generate(model, prompts, *args, **kwargs)

    monkeypatch.setattr(generation, "generate", recording_generate)
    rewarded: list[tuple[int, list[int]]] = []

    def reward(prompts, completions, completion_ids, example, **kwargs):
        rewarded.extend(zip(example, completion_ids))
        return [float(len(c)) for c in completion_ids]

    args = _trl_args(GRPOConfig, tmp_path, num_generations=2, max_completion_length=4, beta=0.0)
    trainer = token_grpo_trainer([e.prompt_ids for e in examples], seed=0)(
        model=policy,
        reward_funcs=reward,
        args=args,
        train_dataset=prompt_dataset(examples, tok),
        processing_class=tok,
    )
    trainer.train()
    assert seen_prompts and all(p in [e.prompt_ids for e in examples] for p in seen_prompts)
    assert {i for i, _ in rewarded} <= set(range(4)) and len(rewarded) == len(seen_prompts)


def _summary(run_dir):
    with open(run_dir / "results" / "summary.csv") as f:
        return list(csv.DictReader(f))


def local_run_args(family, *extra: str, dataset: str = "gsm8k") -> list[str]:
    """Every algorithm at toy sizes on the local family: 8 training prompts, 4 samples each,
    4 test prompts x 2 samples, 12 new tokens, a few optimizer steps, one round."""
    sizes = [
        "evaluation.num_samples=2",
        "evaluation.etas=[0.0,5.0]",
        "data_collection.samples_per_example=4",
        "data_collection.max_examples=8",
        "executor.progress=false",
        "experiment.name=local",
    ]
    per_algo = []
    for algo in ALGOS[1:]:
        per_algo.append(f"algos.{algo}.enabled=true")
        if algo != "GRPO":
            per_algo.append(f"algos.{algo}.samples_per_example=4")
    for algo in ("PITA", "QSharp", "QSharp-HF"):
        per_algo += [f"algos.{algo}.steps=4", f"algos.{algo}.batch_size=16"]
    for algo in ("GRPO", "GRPO-HF"):
        per_algo += [
            f"algos.{algo}.steps=2",
            f"algos.{algo}.batch_size=8",
            f"algos.{algo}.num_generations=4",
        ]
    per_algo += [
        "algos.DPO.epochs=1",
        "algos.DPO.batch_size=8",
        "algos.RPO.epochs=1",
        "algos.RPO.batch_size=8",
        "algos.QSharp-HF.reward_epochs=1",
        "algos.GRPO-HF.reward_epochs=1",
    ]
    return [*family.overrides(dataset), *sizes, *per_algo, *extra]


def expected_rows() -> set[tuple[str, str, str]]:
    """(algo, eta, sampling) of every summary row a `local_run_args` run ends with: the
    reference under both rules, each guided algorithm at both η, each trained policy once."""
    guided = "top-2, T=1"
    rows = {("reference", "0.0", "full, T=1"), ("reference", "0.0", guided)}
    rows |= {(a, eta, guided) for a in ("PITA", "QSharp", "QSharp-HF") for eta in ("0.0", "5.0")}
    return rows | {(a, "", "full, T=1") for a in ("DPO", "RPO", "GRPO", "GRPO-HF")}


@pytest.fixture(scope="module")
def every_algorithm_runs(local_family, tmp_path_factory) -> dict[str, tuple[Path, Future]]:
    """Every algorithm on each dataset of the local family, both runs started together (a
    run seldom keeps both cores busy): {dataset: (cwd, the finished run's future)}."""
    runs = {}
    for dataset in ("gsm8k", "imdb"):
        cwd = tmp_path_factory.mktemp(f"local_{dataset}")
        # one worker each (both runs go on at once; each worker imports torch)
        args = local_run_args(
            local_family, "model.device_map=auto", "executor.cpu_workers=1", dataset=dataset
        )
        runs[dataset] = (cwd, run_cli_later(args, cwd, timeout=600))
    return runs


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize("dataset", ["gsm8k", "imdb"])
def test_every_algorithm_runs_on_the_local_family(every_algorithm_runs, dataset):
    """All eight algorithms (DPO and RPO are two rows) through run_parallel.py on CPU with a BPE tokenizer and
    save_pretrained checkpoints, on GSM8K-format data (verifier reward) and IMDB-format data
    (scored by the family's sequence-classification reward model): every expected row
    exists, every number is finite, and the rows are comparable (the η = 0 guided rows are
    π_ref under the guided rule: KL 0, with a reference row under the same rule)."""
    cwd, future = every_algorithm_runs[dataset]
    proc = future.result()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [run_dir] = run_dirs(cwd, "local")
    rows = _summary(run_dir)
    got = {(r["algo"], r["eta"], r["sampling"]) for r in rows}
    expected = expected_rows()
    assert got == expected, got
    assert len(rows) == len(expected)
    for r in rows:
        assert r["dataset"] == dataset and r["family"] == "local" and r["n_prompts"] == "4", r
        for key in (
            "pass@1",
            "maj@k",
            "avg_reward",
            "kl",
            "wall_s",
            *(["has_answer"] if dataset == "gsm8k" else []),
        ):
            assert math.isfinite(float(r[key])), (key, r)
    for r in rows:
        if r["algo"] == "reference" or r["eta"] == "0.0":  # π_ref under its own rule
            assert float(r["kl"]) == 0.0, r
    result = (run_dir / "tasks" / f"DPO.{dataset}.local.r0.train" / "result.json").read_text()
    assert '"pairs": ' in result and "round-trip" not in proc.stdout
    if dataset == "imdb":  # real-valued rewards from the family's reward model, not a constant
        assert len({r["avg_reward"] for r in rows}) > 3


def test_eta_zero_guided_row_is_the_reference_row_under_the_guided_rule(local_family):
    """The guided chain's η = 0 policy and the reference chain's row under the guided rule
    are the same sampler (identical draws from one seed, KL 0), the reference chain also
    keeps its generation-rule row, and the KL reference of an η > 0 row (teacher-forced
    π_ref under the rule) is the distribution the sampler reports for π_ref."""
    from types import SimpleNamespace

    import torch
    from omegaconf import OmegaConf

    from pita.models.generation import forced_logprobs, generate
    from pita.models.loading import load_causal_lm, load_tokenizer
    from pita.stages.evaluate import eval_policies

    cfg = OmegaConf.create(
        {
            "generation": {"top_k": 0, "temperature": 0.7, "top_p": 1.0},
            "evaluation": {"etas": [0.0]},  # η > 0 would load a value model
            "algos": {
                "QSharp": {"enabled": True, "guidance": {"top_k": 3}},
                "PITA": {"enabled": False, "guidance": {"top_k": 5}},
            },
        }
    )
    ref = load_causal_lm(str(local_family.reference), dtype="float32")
    tok = load_tokenizer(str(local_family.reference))

    from pita.core.schema import EvaluationConfig, GenerationConfig, settings
    from pita.runtime.context import algo_settings

    def ctx(algo):
        return SimpleNamespace(
            task=SimpleNamespace(algo=algo),
            cfg=cfg,
            generation=settings(GenerationConfig, cfg.generation),
            evaluation=settings(EvaluationConfig, cfg.evaluation),
            input=lambda name: local_family.guide,
            algo_settings=lambda name, schema: algo_settings(cfg, name, schema),
        )

    reference_rows = eval_policies(ctx("reference"), ref)
    assert [p.rule.label for p in reference_rows] == [
        "full, T=0.7",
        "top-3, T=0.7",
    ]  # PITA is disabled
    eta0 = [p for p in eval_policies(ctx("QSharp"), ref) if p.eta == 0.0]
    assert len(eta0) == 1 and eta0[0].hook_factory is None and eta0[0].is_reference
    assert eta0[0].rule == reference_rows[1].rule

    prompts = [tok(f"Bob has {n} cups.")["input_ids"] for n in range(6)]

    def sample(policy):
        return generate(
            policy.model,
            prompts,
            max_new_tokens=8,
            batch_size=3,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
            generator=torch.Generator().manual_seed(5),
            offset_hook_factory=policy.hook_factory,
            **policy.rule.kwargs(),
        )

    a, b = sample(eta0[0]), sample(reference_rows[1])
    assert a.responses == b.responses and a.logprobs == b.logprobs
    full = sample(reference_rows[0])
    assert full.responses != a.responses  # the full distribution is another row

    forced = forced_logprobs(
        ref,
        prompts,
        a.responses,
        batch_size=6,
        pad_token_id=tok.pad_token_id,
        **eta0[0].rule.kwargs(),
    )[0]
    for x, y in zip(forced, a.logprobs):
        assert x == pytest.approx(y, abs=1e-4)
    assert all(len(r) == 8 or r[-1] == tok.eos_token_id for r in a.responses)
    plain = forced_logprobs(ref, prompts, a.responses, batch_size=6, pad_token_id=tok.pad_token_id)[
        0
    ]
    assert sum(map(sum, plain)) < sum(
        map(sum, forced)
    )  # the full distribution spreads mass off the top-3
