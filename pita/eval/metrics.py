"""Metrics of docs/ALGORITHMS.md, computed from per-sample records (pure Python).

- pass@1: mean correctness over all samples of all prompts;
- maj@k: per prompt, the majority answer among its k samples (ties broken at random with
  the run's seed; empty answers vote only when nothing else does), then mean correctness;
- avg_reward: mean reward over samples;
- kl: mean over sampled sequences of Σ_t [log π(y_t|s_t) − log π_ref(y_t|s_t)], from the
  log-probs of the sampled tokens only.
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
