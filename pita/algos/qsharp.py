"""Q#: value-guided decoding with a (distributional) value model of π_ref.

Implements docs/ALGORITHMS.md "Q#": round k rolls in with π^k (π_ref in round 0, else π_ref
guided by round k−1's value model), cuts at h ~ U{1..|y|−1}, rolls out with π_ref, and
trains the value model on the roll-out tokens against the sequence reward (`bce` for
binary rewards, `mse`, or `mle` over `num_atoms` atoms on [V_min, V_max]); the records
of rounds 0..k are aggregated (DAgger). Guidance: π_ref's top-k logits + offsets
(pita/algos/guidance.py), also used for the guided roll-ins.

Where this departs from the paper / reference code:
- In round 0 the roll-in *is* π_ref, so every response token is a π_ref roll-out token
  and carries an unbiased label of Q^{π_ref}(s_t, y_t): all of them are trained (later
  rounds train only the roll-out part, from the cut on).
- Records that share a (state, action) are merged into one soft target (the mean label,
  or the atom histogram for `mle`) weighted by their count, and training batches draw
  *unique sequences*. For these losses (linear in the target) this is the same objective
  as the sum over records; each step just sees far less label noise, which is what lets
  a tiny value model learn goal-walk within a CPU minute.
- Guidance is restricted to π_ref's top-k tokens (k = out-degree on goal-walk), as in
  evaluation.

Options that reproduce the official star-graph recipe (issue 15; `experiment=star_graph_paper`
sets them) and where even they depart from it:
- `value_head: v`: the official classifier's V-type read-out (candidate appended, scalar
  head at its position; pita/models/value_model.py) instead of the Q-type head; scored
  over π_ref's top-k in one batched forward with the prefix cache shared.
- `data_collection.recipe: ground_truth_vs_first_wrong`: per graph the ground truth
  (label 1) and π_ref's first wrong sample (label 0), every target token trained. The
  official loader concatenates each pair into the same batch; here batches draw unique
  sequences at random (balanced in expectation, not per batch), and the pair's shared
  prefix (the source node) is merged into one 0.5 target, the same BCE objective.
- `lr_schedule: official`, `weight_decay: 0.1`, lr 2.5e-4: the official optimiser.
- Initialisation: the official classifier starts from text-pretrained GPT-2 (generic
  copy / induction heads); offline, the closest is a full copy of π_ref (`warm_start` with
  `guide_arch` = `reference_arch`), which is what the paper config does.
- `holdout_fraction` / `probe_steps`: per-position held-out accuracy and a frozen-backbone
  probe (pita/algos/value_diagnostics.py) that warns before a run that will sit on the
  plateau; not in the official code.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pita.algos.collector import collect_shard, read_jsonl, write_jsonl
from pita.algos.value_training import train_value
from pita.core.paths import Artifact
from pita.core.schema import ValueGuidedConfig
from pita.runtime.context import StageContext


def collect(ctx: StageContext) -> dict:
    """Q#'s roll-in / cut / roll-out (pita/algos/collector.py): records with rewards.

    Reads: π_ref, round r-1's value model (`guide` input) for the roll-in, this shard's
    training prompts, `data_collection.*`, `algos.QSharp.*`. Writes: `records.jsonl`
    (prompt, prefix and roll-out token ids, reward, roll-in origin).
    """
    records, stats = collect_shard(ctx, pairs=False)
    write_jsonl(ctx.out_dir / Artifact.RECORDS, records)
    return stats


def reward_targets(rewards: Sequence[float], algo: Any, name: str = "QSharp") -> list[list[float]]:
    """Per-record targets: [r mapped to [0, 1]] for bce/mse, the atom one-hot for mle."""
    import torch

    from pita.algos.losses import atom_histogram

    r = torch.tensor([float(x) for x in rewards])
    if algo.loss_type == "mle":
        return atom_histogram(r, int(algo.num_atoms), float(algo.V_min), float(algo.V_max)).tolist()
    if algo.loss_type not in ("bce", "mse"):
        raise ValueError(
            f"algos.{name}.loss_type={algo.loss_type!r}: Q# trains bce | mse | mle "
            "(bradley_terry needs preference pairs: PITA)"
        )
    return ((r - algo.V_min) / (algo.V_max - algo.V_min)).clamp(0, 1)[:, None].tolist()


def training_items(records: Sequence[dict], targets: Sequence[list[float]]) -> list[tuple]:
    """(prompt, response, first trained response index, target, None) per record; the
    response is prefix + roll-out, exactly the ids that were scored."""
    return [
        (
            r["prompt"],
            r["prefix"] + r["rollout"],
            0 if r.get("roll_in") == "reference" else len(r["prefix"]),
            t,
            None,
        )
        for r, t in zip(records, targets)
    ]


def train(ctx: StageContext) -> dict:
    """Fit Q#'s distributional value model on every round's records so far.

    Reads: `records.jsonl` of the `data` inputs, round r-1's `value_model/` (`previous`,
    warm start), `algos.QSharp.*`, `training.*`. Writes: `value_model/`,
    training_metrics.png, performance_summary.txt. Assumes rewards in [V_min, V_max].
    """
    records = read_jsonl(ctx.inputs("data"), Artifact.RECORDS)
    targets = reward_targets(
        [r["reward"] for r in records], ctx.algo_as(ValueGuidedConfig), ctx.task.algo
    )
    return train_value(ctx, training_items(records, targets))
