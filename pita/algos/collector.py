"""Batched roll-in / cut / roll-out: the data collection of Q#, PITA and Q#-HF.

The split of the training prompts across GPUs is `ParallelDataGenerator`
(pita/core/parallel_generation.py, named after the seed guide, docs/guides/gpu_execution.txt): each `collect` shard gets
`ctx.shard_slice` of the prompts and runs on its own device; `RolloutCollector` is
what one shard runs. Everything is batched: one `generate` call for every roll-in of the
shard, one for every roll-out, rewards in chunks of `data_collection.reward_batch_size`.

For each training prompt x and each of `samples_per_example` samples:

1. roll-in: a full response y ~ π^k(·|x) (round 0: π_ref; later rounds: π_ref guided by
   the previous round's value model, top-k + offsets as in evaluation);
2. cut: h ~ U{1..|y|−1}, the 1-based step at which π_ref takes over; the kept prefix is
   y_<h (c = h − 1 tokens, so the first decision can be a roll-out step too);
3. roll-out: y' ~ π_ref(·|x, y_<h), with the remaining budget max_new_tokens − c. All
   roll-outs share one generate call of the full budget, each row then cut to its own
   budget: sampling is autoregressive, so the first B tokens of a longer sample *are* a
   sample with budget B (no row is truncated to the batch's shortest budget);
4. reward r(x, y_<h + y'), scored on exactly the ids that are stored and trained on;
5. with `pairs` (PITA, Q#-HF): also r(x, y) of the roll-in's own continuation, and the
   preference label 1[y_<h + y' ≻ y]: if exactly one of the two rewards is 1 (the other 0)
   it wins, otherwise a Bradley–Terry draw P = σ(β_BT·(r' − r)).

The official Q# star-graph recipe (`data_collection.recipe: ground_truth_vs_first_wrong`,
for tasks whose examples carry the correct answer, `target_ids`) replaces steps 1–5 with
pairs from the same prompt: the ground-truth response (reward 1) and the *first wrong*
π_ref sample at the generation temperature (reward 0), drawn in batched rounds until every
prompt has one or `data_collection.max_tries` samples were spent on it (prompts without a
wrong sample are dropped, as in the official collect_rollouts.py). Both are stored as
whole-response records (`prefix` empty, `roll_in` "reference"), so Q# trains every target
token against the sequence label. With `pairs` (PITA) the record's `label` is its own
reward (the ground truth is preferred to the wrong sample) and `original` is the other
arm: PITA's BCE preference classifier is then Q#'s classifier, as in the official code.
The roll-in policy plays no part (one offline round, as in the paper).

Every draw of a record (roll-in tokens, cut, roll-out tokens, Bradley–Terry label; a
recipe try) is seeded by the example's global index and the sample's number under the
stage's seed (pita/models/seeds.py), so a record is the same whichever shard collects it
and whatever else shares its batch: results do not depend on the number of devices.

Records are token ids (never decoded text), one JSON object per line:
`{"example", "prompt", "prefix", "rollout", "reward", "roll_in"}` (+ `"original"`,
`"reward_original"`, `"label"`, `"pref_prob"` with pairs). `roll_in` is "reference" when
the whole response was sampled from π_ref (round 0), else "guided".

This module is torch-only at call time; it is imported in workers, never by the
orchestrator.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pita.core.schema import ValueGuidedConfig

if TYPE_CHECKING:  # torch-heavy; imported only for type hints
    from pita.algos.guidance import HookFactory


def score_in_batches(
    task: Any, examples: Sequence, responses: Sequence[Sequence[int]], batch_size: int
) -> list[float]:
    """task.rewards over chunks of `batch_size` (one reward-model call per chunk)."""
    out: list[float] = []
    for start in range(0, len(responses), batch_size):
        out += task.rewards(
            examples[start : start + batch_size], responses[start : start + batch_size]
        )
    return [float(r) for r in out]


def preference_label(
    r_new: float, r_old: float, beta: float, rng: random.Random
) -> tuple[float, float]:
    """(label, P(new ≻ old)): a decided pair when exactly one reward is 1 and the other 0,
    otherwise a Bradley–Terry draw with P = σ(β·(r_new − r_old))."""
    if {r_new, r_old} == {0.0, 1.0}:
        won = float(r_new > r_old)
        return won, won
    z = beta * (r_new - r_old)
    prob = 1.0 / (1.0 + math.exp(-z)) if z > -700 else 0.0
    return float(rng.random() < prob), prob


class RolloutCollector:
    """One collect shard's batched roll-in / cut / roll-out (see the module docstring)."""

    def __init__(
        self,
        reference: Any,
        task: Any,
        *,
        batch_size: int,
        max_new_tokens: int,
        pad_token_id: int,
        eos_token_id: int | Sequence[int],
        temperature: float = 1.0,
        top_p: float = 1.0,
        rollout_top_k: int = 0,
        roll_in_hook_factory: Callable | None = None,
        roll_in_top_k: int | None = None,
        reward_batch_size: int = 32,
        seed: int = 0,
        report: Callable[..., None] | None = None,
    ):
        self.reference, self.task = reference, task
        self.batch_size, self.max_new_tokens = batch_size, max_new_tokens
        self.pad, self.eos = pad_token_id, eos_token_id
        self.temperature, self.top_p, self.rollout_top_k = temperature, top_p, rollout_top_k
        self.hook_factory = roll_in_hook_factory
        self.roll_in_top_k = rollout_top_k if roll_in_top_k is None else roll_in_top_k
        self.reward_batch_size, self.seed = reward_batch_size, seed
        self.report = report or (
            lambda done, total, unit="", detail="": None
        )  # ctx.report_progress

    def _generate(
        self,
        prompts: list[list[int]],
        *,
        top_k: int,
        hook_factory: Callable | None,
        seeds: list[int],
        on_batch: Callable[[int], None] | None = None,
    ):
        """Sample every prompt, row i from its own stream `seeds[i]` (pita/models/seeds.py)."""
        from pita.models.generation import generate

        return generate(
            self.reference,
            prompts,
            max_new_tokens=self.max_new_tokens,
            batch_size=self.batch_size,
            pad_token_id=self.pad,
            eos_token_id=self.eos,
            do_sample=True,
            temperature=self.temperature,
            top_k=top_k,
            top_p=self.top_p,
            row_seeds=seeds,
            offset_hook_factory=hook_factory,
            on_batch=on_batch,
        )

    def row_seed(self, what: str, example: int, sample: int) -> int:
        """The seed of one draw about (`example`, `sample`): its global index, not the shard's."""
        from pita.models.seeds import example_seed

        return example_seed(self.seed, what, example, sample)

    def collect(
        self,
        indices: Sequence[int],
        examples: Sequence,
        samples_per_example: int,
        *,
        pairs: bool = False,
        bradley_terry_beta: float = 10.0,
    ) -> list[dict]:
        """Records for `examples` (their ids in the task's training list are `indices`).
        Every draw of a record (roll-in, cut, roll-out, label) is seeded by its example's
        global index and sample number, so a record is the same whichever shard collects it."""
        keys = [(i, j) for i in indices for j in range(samples_per_example)]
        rows = [(i, ex) for i, ex in zip(indices, examples) for _ in range(samples_per_example)]
        if not rows:
            return []
        prompts = [list(ex.prompt_ids) for _, ex in rows]
        row_examples = [ex for _, ex in rows]
        # 1. roll-in: whole responses from the current policy π^k
        total = 2 * len(rows)  # prompts generated: the roll-ins, then as many roll-outs
        roll_in = self._generate(
            prompts,
            top_k=self.roll_in_top_k,
            hook_factory=self.hook_factory,
            seeds=[self.row_seed("roll-in", *key) for key in keys],
            on_batch=lambda done: self.report(done, total, "prompts", "roll-in"),
        ).responses
        # 2. cut: keep c = h − 1 tokens, h ~ U{1..|y|−1} (c = 0 when |y| < 2)
        cuts = [
            random.Random(self.row_seed("cut", *key)).randint(0, max(0, len(y) - 2))
            for key, y in zip(keys, roll_in)
        ]
        prefixes = [y[:c] for y, c in zip(roll_in, cuts)]
        # 3. roll-out with π_ref from x + y_<h, each row cut to its own remaining budget
        cont = self._generate(
            [p + pre for p, pre in zip(prompts, prefixes)],
            top_k=self.rollout_top_k,
            hook_factory=None,
            seeds=[self.row_seed("roll-out", *key) for key in keys],
            on_batch=lambda done: self.report(len(rows) + done, total, "prompts", "roll-out"),
        ).responses
        rollouts = [r[: self.max_new_tokens - c] for r, c in zip(cont, cuts)]
        # 4. rewards of exactly the stored ids
        responses = [pre + ro for pre, ro in zip(prefixes, rollouts)]
        rewards = score_in_batches(self.task, row_examples, responses, self.reward_batch_size)
        origin = "guided" if self.hook_factory is not None else "reference"
        names = ("example", "prompt", "prefix", "rollout", "reward")
        records = [
            {**dict(zip(names, (i, p, pre, ro, r))), "roll_in": origin}
            for (i, _), p, pre, ro, r in zip(rows, prompts, prefixes, rollouts, rewards)
        ]
        if pairs:  # 5. the roll-in's own continuation, and the preference label
            self._label(records, keys, row_examples, roll_in, cuts, bradley_terry_beta)
        return records

    def _label(
        self,
        records: list[dict],
        keys: list[tuple[int, int]],
        row_examples: list[Any],
        roll_in: list[list[int]],
        cuts: list[int],
        beta: float,
    ) -> None:
        """Each record with the roll-in's own continuation, its reward and the preference
        label between the two (Bradley–Terry with `beta`, seeded per record)."""
        originals = score_in_batches(self.task, row_examples, roll_in, self.reward_batch_size)
        for rec, key, y, c, r_old in zip(records, keys, roll_in, cuts, originals):
            rng = random.Random(self.row_seed("label", *key))
            label, prob = preference_label(rec["reward"], r_old, beta, rng)
            rec.update(original=y[c:], reward_original=r_old, label=label, pref_prob=prob)


