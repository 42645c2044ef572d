"""evaluate: sample the test prompts with a round's policy at every η, then score them.

`evaluate_shard` generates `evaluation.num_samples` samples for its slice of the test
prompts (sample s of prompt i seeded by (i, s), not by the shard: the rows do not depend on
the number of devices, tests/test_shard_invariance.py) and writes one record per sample (token ids, reward, answer, log-probs) to
`samples.jsonl`; `evaluate_merge` reads every shard and computes the metrics of
docs/ALGORITHMS.md per (η, sampling rule) into `metrics.json`, which the report turns into the
results table.

Sampling rules and KL. Every row names its sampling rule in the `sampling` column
(`top-k` candidates, temperature, top-p) and carries the three KL columns of
docs/ALGORITHMS.md ("KL: the three columns"): `kl`, the Monte-Carlo KL(π ‖ π_ref^rule)
against π_ref under *that same rule* (top-k of π_ref's logits, renormalised, at the same
temperature), +inf when a sample leaves π_ref^rule's support; `kl_full`, against the
untruncated π_ref (always finite); `off_support`, the share of samples outside π_ref^rule's
support. So two rows with the same `sampling` compare like with like, and a policy that is
π_ref under its rule has KL exactly 0:
- reference: π_ref under the generation rule (`generation.top_k`, full distribution by
  default), plus one row per guided rule in use (`algos.<guided>.guidance.top_k`): the row
  the guided chains' η = 0 rows are (the same distribution; KL 0 both);
- PITA / QSharp / QSharp-HF: π_ref's top `guidance.top_k` tokens guided by the round's
  value model at every η of `evaluation.etas`; η = 0 *is* π_ref^rule; for η > 0, log
  π_ref^rule of the samples comes from one teacher-forced forward of π_ref per batch;
- DPO / RPO / GRPO / GRPO-HF: the round's trained policy under the generation rule, KL
  against π_ref under the generation rule (teacher-forced). With `generation.top_k` > 0 a
  token outside π_ref's top-k makes `kl` infinite, as it is; `kl_full` and `off_support`
  say how far and how often (`tests/test_kl.py`).

Models are loaded through `pita.models.placement.load_stage_lm` (dtype, -8bit / -4bit,
`model.device_map=auto` sharding over the gang); a sharded model's layer distribution is
returned in `run_log_lines`, which the orchestrator writes to run.log.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pita.algos.registry import ALGORITHMS, GUIDED, REFERENCE
from pita.core.paths import Artifact, atomic_write_json
from pita.core.schema import ValueGuidedConfig
from pita.runtime.batching import generation_batch_size
from pita.runtime.context import StageContext


def test_examples(ctx: StageContext, task) -> list:
    examples = task.test_examples()
    if ctx.evaluation.max_prompts:
        examples = examples[: ctx.evaluation.max_prompts]
    return examples


@dataclass(frozen=True)
class SamplingRule:
    """How tokens are drawn from a policy's logits (and what π_ref^rule, the KL reference, is)."""

    top_k: int
    temperature: float
    top_p: float

    @property
    def label(self) -> str:
        """`top-2, T=1` / `full, T=0.7, top_p=0.9`: the results table's `sampling` column."""
        parts = [f"top-{self.top_k}" if self.top_k > 0 else "full", f"T={self.temperature:g}"]
        if self.top_p < 1.0:
            parts.append(f"top_p={self.top_p:g}")
        return ", ".join(parts)

    def kwargs(self) -> dict[str, Any]:
        return {"top_k": self.top_k, "temperature": self.temperature, "top_p": self.top_p}


@dataclass
class EvalPolicy:
    """One row's policy: sample `model` under `rule` (+ offsets from `hook_factory`)."""

    eta: float | None
    model: Any
    rule: SamplingRule
    hook_factory: Callable | None = None
    is_reference: bool = (
        False  # the sampled distribution is π_ref^rule itself (KL 0, no extra forward)
    )


def generation_rule(ctx: StageContext) -> SamplingRule:
    gen = ctx.generation
    return SamplingRule(int(gen.top_k), float(gen.temperature), float(gen.top_p))


def guided_rule(ctx: StageContext, algo: str) -> SamplingRule:
    """`algos.<algo>.guidance.top_k` under the generation temperature and top-p (read through
    `ctx.algo_settings`: recorded, so a resume that changes it re-runs this task)."""
    gen, guided = ctx.generation, ctx.algo_settings(algo, ValueGuidedConfig)
    assert guided is not None, f"algos.{algo}: a guided chain's own settings"
    return SamplingRule(int(guided.guidance.top_k), float(gen.temperature), float(gen.top_p))


def reference_rules(ctx: StageContext) -> list[SamplingRule]:
    """The generation rule, then each distinct rule of an enabled guided algorithm."""
    rules = [generation_rule(ctx)]
    for algo in GUIDED:
        guided = ctx.algo_settings(algo, ALGORITHMS[algo].schema)
        if guided is not None and guided.enabled and guided_rule(ctx, algo) not in rules:
            rules.append(guided_rule(ctx, algo))
    return rules


