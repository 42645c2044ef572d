"""evaluate: sample the test prompts with a round's policy at every η, then score them.

`evaluate_shard` generates `evaluation.num_samples` samples for its slice of the test
prompts and writes one record per sample (token ids, reward, answer, log-probs) to
`samples.jsonl`; `evaluate_merge` reads every shard and computes the metrics of
docs/ALGORITHMS.md per η into `metrics.json`, which the report turns into the results table.

The policy depends on the chain:
- reference: π_ref itself (η = 0);
- PITA / QSharp / QSharp-HF: π_ref guided by the round's value model at every η of
  `evaluation.etas` (η = 0 is π_ref); KL is exact per sampled token because the guided
  distribution is built from π_ref's own logits;
- DPO / GRPO / GRPO-HF: the round's trained policy; log π_ref of its samples comes from
  one teacher-forced forward of π_ref per batch.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from pita.algos.registry import GUIDED
from pita.core.paths import Artifact, atomic_write_json
from pita.runtime.batching import generation_batch_size
from pita.runtime.context import StageContext


def test_examples(ctx: StageContext, task) -> list:
    examples = task.test_examples()
    if ctx.cfg.evaluation.max_prompts:
        examples = examples[: ctx.cfg.evaluation.max_prompts]
    return examples


def _policies(ctx: StageContext, task, ref) -> list[tuple[float | None, Any, Callable | None, int, bool]]:
    """(η, model to sample, offset-hook factory, top_k, needs a π_ref forward for KL)."""
    algo = ctx.task.algo
    top_k = int(ctx.cfg.generation.top_k)
    if algo == "reference":
        return [(0.0, ref, None, top_k, False)]
    if algo in GUIDED:
        from pita.algos.guidance import guided_hook_factory

        guide_dir = ctx.input("policy")
        guidance = ctx.algo_cfg.guidance
        out = []
        for eta in ctx.cfg.evaluation.etas:
            factory = guided_hook_factory(ctx, guide_dir, float(eta)) if eta > 0 else None
            out.append((float(eta), ref, factory, int(guidance.top_k), False))
        return out
    return [(None, ctx.load_model(ctx.input("policy") / Artifact.MODEL), None, top_k, True)]


def evaluate_shard(ctx: StageContext) -> dict:
    """Sample this shard's test prompts with the round's policy at every η and score them.

    Reads: π_ref, the `policy` input (`value_model/` for guided chains, `model/` for DPO /
    GRPO), `evaluation.*`, `generation.*`. Writes: `samples.jsonl` (one record per
    sample: η, token ids, reward, answer, log π and log π_ref of the sampled tokens).
    """
    import torch

    from pita.datasets import build_task
    from pita.models.generation import generate, sequence_logprobs

    ref_dir = ctx.reference_model()
    ref = ctx.load_model(ref_dir)
    task = build_task(ctx.cfg.dataset, tokenizer=ref_dir)
    tok = task.tokenizer
    all_examples = test_examples(ctx, task)
    part = ctx.shard_slice(len(all_examples))
    indices = list(range(len(all_examples)))[part]
    k = int(ctx.cfg.evaluation.num_samples)
    prompt_index = [i for i in indices for _ in range(k)]
    prompts = [all_examples[i].prompt_ids for i in prompt_index]
    examples = [all_examples[i] for i in prompt_index]
    gen = ctx.cfg.generation
    max_new = int(gen.max_new_tokens or task.max_new_tokens)
    bs = generation_batch_size(ctx, ctx.cfg.evaluation.batch_size, model=ref, prompts=prompts,
                               max_new_tokens=max_new)
    n_records = 0
    with open(ctx.out_dir / Artifact.SAMPLES, "w") as f:
        for eta, model, hook_factory, top_k, needs_ref in _policies(ctx, task, ref):
            generator = torch.Generator(device="cpu").manual_seed(ctx.seed)
            out = generate(model, prompts, max_new_tokens=max_new, batch_size=bs, pad_token_id=tok.pad_token_id,
                           eos_token_id=tok.eos_token_id, do_sample=True, temperature=gen.temperature,
                           top_k=top_k, top_p=gen.top_p, generator=generator, offset_hook_factory=hook_factory)
            if needs_ref:
                ref_lp = sequence_logprobs(ref, prompts, out.responses, batch_size=bs, pad_token_id=tok.pad_token_id)
            else:  # sampled from π_ref's own logits (+ offsets): base_logprobs is log π_ref
                ref_lp = out.base_logprobs
            rewards = task.rewards(examples, out.responses)
            answers = task.answers(examples, out.responses)
            for j in range(len(prompts)):
                f.write(json.dumps({"eta": eta, "example": prompt_index[j], "response": out.responses[j],
                                    "reward": rewards[j], "answer": answers[j],
                                    "kl": sum(out.logprobs[j]) - sum(ref_lp[j])}) + "\n")
            n_records += len(prompts)
            ctx.logger.info("eta=%s: %d samples, mean reward %.4f", eta, len(prompts), sum(rewards) / len(rewards))
            ctx.heartbeat(f"eta={eta} done")
    return {"prompts": len(indices), "records": n_records}


def evaluate_merge(ctx: StageContext) -> dict:
    """Compute the metrics of every η from the shards' samples.

    Reads: `samples.jsonl` and `result.json` of the `shards` inputs. Writes:
    `metrics.json`, the rows of results/summary.csv for this chain and round (pass@1,
    maj@k, avg_reward, KL, task-specific columns).
    """
    from pita.datasets import build_task
    from pita.eval.metrics import maj_at_k, mean, pass_at_1

    task = build_task(ctx.cfg.dataset, tokenizer=ctx.reference_model())
    examples = test_examples(ctx, task)
    by_eta: dict[Any, list[dict]] = {}
    wall = 0.0
    for shard in ctx.input("shards"):
        wall += json.loads((shard / Artifact.RESULT).read_text()).get("wall_s", 0.0)
        for line in (shard / Artifact.SAMPLES).read_text().splitlines():
            rec = json.loads(line)
            by_eta.setdefault(rec["eta"], []).append(rec)
    rows = []
    for eta, recs in by_eta.items():
        recs.sort(key=lambda r: r["example"])
        rewards = [r["reward"] for r in recs]
        row = {
            "algo": ctx.task.algo, "dataset": ctx.task.dataset, "family": ctx.task.family, "round": ctx.task.round,
            "eta": eta, "n_prompts": len({r["example"] for r in recs}), "samples": len(recs),
            "pass@1": pass_at_1(rewards),
            "maj@k": maj_at_k([r["example"] for r in recs], [r["answer"] for r in recs], rewards,
                              seed=int(ctx.cfg.experiment.seed)),
            "avg_reward": mean(rewards), "kl": mean([r["kl"] for r in recs]), "eval_wall_s": round(wall, 2),
        }
        extra = getattr(task, "extra_metrics", None)
        if extra is not None:
            row.update(extra([examples[r["example"]] for r in recs], [r["response"] for r in recs]))
        oracle = _oracle(task, [examples[i] for i in sorted({r["example"] for r in recs})], ctx.task.algo, eta)
        if oracle is not None:
            row["optimum_pass@1"] = oracle
        rows.append(row)
        ctx.logger.info("%s", row)

    atomic_write_json(ctx.out_dir / Artifact.METRICS, rows)
    return {"rows": rows}


def _oracle(task, examples, algo: str, eta) -> float | None:
    """The analytic value where the task knows it (goal-walk): π_ref's pass@1 for the
    reference, the KL-regularised optimum p·e^η / (1 − p + p·e^η) for guided η."""
    if not hasattr(task, "optimal_pass_at_1"):
        return None
    if algo == "reference":
        return task.reference_pass_at_1(examples)
    if algo in GUIDED and eta is not None:
        return task.optimal_pass_at_1(float(eta), examples)
    return None
