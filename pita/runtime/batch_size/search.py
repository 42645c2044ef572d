"""Memory estimates and the batch-size search: pure arithmetic over a `measure(batch) -> bytes`
callable, tested on simulated memory curves without a GPU.

Part of pita.runtime.batch_size (see its docstring for how the probe works).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pita.core.schema import AUTO_BATCH as AUTO_VALUES
from pita.runtime.oom import classify_exception

_log = logging.getLogger("pita.runtime.batch_size")


DEFAULT_SAFETY_MARGIN = 0.9
DEFAULT_REDUCTION = 0.95  # the guide's extra 5% off the largest batch that fits
DEFAULT_CAP = 2048
GIB = float(1 << 30)

Measure = Callable[[int], float]


def is_auto(value: object) -> bool:
    """True for ``"auto"`` / ``"auto_batch_size"`` (any case, surrounding spaces ignored)."""
    return isinstance(value, str) and value.strip().lower() in AUTO_VALUES


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


# --------------------------------------------------------------------------------------
# Analytic estimate
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryEstimate:
    """Memory a workload adds on top of what is resident when the probe starts.

    ``per_sample_bytes`` grows with the batch (KV cache, activations, logits);
    ``fixed_bytes`` does not (gradients, optimizer state, workspaces); ``weights_bytes`` is
    already resident when probing and matters only for placing a task before it starts.
    """

    per_sample_bytes: float
    fixed_bytes: float = 0.0
    weights_bytes: float = 0.0

    def bytes_for(self, batch_size: int) -> float:
        """Extra bytes over the resident weights at ``batch_size``."""
        return self.fixed_bytes + batch_size * self.per_sample_bytes

    def max_batch(self, budget_bytes: float) -> int:
        """Largest batch the estimate says fits in ``budget_bytes`` (0 if none)."""
        if self.per_sample_bytes <= 0:
            return 0
        return max(0, int((budget_bytes - self.fixed_bytes) // self.per_sample_bytes))


StageMode = Literal["generate", "forward", "train"]


def estimate_from_config(
    config: Any,
    *,
    mode: StageMode,
    prompt_tokens: int,
    new_tokens: int = 0,
    dtype_bytes: int = 2,
    n_params: int | None = None,
    trainable_params: int | None = None,
    num_return_sequences: int = 1,
    gradient_checkpointing: bool = False,
    optimizer_bytes_per_param: float | None = None,
) -> MemoryEstimate:
    """Analytic memory of a decoder-only transformer from its HF config.

    A starting point for the fit, not a promise: it ignores allocator fragmentation and
    kernel workspaces, which is why the probe measures. Per sample, with T tokens, L layers,
    hidden size h, MLP width I, vocabulary V:

    * generate: KV cache 2·L·kv_heads·head_dim·T·bytes, plus the prefill's transient
      activations P·(4h + 3I)·bytes (one layer at a time; no grad), plus fp32 logits /
      processed scores / probabilities for the last position (3·4·V bytes).
    * forward (scoring): T·(4h + 3I)·bytes activations plus full fp32 logits T·V·(bytes + 4).
    * train: saved activations L·T·(8h + 4I)·bytes (only L·T·h·bytes plus one layer's worth
      with gradient checkpointing), plus logits, their fp32 upcast and its gradient
      T·V·(bytes + 8); fixed: gradients and AdamW's two moments for the trainable weights.
    Eager attention adds heads·P²·(bytes + 4) for the score matrix and its softmax.
    """
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    n_layers = int(cfg.num_hidden_layers)
    hidden = int(cfg.hidden_size)
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or hidden // heads)
    inter = int(getattr(cfg, "intermediate_size", None) or 4 * hidden)
    vocab = int(cfg.vocab_size)
    eager = getattr(cfg, "_attn_implementation", None) == "eager"
    if n_params is None:  # attention + MLP per layer, embeddings and head
        attn = hidden * (heads * head_dim) * 2 + hidden * (kv_heads * head_dim) * 2
        n_params = n_layers * (attn + 3 * hidden * inter) + 2 * vocab * hidden
    weights = float(n_params * dtype_bytes)
    b = dtype_bytes
    prompt = max(1, prompt_tokens)
    tokens = prompt + max(0, new_tokens)
    attn_scores = heads * prompt * prompt * (b + 4) if eager else 0

    fixed = 0.0
    if mode == "generate":
        kv = 2 * n_layers * kv_heads * head_dim * tokens * b
        per_sample = kv + prompt * (4 * hidden + 3 * inter) * b + attn_scores + 3 * 4 * vocab
        per_sample *= max(1, num_return_sequences)
    elif mode == "forward":
        per_sample = tokens * (4 * hidden + 3 * inter) * b + tokens * vocab * (b + 4)
        per_sample += attn_scores
    elif mode == "train":
        layer = tokens * (8 * hidden + 4 * inter) * b
        saved = (
            n_layers * tokens * hidden * b + layer if gradient_checkpointing else n_layers * layer
        )
        per_sample = saved + tokens * vocab * (b + 8) + n_layers * attn_scores
        trainable = n_params if trainable_params is None else trainable_params
        opt = 2 * b if optimizer_bytes_per_param is None else optimizer_bytes_per_param
        fixed = trainable * (b + opt)  # gradients + optimizer moments
    else:
        raise ValueError(f"mode must be 'generate', 'forward' or 'train', not {mode!r}")
    return MemoryEstimate(
        per_sample_bytes=float(per_sample), fixed_bytes=float(fixed), weights_bytes=weights
    )


def _checkpointing(model: Any) -> bool:
    """Whether activation checkpointing is on (the property was renamed in transformers 5;
    looked up on the class so the deprecated one is not called)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def estimate_from_model(
    model: Any,
    *,
    mode: StageMode,
    prompt_tokens: int,
    new_tokens: int = 0,
    num_return_sequences: int = 1,
) -> MemoryEstimate | None:
    """:func:`estimate_from_config` with sizes read from a loaded HF model (None when the
    model has no decoder config the formula understands)."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    params = list(model.parameters())
    dtype = getattr(model, "dtype", None) or (params[0].dtype if params else None)
    try:
        dtype_bytes = int(dtype.itemsize) if dtype is not None else 2
        return estimate_from_config(
            config,
            mode=mode,
            prompt_tokens=prompt_tokens,
            new_tokens=new_tokens,
            dtype_bytes=dtype_bytes,
            n_params=sum(p.numel() for p in params),
            trainable_params=sum(p.numel() for p in params if p.requires_grad),
            num_return_sequences=num_return_sequences,
            gradient_checkpointing=_checkpointing(model),
        )
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):
        return None


# --------------------------------------------------------------------------------------
# The search
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Trial:
    """One probe: the batch size, the bytes it used on the most loaded device (``inf`` for
    out of memory), the phase, and what the fitted line predicted (fit probes only)."""

    batch_size: int
    bytes: float
    phase: str
    predicted: float | None = None


@dataclass
class SearchResult:
    batch_size: int  # what the stage uses: ``found`` after the safety reduction
    found: int  # largest batch measured within the budget (0: even 1 did not fit)
    probes: int
    trace: list[Trial]
    method: str  # "fit", "fallback" (fit was poor, then power + binary) or "power_binary"
    budget_bytes: float
    bytes_at_found: float | None = None


class _PoorFit(Exception):
    pass


class _Bracket:
    """Every measurement so far, and the bracket they imply: ``lo`` the largest batch that
    fitted below the smallest one that did not (``hi``; cap + 1 while none failed)."""

    def __init__(
        self, measure: Measure, budget: float, cap: int, log: logging.Logger, max_probes: int
    ) -> None:
        self.measure, self.budget, self.cap, self.log = measure, budget, cap, log
        self.max_probes = max_probes
        self.ok: dict[int, float] = {}
        self.bad: dict[int, float] = {}
        self.trace: list[Trial] = []

    @property
    def hi(self) -> int:
        return min(self.bad, default=self.cap + 1)

    @property
    def lo(self) -> int:
        hi = self.hi
        return max((b for b in self.ok if b < hi), default=0)

    @property
    def probes(self) -> int:
        return len(self.trace)

    def probe(self, b: int, phase: str, predicted: float | None = None) -> float:
        if self.probes >= self.max_probes:
            raise RuntimeError(f"batch size search did not converge in {self.max_probes} probes")
        self.log.info("%s phase - Trial %d: Testing batch size %d", phase, self.probes + 1, b)
        try:
            used = self.measure(b)
        except Exception as exc:
            if classify_exception(exc) != "oom":
                raise
            used = math.inf
        used = math.inf if used is None or math.isnan(used) else float(used)
        self.trace.append(Trial(b, used, phase.lower(), predicted))
        if math.isinf(used):
            self.log.info("Batch size %d: out of memory", b)
        else:
            self.log.info(
                "Batch size %d uses %s (%.1f%% of the %s target)",
                b,
                _gib(used),
                100 * used / self.budget,
                _gib(self.budget),
            )
        (self.ok if used <= self.budget else self.bad)[b] = used
        return used


def _secant(br: _Bracket, target: float, min_span: float) -> tuple[int, float] | None:
    """Next batch from a straight line through two measurements, or None when no pair is
    trustworthy yet. The pair: the bracket's ends when the smallest failure has a finite
    reading (regula falsi: interpolation), else the largest batch that fitted and the
    largest one below it whose memory is at least ``min_span`` lower (a short lever arm
    turns measurement noise into a wild slope)."""
    lo, hi = br.lo, br.hi
    if lo < 1:
        return None
    if hi in br.bad and math.isfinite(br.bad[hi]):
        (b0, m0), (b1, m1) = (lo, br.ok[lo]), (hi, br.bad[hi])
    else:
        below = [b for b in br.ok if b < lo and br.ok[lo] - br.ok[b] >= min_span]
        if not below:
            return None
        (b0, m0), (b1, m1) = (max(below), br.ok[max(below)]), (lo, br.ok[lo])
    slope = (m1 - m0) / (b1 - b0)
    if slope <= 0:
        raise _PoorFit(f"memory did not grow from batch {b0} to {b1}")
    b = math.floor(b0 + (target - m0) / slope)
    b = max(lo + 1, min(b, hi - 1, br.cap))
    return b, m0 + slope * (b - b0)


def _explore(br: _Bracket, target: float, estimate: MemoryEstimate | None) -> int:
    """Next batch when no line can be drawn yet: shrink below failures, else use the one
    reading to correct the estimate's per-sample bytes and go to ~¾ of the batch it now
    predicts (far enough for a long lever arm, short of the target); if that is not far,
    step down instead, since the reading is then already close to the target."""
    lo, hi = br.lo, br.hi
    if lo == 0:  # everything so far failed: go well below the smallest failure
        return max(1, hi // 4)
    used = br.ok[lo]
    fixed = estimate.fixed_bytes if estimate is not None else 0.0
    if used <= fixed:  # the estimate's fixed part is more than the whole reading: wrong;
        fixed = 0.0  # assume none (then used/lo bounds the per-sample bytes from above)
    predicted = lo * (target - fixed) / max(used - fixed, 1.0)
    b = int(0.75 * predicted)
    if b >= int(1.5 * lo) or lo == 1:
        if estimate is None and b < 4 * lo:
            b = 8 * lo  # fixed memory dominates and nothing says how much: grow fast
        return max(lo + 1, min(b, hi - 1, br.cap))
    if lo >= 2 and lo // 2 not in br.ok:
        return lo // 2
    # nothing useful below: halve the distance to the failure (or grow)
    return max(lo + 1, min((lo + hi) // 2 if hi <= br.cap else 2 * lo, hi - 1, br.cap))


def _power_binary(br: _Bracket, rel_tol: float) -> None:
    """The guide's search, resumed from whatever bracket is known: double until something
    fails (or the cap), then bisect until ``hi - lo <= max(1, lo·rel_tol)``."""
    while br.hi > br.cap and br.lo < br.cap:
        br.probe(min(br.cap, max(1, 2 * br.lo)), "Power")
    while br.hi - br.lo > max(1, int(br.lo * rel_tol)):
        br.probe((br.lo + br.hi) // 2, "Binary")


def _finish(br: _Bracket, method: str, reduction: float, log: logging.Logger) -> SearchResult:
    found = br.lo
    used = br.ok.get(found)
    if found == 0:
        log.warning(
            "Even batch size 1 does not fit in the %s target; using 1 (expect an "
            "out-of-memory error: lower the lengths, quantize or add GPUs)",
            _gib(br.budget),
        )
        final = 1
    elif found >= br.cap and used is not None and used <= reduction * br.budget:
        final = found  # capped (by the data size, say), with memory to spare: keep it all
    else:
        final = max(1, int(found * reduction))
    if found:
        log.info("Found optimal batch size: %d, using %d for safety", found, final)
    return SearchResult(final, found, br.probes, br.trace, method, br.budget, used)


def search_batch_size(
    measure: Measure,
    budget_bytes: float,
    *,
    estimate: MemoryEstimate | None = None,
    cap: int = DEFAULT_CAP,
    reduction: float = DEFAULT_REDUCTION,
    max_fit_probes: int = 4,
    aim: float = 0.97,
    accept: float = 0.94,
    fit_tolerance: float = 0.10,
    min_span: float = 0.15,
    rel_tol: float = 1 / 32,
    max_probes: int = 64,
    logger: logging.Logger | None = None,
) -> SearchResult:
    """Largest batch in ``[1, cap]`` whose measured memory is <= ``budget_bytes``, then
    ×``reduction``.

    ``measure(b)`` returns the peak bytes on the most loaded device at batch ``b``; it
    signals out of memory by raising (anything :func:`classify_exception` calls ``"oom"``)
    or by returning ``inf`` / ``None``. Fit phase (<= ``max_fit_probes`` probes): a first
    probe at ~¼ of the estimate's batch (1 without an estimate); a second at ~¾ of the
    batch the estimate predicts once corrected by that reading; then secant steps aimed at
    ``aim`` × budget until a probe lands in ``[accept, 1]`` × budget, brackets to one, or
    hits the cap. A secant probe off its line by more than ``fit_tolerance`` × budget (or
    out of memory) means the curve is not smooth: fall back to power + binary search from
    the bracket known so far.
    """
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be > 0, got {budget_bytes}")
    if cap < 1:
        raise ValueError(f"cap must be >= 1, got {cap}")
    log = logger or _log
    br = _Bracket(measure, float(budget_bytes), int(cap), log, max_probes)
    target = aim * budget_bytes

    def converged() -> bool:
        lo = br.lo
        if br.hi <= 1:
            return True  # nothing fits
        return lo >= 1 and (br.ok[lo] >= accept * budget_bytes or br.hi <= lo + 1 or lo >= cap)

    first = 1
    if estimate is not None and estimate.per_sample_bytes > 0:
        first = max(1, min(cap, estimate.max_batch(target)) // 4)
    method = "fit"
    try:
        while br.probes < max_fit_probes and not converged():
            if br.probes == 0:
                br.probe(first, "Fit")
                continue
            step = _secant(br, target, min_span * budget_bytes)
            if step is None:
                br.probe(_explore(br, target, estimate), "Fit")
                continue
            b, predicted = step
            used = br.probe(b, "Fit", predicted)
            if math.isinf(used) or abs(used - predicted) > fit_tolerance * budget_bytes:
                raise _PoorFit(f"batch {b} used {_gib(used)}, the fit said {_gib(predicted)}")
        if not converged():
            raise _PoorFit(f"not converged after {br.probes} probes")
    except _PoorFit as why:
        method = "fallback"
        log.info("The linear fit does not hold (%s): power + binary search from here", why)
        _power_binary(br, rel_tol)
    return _finish(br, method, reduction, log)


def power_binary_search(
    measure: Measure,
    budget_bytes: float,
    *,
    cap: int = DEFAULT_CAP,
    reduction: float = DEFAULT_REDUCTION,
    rel_tol: float = 0.0,
    max_probes: int = 64,
    logger: logging.Logger | None = None,
) -> SearchResult:
    """The guide's search from scratch: batch 1, 2, 4, ... until one does not fit (or the
    cap), then binary search to the exact boundary. About 2·log2(B) probes; the baseline."""
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be > 0, got {budget_bytes}")
    log = logger or _log
    br = _Bracket(measure, float(budget_bytes), int(cap), log, max_probes)
    _power_binary(br, rel_tol)
    return _finish(br, "power_binary", reduction, log)