def eval_policies(ctx: StageContext, ref) -> list[EvalPolicy]:
    """The rows this chain's evaluation samples (see the module docstring)."""
    algo = ctx.task.algo
    if algo in REFERENCE:
        return [EvalPolicy(0.0, ref, rule, is_reference=True) for rule in reference_rules(ctx)]
    if algo in GUIDED:
        from pita.algos.guidance import guided_hook_factory

        guide_dir, rule = ctx.input("policy"), guided_rule(ctx, algo)
        return [
            EvalPolicy(
                float(eta),
                ref,
                rule,
                hook_factory=guided_hook_factory(ctx, guide_dir, float(eta)) if eta > 0 else None,
                is_reference=not eta > 0,
            )
            for eta in ctx.evaluation.etas
        ]
    return [
        EvalPolicy(None, ctx.load_model(ctx.input("policy") / Artifact.MODEL), generation_rule(ctx))
    ]


def sample_kls(
    policy: EvalPolicy, ref, prompts: list[list[int]], out, *, batch_size: int, pad_token_id: int
) -> list[dict]:
    """Each sample's KL terms (`pita.eval.metrics.sample_kl`) against π_ref under the row's
    rule and against the untruncated π_ref. A policy sampled from π_ref's own logits (the
    reference and guided rows) has π_ref's raw log-probs in `out.base_logprobs`; π_ref^rule
    is the sampled distribution itself for an unguided reference row, else one
    teacher-forced forward of π_ref per batch gives both."""
    from pita.eval.metrics import sample_kl
    from pita.models.generation import forced_logprobs

    if policy.is_reference:  # sampled from π_ref^rule itself
        rule_lp, full_lp = out.logprobs, out.base_logprobs
    else:
        rule_lp, full_lp = forced_logprobs(
            ref,
            prompts,
            out.responses,
            batch_size=batch_size,
            pad_token_id=pad_token_id,
            **policy.rule.kwargs(),
        )
        if policy.model is ref:  # guided: the sampler already read π_ref's raw log-probs
            full_lp = out.base_logprobs
    return [sample_kl(a, b, c) for a, b, c in zip(out.logprobs, rule_lp, full_lp)]


def _sample(
    policy: Any,
    prompts: list[list[int]],
    seeds: list[int],
    max_new: int,
    batch_size: int,
    tok: Any,
    on_batch: Any,
) -> Any:
    """`policy`'s samples of `prompts` under its sampling rule (and guidance hook), each
    from its own seed."""
    from pita.models.generation import generate

    return generate(
        policy.model,
        prompts,
        max_new_tokens=max_new,
        batch_size=batch_size,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        do_sample=True,
        row_seeds=seeds,
        offset_hook_factory=policy.hook_factory,
        on_batch=on_batch,
        **policy.rule.kwargs(),
    )


def _write_samples(
    f: Any,
    task: Any,
    policy: Any,
    examples: list[Any],
    prompt_index: list[int],
    responses: list[list[int]],
    kls: list[dict],
) -> list[float]:
    """One `samples.jsonl` record per sample of `policy` (η, sampling rule, example, token
    ids, reward, answer, its KL terms); returns the rewards."""
    rewards = task.rewards(examples, responses)
    answers = task.answers(examples, responses)
    for j, response in enumerate(responses):
        record = {"eta": policy.eta, "sampling": policy.rule.label, "example": prompt_index[j]}
        record.update(response=response, reward=rewards[j], answer=answers[j], **kls[j])
        f.write(json.dumps(record) + "\n")
    return rewards


def evaluate_shard(ctx: StageContext) -> dict:
    """Sample this shard's test prompts with the round's policy at every η and score them.

    Reads: π_ref, the `policy` input (`value_model/` for guided chains, `model/` for DPO /
    GRPO), `evaluation.*`, `generation.*`. Writes: `samples.jsonl` (one record per
    sample: η, sampling rule, token ids, reward, answer, its KL terms).
    """
    from pita.models.placement import placement_lines
    from pita.models.seeds import example_seed

    ref_dir = ctx.reference_model()
    ref = ctx.load_model(ref_dir)
    task = ctx.build_task()
    tok = task.tokenizer
    all_examples = test_examples(ctx, task)
    part = ctx.shard_slice(len(all_examples))
    indices = list(range(len(all_examples)))[part]
    k = int(ctx.evaluation.num_samples)
    prompt_index = [i for i in indices for _ in range(k)]
    # sample s of test prompt i draws from its own stream, the same at every η (common
    # random numbers across the rows) and on any number of shards (pita/models/seeds.py)
    seeds = [example_seed(ctx.seed, "evaluate", i, s) for i in indices for s in range(k)]
    prompts = [all_examples[i].prompt_ids for i in prompt_index]
    examples = [all_examples[i] for i in prompt_index]
    gen = ctx.generation
    max_new = int(gen.max_new_tokens or task.max_new_tokens)
    bs = generation_batch_size(
        ctx, ctx.evaluation.batch_size, model=ref, prompts=prompts, max_new_tokens=max_new
    )
    n_records = 0
    policies = eval_policies(ctx, ref)
    total = len(policies) * len(prompts)  # prompts generated, every η's
    with open(ctx.out_dir / Artifact.SAMPLES, "w") as f:
        for i, policy in enumerate(policies):

            def on_batch(done: int, before: int = i * len(prompts), eta: Any = policy.eta) -> None:
                ctx.report_progress(before + done, total, "prompts", f"eta={eta}")

            out = _sample(policy, prompts, seeds, max_new, bs, tok, on_batch)
            kls = sample_kls(
                policy, ref, prompts, out, batch_size=bs, pad_token_id=tok.pad_token_id
            )
            rewards = _write_samples(f, task, policy, examples, prompt_index, out.responses, kls)
            n_records += len(prompts)
            ctx.logger.info(
                "eta=%s (%s): %d samples, mean reward %.4f",
                policy.eta,
                policy.rule.label,
                len(prompts),
                sum(rewards) / len(rewards),
            )
    lines = placement_lines(ref, "reference") + [
        line for p in policies if p.model is not ref for line in placement_lines(p.model, "policy")
    ]
    return {"prompts": len(indices), "records": n_records, "run_log_lines": lines}


