"""Guided decoding: the value model's offsets added to π_ref's top-k logits.

At every step the generation engine (pita/models/generation.py) takes π_ref's raw logits,
keeps its top-k tokens, adds the offsets this hook returns, applies temperature and
samples (docs/ALGORITHMS.md, "Guided decoding"). The offset of candidate a in state s:

| mode          | value model output            | offset                              |
|---------------|-------------------------------|-------------------------------------|
| `bernoulli`   | p = σ(logit) = P(correct|s,a) | log(1 − p + p·e^η)                  |
| `mle`         | pmf over atoms z_1..z_M       | log Σ_m pmf_m·e^{η z_m}             |
| `expectation` | p = P(y' ≻ y | s, a)          | η·log(p / (1 − p))                  |
| `expectation_clamped` | as `expectation`      | η·clamp(log(p/(1−p)), log 0.01, log 0.99) |

η multiplies the value (η = 0 is π_ref exactly: no offset at all). p is clamped to
[1e-6, 1 − 1e-6] for the logarithms only; the three main modes' offsets are *not* clamped
to ≤ 0 (then guidance could only suppress tokens). `expectation_clamped` is the exception,
on purpose: it is the offset of the official star-graph PITA code (`guide_class == 2`:
the odds clamped to [1e-2, 1 − 1e-2], so a token can be suppressed by at most η·4.6 nats
and never promoted), which keeps an over-confident classifier from collapsing guided
decoding at large η (the unbounded η·logit(p) reaches ±138 nats at η = 10). A
distributional head used with `bernoulli` / `expectation*` gives p = the pmf's mean
mapped to [0, 1].

Cost (Q-type head, `value_head: q`): the hook keeps the value model's own KV cache
across the steps of a batch and makes exactly one batched value-model forward per
generated token: the prompt on the first call, then only the newest token. The
per-vocabulary head scores every candidate from that single forward.

Cost (V-type head, `value_head: v`): the candidates must enter the backbone. Per step,
π_ref's top-k candidates of every row are scored in ONE forward of [B·k, 1] tokens over
the prefix's KV cache repeated k times (`ValueModel.score_candidates`); the next step keeps
the sampled candidate's row of that expanded cache (its keys/values are already there),
so it is again one forward per step, plus the prompt's forward on the first call. Rows
fed the pad token outside their candidates are finished rows (the generator feeds them
pad): their state is not advanced, since nothing they score is used any more. Any other
row whose fed token is not among its candidates (a generator whose top-k differs from the
hook's) makes the step fall back to advancing the prefix with one extra forward, which
is exact. Guided decoding samples among the same top-k (`guidance.top_k` for both). `HookStats` counts steps and forwards (bench/generation.py
reports their ratio).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from pita.core.schema import GUIDANCE_MODES as MODES
from pita.core.schema import ValueGuidedConfig
from pita.models.value_model import ValueModel

P_CLAMP = 1e-6
ODDS_CLAMP = (1e-2, 1 - 1e-2)  # the official star-graph PITA's clamp of p / (1 − p)


def offsets_from_values(
    values: torch.Tensor, eta: float, mode: str, atoms: torch.Tensor
) -> torch.Tensor:
    """Offsets [..., V] from head outputs [..., V, M] (M = 1: logits; M > 1: atom logits)."""
    if mode not in MODES:
        raise ValueError(f"guidance.mode={mode!r}: allowed: {', '.join(MODES)}")
    values = values.float()
    n_atoms = values.shape[-1]
    if mode == "mle":
        if n_atoms == 1:
            raise ValueError(
                "guidance.mode=mle needs a distributional value model (loss_type=mle); "
                "this one has a single logit per token: use bernoulli or expectation"
            )
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
    log_odds = torch.log(p) - torch.log1p(-p)
    if mode == "expectation_clamped":
        log_odds = log_odds.clamp(math.log(ODDS_CLAMP[0]), math.log(ODDS_CLAMP[1]))
    return eta * log_odds


@dataclass
class HookStats:
    """Decode steps seen and value-model forwards made, over every hook of a factory."""

    steps: int = 0
    forwards: int = 0


def _fit_width(off: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Guide and reference share a tokenizer, but embedding matrices may be padded to
    different widths: align on the reference's logits width."""
    width = logits.shape[-1]
    if off.shape[-1] < width:
        off = torch.nn.functional.pad(off, (0, width - off.shape[-1]))
    return off[:, :width].to(logits.device)


class ValueGuidanceHook:
    """An `OffsetHook` for one generation batch (Q-type head): owns the value model's KV cache."""

    def __init__(self, model: ValueModel, eta: float, mode: str, stats: HookStats | None = None):
        self.model, self.eta, self.mode = model, float(eta), mode
        self.stats = stats if stats is not None else HookStats()
        self.cache = None
        self.device = next(model.parameters()).device

    def __call__(
        self, step_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, logits: Tensor
    ) -> Tensor:
        self.stats.steps += 1
        with torch.inference_mode():
            out = self.model(
                step_ids.to(self.device),
                attention_mask=attention_mask.to(self.device),
                position_ids=position_ids.to(self.device),
                past_key_values=self.cache,
                use_cache=True,
                last_only=True,
            )
        self.stats.forwards += 1
        self.cache = out.past_key_values
        off = offsets_from_values(out.values[:, -1], self.eta, self.mode, self.model.atoms)
        return _fit_width(off, logits)


