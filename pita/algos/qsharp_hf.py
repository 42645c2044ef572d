"""Q#-HF: Q# on rewards from a proxy reward model fitted to preferences ("human feedback").

Implements docs/ALGORITHMS.md "Q#-HF": the collect stage runs PITA's procedure (roll-in with
π^k, cut, roll-out with π_ref, Bradley–Terry preference between y_<h + y' and y) and
writes both the Q# records (`records.jsonl`) and the preference pairs (`pairs.jsonl`:
`{"example", "prompt", "chosen", "rejected"}`, full response ids with EOS; at most
`algos.QSharp-HF.pairs_per_example` per prompt, the labelling budget). The
`reward_model` stage (pita/algos/reward_model.py, TRL's RewardTrainer) fits the proxy on
the pairs of rounds 0..k; `train` relabels every collected record with the proxy (never
with the task's reward), maps the scores into [V_min, V_max] and trains Q# with `mle`.

Where this departs from the paper / reference code:
- Proxy scores are Bradley–Terry logits with no fixed scale; they are mapped to
  [V_min, V_max] by min–max over the 1st–99th percentiles of this round's relabelled
  records (clamped), so the atoms span what the proxy actually separates.
- The scoring position is the reward model's own pooling (RewardScorer), the same one
  TRL's trainer used.
"""

from __future__ import annotations

from pita.algos.collector import collect_shard, preference_pairs, read_jsonl, write_jsonl
from pita.algos.qsharp import reward_targets, training_items
from pita.algos.value_training import train_value
from pita.core.paths import Artifact
from pita.core.schema import ValueGuidedHFConfig
from pita.runtime.context import StageContext


def collect(ctx: StageContext) -> dict:
    """Q#-HF collects like PITA (pairs with labels) and keeps at most
    `pairs_per_example` preference pairs per prompt for the proxy reward model.

    Reads: as `pita_algo.collect`. Writes: `records.jsonl` and `pairs.jsonl` (token ids).
    """
    records, stats = collect_shard(ctx, pairs=True)
    cap = int(ctx.algo_as(ValueGuidedHFConfig).pairs_per_example)
    per_example: dict[int, int] = {}
    pairs = []  # at most `pairs_per_example` per training prompt (the labelling budget)
    for pair in preference_pairs(records):
        per_example[pair["example"]] = per_example.get(pair["example"], 0) + 1
        if per_example[pair["example"]] <= cap:
            pairs.append(pair)
    write_jsonl(ctx.out_dir / Artifact.RECORDS, records)
    write_jsonl(ctx.out_dir / Artifact.PAIRS, pairs)
    return {**stats, "pairs": len(pairs)}


def to_value_range(scores: list[float], v_min: float, v_max: float) -> list[float]:
    """Min–max over the 1st–99th percentiles, clamped, into [v_min, v_max]."""
    import torch

    s = torch.tensor(scores, dtype=torch.float64)
    lo, hi = torch.quantile(s, 0.01).item(), torch.quantile(s, 0.99).item()
    if hi - lo < 1e-12:
        return [0.5 * (v_min + v_max)] * len(scores)
    z = ((s - lo) / (hi - lo)).clamp(0, 1)
    return (v_min + z * (v_max - v_min)).tolist()


def train(ctx: StageContext) -> dict:
    """Relabel every record with the proxy reward model, then fit Q#'s value model on it.

    Reads: `records.jsonl` of the `data` inputs, `reward_model/` (`reward_model` input),
    round r-1's `value_model/`, `algos.QSharp-HF.*`. Writes: `value_model/` and the
    training report. The task's true reward is logged as a diagnostic, never trained on.
    """
    from pita.algos.reward_model import load_reward_scorer

    algo = ctx.algo_as(ValueGuidedHFConfig)
    if algo.loss_type not in ("mle", "bce", "mse"):
        raise ValueError(
            f"algos.QSharp-HF.loss_type={algo.loss_type!r}: Q#-HF trains mle (or bce | mse)"
        )
    records = read_jsonl(ctx.inputs("data"), Artifact.RECORDS)
    scorer = load_reward_scorer(ctx, ctx.input("reward_model"))
    scores = scorer.score(
        [r["prompt"] for r in records], [r["prefix"] + r["rollout"] for r in records]
    )
    proxy = to_value_range(scores, float(algo.V_min), float(algo.V_max))
    true = [r["reward"] for r in records]
    n = max(1, len(records))
    # diagnostics only: how the proxy ranks what the task's reward says (never trained on)
    mean_correct = sum(p for p, t in zip(proxy, true) if t > 0.5) / max(
        1, sum(t > 0.5 for t in true)
    )
    mean_wrong = sum(p for p, t in zip(proxy, true) if t <= 0.5) / max(
        1, sum(t <= 0.5 for t in true)
    )
    ctx.logger.info(
        "proxy relabelled %d records: mean mapped reward %.3f (true-correct %.3f, true-wrong %.3f)",
        len(records),
        sum(proxy) / n,
        mean_correct,
        mean_wrong,
    )
    result = train_value(ctx, training_items(records, reward_targets(proxy, algo, ctx.task.algo)))
    return {
        **result,
        "proxy_mean_correct": round(mean_correct, 4),
        "proxy_mean_wrong": round(mean_wrong, 4),
    }