def ground_truth_pairs(
    collector: RolloutCollector,
    indices: Sequence[int],
    examples: Sequence,
    *,
    max_tries: int,
    pairs: bool = False,
) -> tuple[list[dict], int]:
    """Records of the `ground_truth_vs_first_wrong` recipe (module docstring): per example
    the ground truth (reward 1) and π_ref's first wrong sample (reward 0). Sampling is
    batched: each round draws, for every prompt still without a wrong sample, enough copies
    to fill about one generation batch (never more than its remaining tries). Try t of an
    example is seeded by (example, t), and its first wrong sample is the one with the
    smallest t, so the records do not depend on how the tries were batched (nor on the
    shard). Returns (records, number of examples dropped for lack of a wrong sample)."""
    if any(ex.target_ids is None for ex in examples):
        raise ValueError(
            "data_collection.recipe=ground_truth_vs_first_wrong needs a task with a known answer "
            f"(target_ids); {type(collector.task).__name__} has none: use recipe=rollouts"
        )
    wrong: dict[int, list[int]] = {}
    tries = [0] * len(examples)
    pending = list(range(len(examples)))
    while pending:
        reps = max(1, collector.batch_size // len(pending))
        rows = [(j, tries[j] + t) for j in pending for t in range(min(reps, max_tries - tries[j]))]
        out = collector._generate(
            [list(examples[j].prompt_ids) for j, _ in rows],
            top_k=collector.rollout_top_k,
            hook_factory=None,
            seeds=[collector.row_seed("try", indices[j], t) for j, t in rows],
        ).responses
        rewards = score_in_batches(
            collector.task, [examples[j] for j, _ in rows], out, collector.reward_batch_size
        )
        for (j, _), y, r in zip(rows, out, rewards):
            tries[j] += 1
            if r < 1.0 and j not in wrong:  # rows of j come in try order: the first wrong
                wrong[j] = list(y)
        pending = [j for j in pending if j not in wrong and tries[j] < max_tries]
        collector.report(len(wrong), len(examples), "pairs", f"{len(pending)} pending")
    records = []
    for j in sorted(wrong):
        ex = examples[j]
        arms = [(list(ex.target_ids), 1.0), (wrong[j], 0.0)]
        for (resp, r), (other, r_other) in zip(arms, arms[::-1]):
            rec = {
                "example": indices[j],
                "prompt": list(ex.prompt_ids),
                "prefix": [],
                "rollout": resp,
                "reward": r,
                "roll_in": "reference",
            }
            if pairs:
                rec.update(original=other, reward_original=r_other, label=r, pref_prob=r)
            records.append(rec)
    return records, len(examples) - len(wrong)


def preference_pairs(records: Sequence[dict]) -> list[dict]:
    """PITA-style pairs for a proxy reward model: {"example", "prompt", "chosen",
    "rejected"} with full response ids (EOS included); pairs whose two responses are the
    same ids are dropped (they carry no preference)."""
    out = []
    for rec in records:
        new, old = rec["prefix"] + rec["rollout"], rec["prefix"] + rec["original"]
        if new == old:
            continue
        chosen, rejected = (new, old) if rec["label"] >= 0.5 else (old, new)
        out.append(
            {
                "example": rec["example"],
                "prompt": rec["prompt"],
                "chosen": chosen,
                "rejected": rejected,
            }
        )
    return out


def collect_shard(ctx: Any, *, pairs: bool) -> tuple[list[dict], dict]:
    """Run one collect shard of a value-guided chain: load π_ref (and the previous round's
    guide), build the generator from the config, collect this shard's prompts.
    Returns (records, stats)."""
    import time

    t0 = time.perf_counter()
    ref_dir = ctx.reference_model()
    reference = ctx.load_model(ref_dir)
    task = ctx.build_task()
    examples = task.train_examples()
    dc, gen, algo = ctx.data_collection, ctx.generation, ctx.algo_as(ValueGuidedConfig)
    if dc.max_examples:
        examples = examples[: dc.max_examples]
    part = ctx.shard_slice(len(examples))
    indices = list(range(len(examples)))[part]
    hook, roll_in_top_k = _roll_in_guide(ctx, algo, int(gen.top_k))
    prompts = [examples[i].prompt_ids for i in indices]
    generator = _rollout_collector(ctx, reference, task, hook, roll_in_top_k, prompts)
    samples = algo.samples_per_example or dc.samples_per_example  # per-algo override, if any
    if dc.recipe == "ground_truth_vs_first_wrong":
        hook = None  # one offline round of π_ref samples (module docstring)
    records, dropped = _run_recipe(
        generator, dc, indices, [examples[i] for i in indices], samples, pairs
    )
    stats = _shard_stats(records, len(indices), hook, dropped, pairs)
    stats["collect_s"] = round(time.perf_counter() - t0, 2)
    ctx.logger.info("collected %s", stats)
    from pita.models.placement import placement_lines

    stats["run_log_lines"] = placement_lines(
        reference, "reference"
    )  # a sharded π_ref's layers, for run.log
    return records, stats


def _rollout_collector(
    ctx: Any,
    reference: Any,
    task: Any,
    hook: HookFactory | None,
    roll_in_top_k: int,
    prompts: list[list[int]],
) -> RolloutCollector:
    """The shard's `RolloutCollector` from `generation.*` and `data_collection.*`, its batch
    sizes probed on the task's device with the models collect really holds: π_ref on the
    shard's longest prompt and full max_new_tokens, plus the guide when guided. (Without
    the model it had nothing to measure and logged "no CUDA device" on GPUs.)"""
    from pita.runtime.batching import generation_batch_size

    gen, tok = ctx.generation, task.tokenizer
    max_new = int(gen.max_new_tokens or task.max_new_tokens)
    batch = generation_batch_size(
        ctx,
        gen.batch_size,
        model=reference,
        prompts=prompts,
        max_new_tokens=max_new,
        extra_models=[hook.model] if hook is not None else [],
        fallback=256,
    )
    return RolloutCollector(
        reference,
        task,
        batch_size=batch,
        max_new_tokens=max_new,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        temperature=float(gen.temperature),
        top_p=float(gen.top_p),
        rollout_top_k=int(gen.top_k),
        roll_in_hook_factory=hook,
        roll_in_top_k=roll_in_top_k,
        reward_batch_size=generation_batch_size(
            ctx, ctx.data_collection.reward_batch_size, fallback=32
        ),
        seed=ctx.seed,
        report=ctx.report_progress,
    )


def _roll_in_guide(ctx: Any, algo: Any, top_k: int) -> tuple[HookFactory | None, int]:
    """(the roll-in's guidance hook, its top-k): from round 1 on (a `guide` input and η != 0)
    π^k is π_ref guided by the previous round's value model, on its top-k tokens."""
    if not ctx.has_input("guide") or float(algo.guidance.eta) == 0:
        return None, top_k
    from pita.algos.guidance import guided_hook_factory

    hook = guided_hook_factory(ctx, ctx.input("guide"), float(algo.guidance.eta))
    return hook, int(algo.guidance.top_k)


def _run_recipe(
    generator: RolloutCollector,
    dc: Any,
    indices: list[int],
    examples: list[Any],
    samples: int,
    pairs: bool,
) -> tuple[list[dict], int | None]:
    """(the shard's records, prompts dropped for want of a wrong sample or None) by
    `data_collection.recipe`."""
    if dc.recipe == "ground_truth_vs_first_wrong":
        return ground_truth_pairs(
            generator, indices, examples, max_tries=int(dc.max_tries), pairs=pairs
        )
    if dc.recipe == "rollouts":
        beta = float(dc.bradley_terry_beta)
        return generator.collect(
            indices, examples, samples, pairs=pairs, bradley_terry_beta=beta
        ), None
    raise ValueError(
        f"data_collection.recipe={dc.recipe!r}: allowed: rollouts | ground_truth_vs_first_wrong"
    )


def _shard_stats(
    records: list[dict], prompts: int, hook: Any, dropped: int | None, pairs: bool
) -> dict[str, Any]:
    """A shard's numbers: sums, not means (collect_merge adds up every number of the shards'
    results)."""
    stats: dict[str, Any] = {
        "prompts": prompts,
        "records": len(records),
        "guided": hook is not None,
        "reward_sum": sum(r["reward"] for r in records),
    }
    if dropped is not None:
        stats["dropped_no_wrong_sample"] = dropped
    if pairs:
        stats["reward_roll_in_sum"] = sum(r["reward_original"] for r in records)
        stats["label_sum"] = sum(r["label"] for r in records)
    if hook is not None:  # 1 value forward per decoding step
        stats["value_forwards"], stats["decode_steps"] = hook.stats.forwards, hook.stats.steps
    return stats


def write_jsonl(path: Any, rows: Sequence[dict]) -> None:
    import json

    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row, separators=(",", ":")) + "\n")


def read_jsonl(folders: Sequence[Any], name: str) -> list[dict]:
    """Every `name` record of every folder, in order (DAgger: rounds 0..k)."""
    import json
    from pathlib import Path

    out = []
    for folder in folders:
        path = Path(folder) / name
        if path.is_file():
            with open(path) as f:
                out += [json.loads(line) for line in f if line.strip()]
    return out