class CandidateGuidanceHook:
    """An `OffsetHook` for one generation batch (V-type head): scores π_ref's top-k
    candidates in one batched forward over the prefix cache expanded k times, and keeps the
    sampled candidate's row of that cache for the next step (see the module docstring)."""

    def __init__(
        self,
        model: ValueModel,
        eta: float,
        mode: str,
        top_k: int,
        stats: HookStats | None = None,
        *,
        generation_top_k: int | None = None,
    ):
        self.model, self.eta, self.mode, self.top_k = model, float(eta), mode, int(top_k)
        # The generator samples among its own top-k of the same logits: when that set lies
        # inside ours, every fed token is a candidate (or padding) and the per-token check
        # below, a host round trip on a GPU, can be skipped.
        self.fed_is_candidate = generation_top_k is not None and 0 < generation_top_k <= self.top_k
        self.stats = stats if stats is not None else HookStats()
        self.cache = None  # B·k rows after a step: row b·k + j ends with candidate j of row b
        self.candidates: torch.Tensor | None = None  # [B, k] of the previous step
        self.device = next(model.parameters()).device
        self.pad_id = model.backbone.config.pad_token_id

    def _advance(
        self, step_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> None:
        """Feed step_ids to the B-row prefix cache (first call, or the exact fallback)."""
        out = self.model.backbone(
            input_ids=step_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=self.cache,
            use_cache=True,
        )
        self.stats.forwards += 1
        self.cache = out.past_key_values

    def __call__(
        self, step_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, logits: Tensor
    ) -> Tensor:
        self.stats.steps += 1
        dev = self.device
        step_ids, attention_mask, position_ids = (
            step_ids.to(dev),
            attention_mask.to(dev),
            position_ids.to(dev),
        )
        b = step_ids.shape[0]
        k = (
            min(self.top_k, logits.shape[-1], self.model.vocab_size)
            if self.top_k > 0
            else min(logits.shape[-1], self.model.vocab_size)
        )
        with torch.inference_mode():
            if self.cache is None:  # the prompt
                self._advance(step_ids, attention_mask, position_ids)
            else:  # keep the fed token's row of the expanded cache, if it was a candidate
                prev_k = self.candidates.shape[1]
                hit = self.candidates.eq(step_ids[:, -1:])
                rows = torch.arange(b, device=dev) * prev_k + hit.float().argmax(dim=-1)
                self.cache.batch_select_indices(rows)
                finished = (
                    step_ids[:, -1].eq(self.pad_id) if self.pad_id is not None else hit.new_zeros(b)
                )
                if not self.fed_is_candidate and not bool(
                    (hit.any(dim=-1) | finished).all()
                ):  # exact fallback: drop the candidate, feed the token
                    self.cache.crop(-1)
                    self._advance(step_ids, attention_mask, position_ids)
            cand = logits.topk(k, dim=-1).indices.to(dev)  # the generator's own top-k (same logits)
            values, self.cache = self.model.score_candidates(
                self.cache, cand, attention_mask, position_ids[:, -1] + 1
            )
            self.stats.forwards += 1
        self.candidates = cand
        off_k = offsets_from_values(values.unsqueeze(-2), self.eta, self.mode, self.model.atoms)[
            ..., 0
        ]  # [B, k]
        off = torch.zeros((b, logits.shape[-1]), dtype=off_k.dtype, device=dev).scatter(
            -1, cand, off_k
        )
        return off.to(logits.device)


@dataclass
class HookFactory:
    """A factory for `generate(offset_hook_factory=...)`: a fresh hook per generate call.
    `stats` counts the work of all its hooks; `model` is the guide (the batch-size probe
    counts it as resident)."""

    model: ValueModel
    eta: float
    mode: str
    top_k: int = 0
    generation_top_k: int | None = None
    stats: HookStats = field(default_factory=HookStats)

    def __call__(self) -> ValueGuidanceHook | CandidateGuidanceHook | None:
        if self.eta == 0:
            return None
        if self.model.head_type == "v":
            return CandidateGuidanceHook(
                self.model,
                self.eta,
                self.mode,
                self.top_k,
                self.stats,
                generation_top_k=self.generation_top_k,
            )
        return ValueGuidanceHook(self.model, self.eta, self.mode, self.stats)


def hook_factory(
    model: ValueModel,
    eta: float,
    mode: str,
    top_k: int = 0,
    *,
    generation_top_k: int | None = None,
) -> HookFactory:
    """A factory for `generate(offset_hook_factory=...)`; `factory.stats` counts its work.
    η = 0 returns no hook at all, so sampling is exactly π_ref's. `top_k`: the candidates a
    V-type head scores (the generator's top-k; 0 = the whole vocabulary).
    `generation_top_k`: the top-k the generator samples with, when the caller knows it
    (lets the V-type hook skip a per-token host check; see CandidateGuidanceHook)."""
    if mode not in MODES:
        raise ValueError(f"guidance.mode={mode!r}: allowed: {', '.join(MODES)}")
    return HookFactory(model, eta, mode, top_k, generation_top_k)


def guided_hook_factory(ctx: Any, guide_dir: str | Path, eta: float) -> HookFactory:
    """The offset-hook factory of a chain's guide (a train folder with `value_model/`) at
    strength η, with the mode of `algos.<NAME>.guidance.mode`; the value model comes
    through the worker's model LRU (`ctx.models`). Its callers (evaluate, collect) sample
    guided decoding with the generator's top-k = `guidance.top_k`."""
    model = ctx.load_value_model(guide_dir)
    guidance = ctx.algo_as(ValueGuidedConfig).guidance
    top_k = int(guidance.top_k)
    return hook_factory(model, float(eta), str(guidance.mode), top_k, generation_top_k=top_k)