def evaluate_merge(ctx: StageContext) -> dict:
    """Compute the metrics of every η from the shards' samples.

    Reads: `samples.jsonl` and `result.json` of the `shards` inputs. Writes:
    `metrics.json`, the rows of results/summary.csv for this chain and round (pass@1,
    maj@k, avg_reward, KL, task-specific columns).
    """
    from pita.datasets import build_task
    from pita.eval.metrics import kl_columns, maj_at_k, mean, pass_at_1

    task = build_task(ctx.cfg.dataset, tokenizer=ctx.reference_model())
    examples = test_examples(ctx, task)
    by_row: dict[Any, list[dict]] = {}
    wall = 0.0
    for shard in ctx.inputs("shards"):
        wall += json.loads((shard / Artifact.RESULT).read_text()).get("wall_s", 0.0)
        for line in (shard / Artifact.SAMPLES).read_text().splitlines():
            rec = json.loads(line)
            by_row.setdefault((rec["eta"], rec.get("sampling")), []).append(rec)
    rows = []
    for (eta, sampling), recs in by_row.items():
        recs.sort(key=lambda r: r["example"])
        rewards = [r["reward"] for r in recs]
        row = {
            "algo": ctx.task.algo,
            "dataset": ctx.task.dataset,
            "family": ctx.task.family,
            "round": ctx.task.round,
            "eta": eta,
            "n_prompts": len({r["example"] for r in recs}),
            "samples": len(recs),
            "pass@1": pass_at_1(rewards),
            "maj@k": maj_at_k(
                [r["example"] for r in recs],
                [r["answer"] for r in recs],
                rewards,
                seed=int(ctx.experiment.seed),
            ),
            "avg_reward": mean(rewards),
            **kl_columns(recs),
            "sampling": sampling,
            "eval_wall_s": round(wall, 2),
        }
        extra = getattr(task, "extra_metrics", None)
        if extra is not None:
            row.update(extra([examples[r["example"]] for r in recs], [r["response"] for r in recs]))
        oracle = _oracle(
            task,
            [examples[i] for i in sorted({r["example"] for r in recs})],
            ctx.task.algo,
            eta,
            _guidance_mode(ctx),
        )
        if oracle is not None:
            row["optimum_pass@1"] = oracle
        rows.append(row)
        ctx.logger.info("%s", row)

    atomic_write_json(ctx.out_dir / Artifact.METRICS, rows)
    return {"rows": rows}


# Guidance modes whose η is the inverse temperature of π* ∝ π_ref·e^{η r}: their offset
# (log E[e^{η r}], pita/algos/guidance.py) is that optimum's soft-Q, so its pass@1 is the
# bound the row approaches. `expectation*` (PITA's preference odds) scale η otherwise: no
# optimum on their rows (a 0.558 beside PITA's 0.684 at η = 2 read as a bound it beat).
OPTIMUM_MODES = ("bernoulli", "mle")


def _guidance_mode(ctx: StageContext) -> str | None:
    """This row's guidance mode (`algos.<NAME>.guidance.mode`), None for an unguided row."""
    if ctx.task.algo not in GUIDED:
        return None
    guided = ctx.algo_settings(ctx.task.algo, ValueGuidedConfig)  # recorded: resume sees it
    return None if guided is None else str(guided.guidance.mode)


def _oracle(task, examples, algo: str, eta, mode: str | None = None) -> float | None:
    """The analytic value where the task knows it (goal-walk): π_ref's pass@1 for the
    reference, the KL-regularised optimum p·e^η / (1 − p + p·e^η) for guided η whose mode
    is on that scale (`OPTIMUM_MODES`)."""
    if not hasattr(task, "optimal_pass_at_1"):
        return None
    if algo in REFERENCE:
        return task.reference_pass_at_1(examples)
    if algo in GUIDED and eta is not None and mode in OPTIMUM_MODES:
        return task.optimal_pass_at_1(float(eta), examples)
    return None
