"""Guided decoding: the value model's offsets added to π_ref's top-k logits.

At every step the generation engine (pita/models/generation.py) takes π_ref's raw logits,
keeps its top-k tokens, adds the offsets this hook returns, applies temperature and
samples (docs/ALGORITHMS.md, "Guided decoding"). The offset of candidate a in state s:

| mode          | value model output            | offset                              |
|---------------|-------------------------------|-------------------------------------|
| `bernoulli`   | p = σ(logit) = P(correct|s,a) | log(1 − p + p·e^η)                  |
| `mle`         | pmf over atoms z_1..z_M       | log Σ_m pmf_m·e^{η z_m}             |
| `expectation` | p = P(y' ≻ y | s, a)          | η·log(p / (1 − p))                  |

η multiplies the value (η = 0 is π_ref exactly: no offset at all). p is clamped to
[1e-6, 1 − 1e-6] for the logarithms only; offsets are *not* clamped to ≤ 0 (one public
implementation does, and then guidance can only suppress tokens). A distributional head
used with `bernoulli` / `expectation` gives p = the pmf's mean mapped to [0, 1].

Cost: the hook keeps the value model's own KV cache across the steps of a batch and makes
exactly one batched value-model forward per generated token: the prompt on the first
call, then only the newest token. The per-vocabulary head (pita/models/value_model.py)
scores every candidate from that single forward. `HookStats` counts steps and forwards
(bench/generation.py reports their ratio).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pita.models.value_model import ValueModel

MODES = ("bernoulli", "mle", "expectation")
P_CLAMP = 1e-6


def offsets_from_values(values: torch.Tensor, eta: float, mode: str, atoms: torch.Tensor) -> torch.Tensor:
    """Offsets [..., V] from head outputs [..., V, M] (M = 1: logits; M > 1: atom logits)."""
    if mode not in MODES:
        raise ValueError(f"guidance.mode={mode!r}: allowed: {', '.join(MODES)}")
    values = values.float()
    n_atoms = values.shape[-1]
    if mode == "mle":
        if n_atoms == 1:
            raise ValueError("guidance.mode=mle needs a distributional value model (loss_type=mle); "
                             "this one has a single logit per token: use bernoulli or expectation")
        # log Σ_m pmf_m e^{η z_m} = logsumexp(log pmf + η z)
        return torch.logsumexp(values.log_softmax(dim=-1) + eta * atoms.float(), dim=-1)
    if n_atoms == 1:
        p = torch.sigmoid(values[..., 0])
    else:  # the pmf's mean, mapped to [0, 1]
        lo, hi = float(atoms[0]), float(atoms[-1])
        p = (values.softmax(dim=-1) * (atoms.float() - lo) / (hi - lo)).sum(-1)
    p = p.clamp(P_CLAMP, 1 - P_CLAMP)
    if mode == "bernoulli":  # log(1 − p + p e^η), as a logaddexp for large η
        return torch.logaddexp(torch.log1p(-p), torch.log(p) + eta)
    return eta * (torch.log(p) - torch.log1p(-p))


@dataclass
class HookStats:
    """Decode steps seen and value-model forwards made, over every hook of a factory."""

    steps: int = 0
    forwards: int = 0

    @property
    def forwards_per_step(self) -> float:
        return self.forwards / self.steps if self.steps else math.nan


class ValueGuidanceHook:
    """An `OffsetHook` for one generation batch: owns the value model's KV cache."""

    def __init__(self, model: ValueModel, eta: float, mode: str, stats: HookStats | None = None):
        self.model, self.eta, self.mode = model, float(eta), mode
        self.stats = stats if stats is not None else HookStats()
        self.cache = None
        self.device = next(model.parameters()).device

    def __call__(self, step_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                 logits: torch.Tensor) -> torch.Tensor:
        self.stats.steps += 1
        with torch.inference_mode():
            out = self.model(step_ids.to(self.device), attention_mask=attention_mask.to(self.device),
                             position_ids=position_ids.to(self.device), past_key_values=self.cache,
                             use_cache=True, last_only=True)
        self.stats.forwards += 1
        self.cache = out.past_key_values
        off = offsets_from_values(out.values[:, -1], self.eta, self.mode, self.model.atoms)
        # Guide and reference share a tokenizer, but embedding matrices may be padded to
        # different widths: align on the reference's logits width.
        width = logits.shape[-1]
        if off.shape[-1] < width:
            off = torch.nn.functional.pad(off, (0, width - off.shape[-1]))
        return off[:, :width].to(logits.device)


def hook_factory(model: ValueModel, eta: float, mode: str) -> Callable[[], ValueGuidanceHook | None]:
    """A factory for `generate(offset_hook_factory=...)`; `factory.stats` counts its work.
    η = 0 returns no hook at all, so sampling is exactly π_ref's."""
    if mode not in MODES:
        raise ValueError(f"guidance.mode={mode!r}: allowed: {', '.join(MODES)}")
    stats = HookStats()

    def factory() -> ValueGuidanceHook | None:
        return ValueGuidanceHook(model, eta, mode, stats) if eta != 0 else None

    factory.stats = stats  # type: ignore[attr-defined]
    factory.model = model  # type: ignore[attr-defined]  # the batch-size probe counts it as resident
    return factory


def guided_hook_factory(ctx: Any, guide_dir: str | Path, eta: float) -> Callable[[], Any]:
    """The offset-hook factory of a chain's guide (a train folder with `value_model/`) at
    strength η, with the mode of `algos.<NAME>.guidance.mode`; the value model comes
    through the worker's model LRU (`ctx.models`)."""

    model = ctx.load_value_model(guide_dir)
    return hook_factory(model, float(eta), str(ctx.algo_cfg.guidance.mode))
