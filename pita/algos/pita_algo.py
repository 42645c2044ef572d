"""PITA: preference-guided decoding with a learned preference model over π_ref's tokens.

Implements docs/ALGORITHMS.md "PITA": round k samples a full response y from π^k (π_ref in
round 0, whose value head is zero-initialised anyway), cuts it at h ~ U{1..|y|−1}, rolls
out y' from y_<h with π_ref and labels 1[y_<h + y' ≻ y] (the decided winner when exactly
one of the two is correct, else a Bradley–Terry draw with β_BT =
`data_collection.bradley_terry_beta`). The preference model p(s, a) = P(y' ≻ y | s, a) is
trained with BCE on the roll-out tokens of y' against that label, and guides with mode
`expectation`: offset η·log(p / (1 − p)) on π_ref's top-k tokens. Records of rounds 0..k
are aggregated (DAgger); round k's model warm-starts from round k−1's.

Where this departs from the paper / reference code:
- Records sharing a (state, action) are merged into their mean label, weighted by count
  (the same BCE objective, less label noise per step; see pita/algos/value_training.py).
- `loss_type=bradley_terry` instead trains the pairwise form at the cut: at s_h, the
  logits of y'_h and y_h are compared, σ(v(s_h, y'_h) − v(s_h, y_h)) against the label
  (pairs whose first tokens agree carry no signal there and are dropped). The guidance is
  unchanged: `expectation` offsets are η·(logit), and softmax only sees their differences.

On the star graph (`experiment=star_graph*`) this module follows the official star-graph
PITA code, not the generic procedure above, and says so here (issue 15):
- Data: `data_collection.recipe: ground_truth_vs_first_wrong` (pita/algos/collector.py):
  per graph the ground truth (label 1, preferred) and π_ref's first wrong sample (label 0).
  The generic procedure's labels are ≈ 60 % coin flips there (two 0/1 rewards tie whenever
  both continuations fail or both succeed), which is what kept PITA at π_ref's 1/d. With
  the recipe, the BCE preference classifier trained here *is* Q#'s classifier (same
  records, same labels, every target token), as in the official code, which reuses its
  classifier for PITA.
- Guidance: mode `expectation_clamped`, η·clamp(log(p/(1−p)), log 0.01, log 0.99): the
  official `guide_class == 2` offset, suppression-only and bounded (≤ 4.6·η nats). The
  unbounded η·logit(p) reaches ±138 nats with a confident classifier and collapsed guided
  decoding at η ≥ 5; docs/ALGORITHMS.md's "do not clamp to ≤ 0" rule is for the main
  modes, and this row departs from it on purpose, to match the paper's PITA.
So the star-graph PITA row differs from the Q# row only in the offset; compare the two at
matched KL (the evaluation reports KL at every η).
"""

from __future__ import annotations

from collections.abc import Sequence

from pita.algos.collector import collect_shard, read_jsonl, write_jsonl
from pita.algos.value_training import train_value
from pita.core.paths import Artifact
from pita.core.schema import ValueGuidedConfig
from pita.runtime.context import StageContext


def collect(ctx: StageContext) -> dict:
    """PITA's roll-in / cut / roll-out with preference labels (pita/algos/collector.py).

    Reads: π_ref, round r-1's value model (`guide` input) for the roll-in, this shard's
    training prompts, `data_collection.*`, `algos.PITA.guidance`. Writes: `records.jsonl`
    (token ids, rewards of both continuations, label, P(new ≻ old)).
    """
    records, stats = collect_shard(ctx, pairs=True)
    write_jsonl(ctx.out_dir / Artifact.RECORDS, records)
    return stats


def preference_items(records: Sequence[dict], loss_type: str) -> list[tuple]:
    """Training items (prompt, response, start, [label], alt) from PITA records."""
    if loss_type == "bce":  # every roll-out token of y' against 1[y' ≻ y]
        return [
            (r["prompt"], r["prefix"] + r["rollout"], len(r["prefix"]), [float(r["label"])], None)
            for r in records
        ]
    if loss_type == "bradley_terry":  # the first tokens of y' and y, compared at the cut
        return [
            (
                r["prompt"],
                r["prefix"] + r["rollout"][:1],
                len(r["prefix"]),
                [float(r["label"])],
                r["original"][0],
            )
            for r in records
            if r["rollout"] and r["original"] and r["rollout"][0] != r["original"][0]
        ]
    raise ValueError(f"algos.PITA.loss_type={loss_type!r}: PITA trains bce | bradley_terry")


def train(ctx: StageContext) -> dict:
    """Fit PITA's preference-based value model on every round's records so far.

    Reads: `records.jsonl` of the `data` inputs, round r-1's `value_model/` (`previous`,
    warm start), `algos.PITA.*`. Writes: `value_model/`, training_metrics.png,
    performance_summary.txt (see `pita.algos.value_training.train_value`).
    """
    records = read_jsonl(ctx.inputs("data"), Artifact.RECORDS)
    return train_value(
        ctx, preference_items(records, str(ctx.algo_as(ValueGuidedConfig).loss_type))
    )
