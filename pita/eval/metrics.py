"""Metrics of docs/ALGORITHMS.md, computed from per-sample records (pure Python).

- pass@1: mean correctness over all samples of all prompts;
- maj@k: per prompt, the majority answer among its k samples (ties broken at random with
  the run's seed; empty answers vote only when nothing else does), then mean correctness;
- avg_reward: mean reward over samples;
- kl, kl_full, off_support: the KL columns defined once in docs/ALGORITHMS.md ("KL: the
  three columns"), from the log-probs of the sampled tokens only (`sample_kl` per sample,
  `kl_columns` per row).
"""

from __future__ import annotations

import math
import random
from collections import Counter, defaultdict
from collections.abc import Sequence


def is_correct(reward: float) -> bool:
    """Binary tasks reward 1 for a correct response; reward-model tasks count > 0.5."""
    return reward > 0.5


def pass_at_1(rewards: Sequence[float]) -> float:
    return sum(is_correct(r) for r in rewards) / len(rewards) if rewards else float("nan")


def maj_at_k(
    prompt_ids: Sequence[int], answers: Sequence[str], rewards: Sequence[float], seed: int = 0
) -> float:
    """Correctness of each prompt's majority answer, averaged over prompts."""
    rng = random.Random(seed)
    groups: dict[int, list[tuple[str, float]]] = defaultdict(list)
    for p, a, r in zip(prompt_ids, answers, rewards):
        groups[p].append((a, r))
    scores = []
    for p in sorted(groups):
        samples = groups[p]
        votes = Counter(a for a, _ in samples if a) or Counter(a for a, _ in samples)
        top = max(votes.values())
        winner = rng.choice(sorted(a for a, c in votes.items() if c == top))
        scores.append(float(any(is_correct(r) for a, r in samples if a == winner)))
    return sum(scores) / len(scores) if scores else float("nan")


def mean(values: Sequence[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else float("nan")


def sample_kl(
    logprobs: Sequence[float], ref_rule: Sequence[float], ref_full: Sequence[float]
) -> dict[str, float | bool]:
    """One sampled sequence's KL terms: `kl` = Σ_t [log π − log π_ref^rule] (+inf when a
    token lies outside π_ref^rule's support, where its log-prob is -inf), `kl_full` = Σ_t
    [log π − log π_ref] against the untruncated π_ref (finite: softmax has full support),
    `off_support` = whether any token lies outside π_ref^rule's support."""
    off = any(x == -math.inf for x in ref_rule)
    return {
        "kl": math.inf if off else sum(logprobs) - sum(ref_rule),
        "kl_full": sum(logprobs) - sum(ref_full),
        "off_support": off,
    }


def kl_columns(samples: Sequence[dict]) -> dict[str, float]:
    """A row's KL columns from its samples' `sample_kl` terms: `kl` is +inf as soon as one
    sample is off π_ref^rule's support (the KL is then infinite, not an estimation error),
    else the mean; `kl_full` the mean; `off_support` the share of samples off the support.
    Samples written before `kl_full` existed have only `kl`: the other two are then NaN-free
    absences (left out)."""
    out: dict[str, float] = {}
    kls = [float(s["kl"]) for s in samples]
    out["kl"] = math.inf if any(k == math.inf for k in kls) else mean(kls)
    if samples and all("kl_full" in s for s in samples):
        out["kl_full"] = mean([float(s["kl_full"]) for s in samples])
        out["off_support"] = sum(bool(s["off_support"]) for s in samples) / len(samples)
    return out
