"""Losses of the value / preference models (Q#, PITA, Q#-HF), on plain tensors.

Every loss takes per-position head outputs and *soft* targets with weights, so the train
stages can merge records that share a (state, action): a sum of per-record losses with
labels y_i equals the count times the loss at the mean label for `bce`, `mse` and `mle`
(all three are linear in the target), so merging changes nothing but the label noise
each optimizer step sees (pita/algos/qsharp.py, `build_targets`).

- `bce`: −[y·log σ(ℓ) + (1−y)·log(1−σ(ℓ))]; y ∈ [0, 1] (Q# binary reward, PITA label).
- `mse`: (σ(ℓ) − y)²; y ∈ [0, 1] (the reward mapped from [V_min, V_max]).
- `mle`: −Σ_m h_m·log pmf_m, h the target histogram over the M atoms (one-hot at
  round((r − V_min)/(V_max − V_min)·(M − 1)) for one record), pmf = softmax over atoms.
- `bradley_terry`: −[y·log σ(ℓ_a − ℓ_b) + (1−y)·log σ(ℓ_b − ℓ_a)], y = P(a ≻ b); with
  y = 1 the usual −log σ(s_chosen − s_rejected) of reward modelling (Bradley–Terry).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _weighted_mean(per_item: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    if weights is None:
        return per_item.mean()
    return (per_item * weights).sum() / weights.sum().clamp_min(1e-12)


def bce_loss(
    logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Binary cross-entropy on logits [N] against soft targets [N] in [0, 1]."""
    per = F.binary_cross_entropy_with_logits(logits.float(), targets.float(), reduction="none")
    return _weighted_mean(per, weights)


def mse_loss(
    logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Squared error of σ(logits) [N] against targets [N] in [0, 1]."""
    per = (torch.sigmoid(logits.float()) - targets.float()).pow(2)
    return _weighted_mean(per, weights)


def atom_index(values: torch.Tensor, num_atoms: int, v_min: float, v_max: float) -> torch.Tensor:
    """The atom nearest to each value: round((v − V_min)/(V_max − V_min)·(M − 1)), clamped."""
    scaled = (values.float().clamp(v_min, v_max) - v_min) / (v_max - v_min) * (num_atoms - 1)
    return scaled.round().long().clamp_(0, num_atoms - 1)


def atom_histogram(
    values: torch.Tensor, num_atoms: int, v_min: float, v_max: float
) -> torch.Tensor:
    """One-hot targets [N, M] of `values` [N] (average them to merge records)."""
    return F.one_hot(atom_index(values, num_atoms, v_min, v_max), num_atoms).float()


def mle_loss(
    atom_logits: torch.Tensor, target_hist: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """−Σ_m h_m log softmax(atom_logits)_m, atom_logits [N, M], target_hist [N, M]."""
    per = -(target_hist.float() * atom_logits.float().log_softmax(dim=-1)).sum(-1)
    return _weighted_mean(per, weights)


def bradley_terry_loss(
    score_a: torch.Tensor,
    score_b: torch.Tensor,
    prefer_a: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    beta: float = 1.0,
) -> torch.Tensor:
    """Bradley–Terry: P(a ≻ b) = σ(β(s_a − s_b)); prefer_a (default 1) may be soft."""
    diff = beta * (score_a.float() - score_b.float())
    target = torch.ones_like(diff) if prefer_a is None else prefer_a.float()
    per = F.binary_cross_entropy_with_logits(diff, target, reduction="none")
    return _weighted_mean(per, weights)
