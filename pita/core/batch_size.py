"""Automatic batch size: ``batch_size: auto_batch_size`` (alias ``auto``) for any stage.

A stage's batch size key (``generation.batch_size``, ``data_collection.reward_batch_size``,
``evaluation.batch_size``, ``algos.<NAME>.batch_size``) takes an int or ``auto``. For
``auto`` the worker probes, on its own devices, the largest batch whose memory stays within
``batch_size_safety_margin`` × the device's free memory, then keeps 95% of it.

``batch_size_safety_margin`` is the fraction of free memory to *target* (default 0.9). A
LOWER margin is SAFER: 0.8 leaves 20% of the free memory as headroom, 0.95 only 5%. (The
batch-size guide this replaces says the opposite in places; it is wrong there.) After an OOM
with ``auto``, lower the margin.

How the probe works, and where it departs from the guide (which binary-searched 1..2048,
≈ 2·log2(B) full runs, summing memory over GPUs):

* Worst case only: the longest prompt repeated B times with ``max_new_tokens`` forced
  (``min_new_tokens`` = ``max_new_tokens``, stop strings dropped); for training, >= 2 full
  optimizer steps so gradients and optimizer state are in the peak.
* Each device separately: a sharded model OOMs on its most loaded device, so the figure is
  the max over devices of (peak reserved − baseline reserved), scaled to the tightest
  device's free memory — never the sum. Reserved, not allocated: the caching allocator's
  fragmentation is what OOMs.
* Fit, don't search: memory is close to affine in the batch size (optimizer state fixed,
  KV cache and activations per sample). Starting from an analytic estimate (weights + KV
  cache per token × tokens + activations, :func:`estimate_from_config`), a probe at ~¼ of
  the estimated batch corrects the estimate, a second at ~¾ of the corrected batch gives a
  long lever arm, a third confirms the batch the line predicts; a secant step absorbs a
  curved profile. That is <= 4 probes where the guide's search needs ≈ 2·log2(B). When a
  probe departs from the line by more than ``fit_tolerance`` of the target (an allocator
  step, an OOM where the fit said it fits), it falls back to the guide's power-of-two +
  binary search, reusing the bracket it already has.
* Results are cached in a JSON file keyed by GPU name and memory, model, dtype, stage kind,
  lengths and library versions, and reused only while the free memory is at least what it
  was when probed (:class:`BatchSizeCache`).

The search (:func:`search_batch_size`) only sees a ``measure(batch_size) -> bytes`` callable,
so it is tested on simulated memory curves without a GPU. The CUDA adapter
(:func:`generation_probe`, :func:`training_probe`, :func:`workload_probe`) builds that callable
from a real model. Written by hand: accelerate's ``find_executable_batch_size`` only backs
off by ×0.9 from a start value on each OOM (no margin, many OOMs) and Lightning's
``BatchSizeFinder`` is power/binary search tied to a ``Trainer``.

Imports only the standard library at module level; torch is imported inside the adapter.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import importlib.metadata
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from pita.core.oom import classify_exception

__all__ = [
    "AUTO_VALUES",
    "BatchSizeCache",
    "BatchSizeFinder",
    "MemoryEstimate",
    "ProbeSetup",
    "SearchResult",
    "Trial",
    "estimate_from_config",
    "estimate_from_model",
    "find_optimal_batch_size_for_llm",
    "generation_probe",
    "generation_workload",
    "is_auto",
    "library_versions",
    "measure_memory_usage",
    "power_binary_search",
    "resolve_batch_size",
    "search_batch_size",
    "search_result_dict",
    "training_probe",
    "training_workload",
    "workload_probe",
]

_log = logging.getLogger(__name__)

AUTO_VALUES = ("auto", "auto_batch_size")
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

    def total_bytes(self, batch_size: int) -> float:
        """Weights included: what a scheduler must find free before placing the task."""
        return self.weights_bytes + self.bytes_for(batch_size)

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


# --------------------------------------------------------------------------------------
# Cache
# --------------------------------------------------------------------------------------


def library_versions() -> dict[str, str | None]:
    """Versions that change memory use (kernels, cache layout), read without importing."""
    out: dict[str, str | None] = {}
    for name in ("torch", "transformers", "accelerate", "bitsandbytes", "pita"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


class BatchSizeCache:
    """Probe results in one JSON file, shared by the workers of a machine.

    An entry is keyed by everything that changes the answer (GPU name and memory, model,
    dtype, stage kind, lengths, library versions — the caller's key) and reused only when

    * the free memory now is at least what it was (``free_tolerance``, 0.5% by default,
      absorbs jitter well inside the 5% safety reduction),
    * the safety margin now is at least the one probed with (a lower margin asks for more
      headroom than the entry was found with), and
    * the entry was not limited by a smaller cap than today's.

    Writes take an advisory lock where the OS has one and replace the file atomically.
    """

    VERSION = 1

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        free_tolerance: float = 0.005,
        logger: logging.Logger | None = None,
    ) -> None:
        self.path = Path(path)
        self.free_tolerance = free_tolerance
        self.log = logger or _log

    @staticmethod
    def key_id(key: Mapping[str, Any]) -> str:
        blob = json.dumps(key, sort_keys=True, default=str, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:32]

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            self.log.warning("Ignoring unreadable batch size cache %s: %s", self.path, exc)
            return {}
        if not isinstance(data, dict) or data.get("version") != self.VERSION:
            return {}
        entries = data.get("entries")
        return entries if isinstance(entries, dict) else {}

    def lookup(
        self, key: Mapping[str, Any], *, free_bytes: float, safety_margin: float, cap: int
    ) -> dict[str, Any] | None:
        """The cached entry (with ``batch_size`` adjusted to ``cap``) or None on a miss."""
        entry = self._read().get(self.key_id(key))
        if not isinstance(entry, dict):
            return None
        try:
            if free_bytes < entry["free_bytes"] * (1 - self.free_tolerance):
                return None
            if safety_margin < entry["safety_margin"] - 1e-9:
                return None
            found, cached_cap = int(entry["found"]), int(entry["cap"])
            if found >= cached_cap and cap > cached_cap:
                return None  # it stopped at the old cap; a larger batch may fit now
            out = dict(entry)
            if found > cap:
                out["found"] = cap
                out["batch_size"] = max(1, int(cap * DEFAULT_REDUCTION))
            return out
        except (KeyError, TypeError, ValueError):
            return None

    def store(
        self,
        key: Mapping[str, Any],
        result: SearchResult,
        *,
        free_bytes: float,
        safety_margin: float,
        cap: int,
    ) -> None:
        entry = {
            "key": dict(key),
            "batch_size": result.batch_size,
            "found": result.found,
            "bytes_at_found": result.bytes_at_found,
            "budget_bytes": result.budget_bytes,
            "free_bytes": free_bytes,
            "safety_margin": safety_margin,
            "cap": cap,
            "probes": result.probes,
            "method": result.method,
            "created": time.time(),
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._locked():
            entries = self._read()
            entries[self.key_id(key)] = entry
            blob = json.dumps(
                {"version": self.VERSION, "entries": entries}, indent=1, sort_keys=True, default=str
            )
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(blob)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        try:
            import fcntl
        except ImportError:  # not POSIX: atomic replace still keeps the file whole
            yield
            return
        with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


# --------------------------------------------------------------------------------------
# The entry point stages call
# --------------------------------------------------------------------------------------


@dataclass
class ProbeSetup:
    """What a ``measure_fn_factory`` hands the search: a measure, the free memory it is
    relative to (the tightest device's), the analytic estimate, the cache key fields it
    knows (devices, model, dtype, lengths) and a cleanup."""

    measure: Measure
    free_bytes: float
    estimate: MemoryEstimate | None = None
    key: dict[str, Any] = field(default_factory=dict)
    close: Callable[[], None] | None = None


def _check_margin(safety_margin: float) -> None:
    if not 0 < safety_margin <= 1:
        raise ValueError(
            f"batch_size_safety_margin must be in (0, 1], got {safety_margin}: it is the "
            "fraction of free GPU memory to fill; lower is safer (e.g. 0.8)"
        )


def resolve_batch_size(
    value: int | str,
    *,
    stage_kind: str,
    fallback: int,
    measure_fn_factory: Callable[[], ProbeSetup | None] | None,
    cache_path: Path | str | None,
    cache_key: Mapping[str, Any],
    safety_margin: float = DEFAULT_SAFETY_MARGIN,
    cap: int = DEFAULT_CAP,
    logger: logging.Logger | None = None,
) -> int:
    """The batch size a stage runs with.

    An int is returned unchanged. ``"auto"`` / ``"auto_batch_size"`` probes:
    ``measure_fn_factory()`` returns a :class:`ProbeSetup` (see :func:`generation_probe`,
    :func:`training_probe`) or None when there is nothing to measure (no CUDA device; also
    pass ``measure_fn_factory=None``), in which case one line is logged and ``fallback`` is
    returned. ``safety_margin`` is the fraction of free memory to target; LOWER is safer.
    ``cap`` bounds the search (2048, or the number of items the stage will process).
    """
    log = logger or _log
    if not is_auto(value):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"{stage_kind} batch size must be a positive int or one of {AUTO_VALUES}, "
                f"got {value!r}"
            )
        return value
    _check_margin(safety_margin)
    if fallback < 1 or cap < 1:
        raise ValueError(f"fallback ({fallback}) and cap ({cap}) must be >= 1")
    setup = measure_fn_factory() if measure_fn_factory is not None else None
    if setup is None:
        log.info(
            "Auto batch size (%s): no CUDA device, nothing to measure; using the "
            "configured fallback batch size %d",
            stage_kind,
            fallback,
        )
        return fallback
    try:
        budget = safety_margin * setup.free_bytes
        log.info(
            "Target memory usage (with %.1f%% safety margin): %s of %s free",
            100 * safety_margin,
            _gib(budget),
            _gib(setup.free_bytes),
        )
        key = {
            "stage_kind": stage_kind,
            **dict(cache_key),
            **setup.key,
            "versions": library_versions(),
        }
        cache = BatchSizeCache(cache_path, logger=log) if cache_path is not None else None
        if cache is not None:
            hit = cache.lookup(
                key, free_bytes=setup.free_bytes, safety_margin=safety_margin, cap=cap
            )
            if hit is not None:
                log.info(
                    "Using cached batch size %d for %s (probed with %s free, now %s)",
                    hit["batch_size"],
                    stage_kind,
                    _gib(hit["free_bytes"]),
                    _gib(setup.free_bytes),
                )
                return int(hit["batch_size"])
        result = search_batch_size(
            setup.measure, budget, estimate=setup.estimate, cap=cap, logger=log
        )
        if cache is not None and result.found >= 1:
            cache.store(
                key, result, free_bytes=setup.free_bytes, safety_margin=safety_margin, cap=cap
            )
        return result.batch_size
    finally:
        if setup.close is not None:
            setup.close()


# --------------------------------------------------------------------------------------
# CUDA adapter: build ``measure`` from a real model
# --------------------------------------------------------------------------------------


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available()) and torch.cuda.device_count() > 0
    except Exception:  # noqa: BLE001 - a broken driver means "no CUDA" here
        return False


def _cuda_devices(models: Sequence[Any]) -> list[int]:
    """CUDA device indices holding any parameter or buffer of ``models`` (a sharded model
    spans several)."""
    devices: set[int] = set()
    for model in models:
        for t in (*model.parameters(), *model.buffers()):
            if t.device.type == "cuda":
                devices.add(t.device.index or 0)
    return sorted(devices)


def _empty_cache() -> None:
    gc.collect()
    with contextlib.suppress(Exception):
        import torch

        torch.cuda.empty_cache()


class _CudaMeter:
    """Per-device peak reserved memory of a workload, over the reserved baseline."""

    def __init__(self, devices: Sequence[int], log: logging.Logger) -> None:
        import torch

        self.torch, self.devices, self.log = torch, list(devices), log
        _empty_cache()
        self.free = {d: int(torch.cuda.mem_get_info(d)[0]) for d in self.devices}
        self.free_ref = min(self.free.values())
        self.info = []
        for d in self.devices:
            props = torch.cuda.get_device_properties(d)
            self.info.append({"name": props.name, "total_bytes": int(props.total_memory)})
            log.info(
                "GPU %d: %s with %s free of %s",
                d,
                props.name,
                _gib(self.free[d]),
                _gib(props.total_memory),
            )

    def run(self, fn: Callable[[int], None], batch_size: int) -> dict[int, int] | None:
        """Per-device extra reserved bytes of ``fn(batch_size)``; None if it ran out of
        memory."""
        cuda = self.torch.cuda
        _empty_cache()
        base = {}
        for d in self.devices:
            cuda.synchronize(d)
            cuda.reset_peak_memory_stats(d)
            base[d] = int(cuda.memory_reserved(d))
        oom = False
        try:
            fn(batch_size)
            for d in self.devices:
                cuda.synchronize(d)
        except Exception as exc:
            if classify_exception(exc) != "oom":
                raise
            oom = True  # clean up below, once the traceback (holding tensors) is gone
        if oom:
            _empty_cache()
            return None
        peaks = {d: int(cuda.max_memory_reserved(d)) - base[d] for d in self.devices}
        _empty_cache()
        return peaks

    def measure(self, fn: Callable[[int], None]) -> Measure:
        """The search's ``measure``: the most loaded device's extra bytes, scaled to the
        tightest device's free memory (exact for equal devices; for unequal ones device d
        fits when peak_d <= margin·free_d, i.e. peak_d·free_ref/free_d <= margin·free_ref)."""

        def measure(batch_size: int) -> float:
            peaks = self.run(fn, batch_size)
            if peaks is None:
                return math.inf
            return max(peaks[d] * self.free_ref / self.free[d] for d in self.devices)

        return measure


def workload_probe(
    run: Callable[[int], None],
    *,
    models: Sequence[Any],
    estimate: MemoryEstimate | None = None,
    key: Mapping[str, Any] | None = None,
    logger: logging.Logger | None = None,
) -> Callable[[], ProbeSetup | None]:
    """A ``measure_fn_factory`` for any workload ``run(batch_size)`` that executes one
    worst-case step of a stage on ``models`` (e.g. value-guided decoding with a reference
    and a guide model). The factory returns None without CUDA or when the models are on
    the CPU."""
    log = logger or _log

    def factory() -> ProbeSetup | None:
        if not _cuda_available():
            return None
        devices = _cuda_devices(models)
        if not devices:
            return None
        meter = _CudaMeter(devices, log)
        return ProbeSetup(
            measure=meter.measure(run),
            free_bytes=float(meter.free_ref),
            estimate=estimate,
            key={"devices": meter.info, **dict(key or {})},
            close=_empty_cache,
        )

    return factory


def _model_key(model: Any) -> dict[str, Any]:
    config = getattr(model, "config", None)
    name = getattr(config, "_name_or_path", None) or getattr(config, "model_type", None)
    dtype = str(getattr(model, "dtype", ""))
    arch = getattr(config, "architectures", None)
    n_params = sum(p.numel() for p in model.parameters())
    return {"model": name, "architectures": arch, "dtype": dtype, "n_params": n_params}


_NO_EARLY_STOP = (
    "stopping_criteria",
    "stop_strings",
    "max_length",
    "min_length",
    "max_new_tokens",
    "min_new_tokens",
    "max_time",
)


def generation_workload(
    model: Any,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    generation_kwargs: Mapping[str, Any] | None = None,
) -> Callable[[int], None]:
    """``run(B)``: ``model.generate`` on the prompt repeated B times, forced to produce
    exactly ``max_new_tokens`` tokens (EOS masked, stop strings dropped), no grad."""
    import torch

    if not prompt_ids:
        raise ValueError("prompt_ids is empty: pass the longest prompt's token ids")
    kwargs = {k: v for k, v in dict(generation_kwargs or {}).items() if k not in _NO_EARLY_STOP}
    gen_cfg = getattr(model, "generation_config", None)
    pad = kwargs.pop("pad_token_id", None)
    if pad is None and gen_cfg is not None:
        pad = gen_cfg.pad_token_id
        if pad is None:
            eos = gen_cfg.eos_token_id
            pad = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
    device = next(model.parameters()).device
    row = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)

    def run(batch_size: int) -> None:
        ids = row.expand(batch_size, -1).contiguous()
        mask = torch.ones_like(ids)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                pad_token_id=pad,
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                **kwargs,
            )
        del out, ids, mask

    return run


def _causal_lm_batch(model: Any, seq_ids: Sequence[int]) -> Callable[[int], dict[str, Any]]:
    import torch

    device = next(model.parameters()).device
    row = torch.tensor([list(seq_ids)], dtype=torch.long, device=device)

    def make_batch(batch_size: int) -> dict[str, Any]:
        ids = row.expand(batch_size, -1).contiguous()
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}

    return make_batch


def training_workload(
    model: Any,
    make_batch: Callable[[int], Mapping[str, Any]],
    *,
    loss_fn: Callable[[Any, Mapping[str, Any]], Any] | None = None,
    optimizer_factory: Callable[[list[Any]], Any] | None = None,
    steps: int = 2,
) -> Callable[[int], None]:
    """``run(B)``: ``max(2, steps)`` optimizer steps (forward, backward, step) on
    ``make_batch(B)`` with a throwaway optimizer, so gradients and optimizer state are in
    the peak as they are from the second step of a real run.

    The weights do not change: gradients are zeroed before each step and the default
    optimizer is AdamW with lr = 0 (its moments have the parameters' dtype, as in the real
    run). An ``optimizer_factory`` (e.g. for 8-bit Adam) must also use lr = 0 and no
    weight decay. Probe before the stage creates its real optimizer, or its state is
    counted twice.
    """
    import torch

    def default_loss(m: Any, batch: Mapping[str, Any]) -> Any:
        return m(**batch).loss

    loss_of = loss_fn or default_loss

    def run(batch_size: int) -> None:
        batch = make_batch(batch_size)
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("training probe: the model has no trainable parameters")
        if optimizer_factory is not None:
            opt = optimizer_factory(params)
        else:
            opt = torch.optim.AdamW(params, lr=0.0, weight_decay=0.0)
        was_training = model.training
        model.train()
        try:
            for _ in range(max(2, steps)):
                loss = loss_of(model, batch)
                loss.backward()
                del loss
                for p in params:  # same memory, no update
                    if p.grad is not None:
                        p.grad.zero_()
                opt.step()
                opt.zero_grad(set_to_none=True)
        finally:
            model.zero_grad(set_to_none=True)
            model.train(was_training)
            del opt, batch

    return run


def generation_probe(
    model: Any,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    generation_kwargs: Mapping[str, Any] | None = None,
    *,
    extra_models: Sequence[Any] = (),
    logger: logging.Logger | None = None,
) -> Callable[[], ProbeSetup | None]:
    """``measure_fn_factory`` for a generation stage: the longest prompt's ids, the full
    ``max_new_tokens``. ``extra_models`` are other models resident on the same devices."""
    kwargs = dict(generation_kwargs or {})
    n_ret = int(kwargs.get("num_return_sequences", 1) or 1) * int(kwargs.get("num_beams", 1) or 1)
    estimate = estimate_from_model(
        model,
        mode="generate",
        prompt_tokens=len(prompt_ids),
        new_tokens=max_new_tokens,
        num_return_sequences=n_ret,
    )
    key = {
        **_model_key(model),
        "prompt_tokens": len(prompt_ids),
        "new_tokens": max_new_tokens,
        "sequences_per_prompt": n_ret,
        "do_sample": bool(kwargs.get("do_sample", False)),
    }

    def factory() -> ProbeSetup | None:
        if not _cuda_available() or not _cuda_devices([model]):
            return None  # before touching torch.tensor on a device that is not there
        run = generation_workload(model, prompt_ids, max_new_tokens, kwargs)
        return workload_probe(
            run, models=[model, *extra_models], estimate=estimate, key=key, logger=logger
        )()

    return factory


def training_probe(
    model: Any,
    seq_ids: Sequence[int] | None = None,
    *,
    make_batch: Callable[[int], Mapping[str, Any]] | None = None,
    seq_tokens: int | None = None,
    loss_fn: Callable[[Any, Mapping[str, Any]], Any] | None = None,
    optimizer_factory: Callable[[list[Any]], Any] | None = None,
    steps: int = 2,
    extra_models: Sequence[Any] = (),
    logger: logging.Logger | None = None,
) -> Callable[[], ProbeSetup | None]:
    """``measure_fn_factory`` for a training stage. Either ``seq_ids`` (the longest
    training sequence; a causal-LM batch with labels = inputs is built) or ``make_batch(B)``
    with ``seq_tokens`` (its sequence length, for the estimate and the cache key)."""
    if make_batch is None and seq_ids is None:
        raise ValueError("training_probe needs seq_ids or make_batch")
    tokens = len(seq_ids) if seq_ids is not None else int(seq_tokens or 0)
    if tokens < 1:
        raise ValueError("training_probe with make_batch needs seq_tokens (>= 1)")
    estimate = estimate_from_model(model, mode="train", prompt_tokens=tokens)
    key = {
        **_model_key(model),
        "seq_tokens": tokens,
        "steps": max(2, steps),
        "gradient_checkpointing": _checkpointing(model),
    }

    def factory() -> ProbeSetup | None:
        if not _cuda_available() or not _cuda_devices([model]):
            return None
        batch_fn = make_batch or _causal_lm_batch(model, seq_ids or [])
        run = training_workload(
            model, batch_fn, loss_fn=loss_fn, optimizer_factory=optimizer_factory, steps=steps
        )
        return workload_probe(
            run, models=[model, *extra_models], estimate=estimate, key=key, logger=logger
        )()

    return factory


# --------------------------------------------------------------------------------------
# The guide's API
# --------------------------------------------------------------------------------------


def _prompt_ids(tokenizer: Any, sample_text: str, max_length: int) -> list[int]:
    """The sample's tokens, repeated or cut to exactly ``max_length``: the guide padded the
    sample to ``max_length``, which costs the same memory as a prompt that long."""
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    ids = list(tokenizer(sample_text)["input_ids"])
    if not ids:
        fill = getattr(tokenizer, "bos_token_id", None) or getattr(tokenizer, "eos_token_id", 0)
        ids = [int(fill or 0)]
    return (ids * math.ceil(max_length / len(ids)))[:max_length]


def _max_new_tokens(generation_kwargs: Mapping[str, Any] | None) -> int:
    n = (generation_kwargs or {}).get("max_new_tokens")
    if n is None:
        raise ValueError("generation_kwargs must set max_new_tokens (the probe forces it)")
    return int(n)


def measure_memory_usage(
    model: Any,
    tokenizer: Any,
    batch_size: int,
    sample_text: str,
    max_length: int,
    generation_kwargs: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One worst-case generation at ``batch_size``, in bytes, on the most loaded device:
    ``start_memory`` (reserved before), ``peak_memory``, ``current_memory`` (reserved after,
    before the cache is emptied), ``memory_per_sample`` ((peak − start) / batch_size), plus
    ``device`` and ``per_device`` (device → peak − start). Raises ``torch.OutOfMemoryError``
    if the batch does not fit, ``RuntimeError`` without CUDA."""
    if not _cuda_available() or not _cuda_devices([model]):
        raise RuntimeError("measure_memory_usage needs a model on a CUDA device")
    import torch

    run = generation_workload(
        model,
        _prompt_ids(tokenizer, sample_text, max_length),
        _max_new_tokens(generation_kwargs),
        generation_kwargs,
    )
    devices = _cuda_devices([model])
    _empty_cache()
    start = {}
    for d in devices:
        torch.cuda.synchronize(d)
        torch.cuda.reset_peak_memory_stats(d)
        start[d] = int(torch.cuda.memory_reserved(d))
    run(batch_size)
    for d in devices:
        torch.cuda.synchronize(d)
    peak = {d: int(torch.cuda.max_memory_reserved(d)) for d in devices}
    current = {d: int(torch.cuda.memory_reserved(d)) for d in devices}
    _empty_cache()
    per_device = {d: peak[d] - start[d] for d in devices}
    top = max(devices, key=lambda d: per_device[d])
    return {
        "start_memory": start[top],
        "peak_memory": peak[top],
        "current_memory": current[top],
        "memory_per_sample": per_device[top] / batch_size,
        "device": top,
        "per_device": per_device,
    }


def find_optimal_batch_size_for_llm(
    model: Any,
    tokenizer: Any,
    sample_text: str,
    max_length: int,
    generation_kwargs: Mapping[str, Any] | None = None,
    *,
    safety_margin: float = DEFAULT_SAFETY_MARGIN,
    cap: int = DEFAULT_CAP,
    fallback: int = 1,
    cache_path: Path | str | None = None,
    logger: logging.Logger | None = None,
) -> int:
    """The guide's call: the generation batch size for ``model`` with prompts of
    ``max_length`` tokens and ``generation_kwargs["max_new_tokens"]`` new tokens (works with
    ``device_map="auto"``; the most loaded GPU decides). ``fallback`` without CUDA."""
    prompt = _prompt_ids(tokenizer, sample_text, max_length)
    new_tokens = _max_new_tokens(generation_kwargs)
    factory = generation_probe(model, prompt, new_tokens, generation_kwargs, logger=logger)
    return resolve_batch_size(
        "auto",
        stage_kind="generate",
        fallback=fallback,
        measure_fn_factory=factory,
        cache_path=cache_path,
        cache_key={},
        safety_margin=safety_margin,
        cap=cap,
        logger=logger,
    )


class BatchSizeFinder:
    """The guide's finder object: search settings held once, used for several stages.

    ``safety_margin`` is the fraction of free memory to target — lower is safer.
    """

    def __init__(
        self,
        safety_margin: float = DEFAULT_SAFETY_MARGIN,
        *,
        cap: int = DEFAULT_CAP,
        reduction: float = DEFAULT_REDUCTION,
        max_fit_probes: int = 4,
        cache_path: Path | str | None = None,
        logger: logging.Logger | None = None,
    ) -> None:
        _check_margin(safety_margin)
        self.safety_margin, self.cap, self.reduction = safety_margin, cap, reduction
        self.max_fit_probes, self.cache_path = max_fit_probes, cache_path
        self.log = logger or _log

    def search(
        self, measure: Measure, free_bytes: float, estimate: MemoryEstimate | None = None
    ) -> SearchResult:
        """Search on any ``measure`` (real or simulated) against ``free_bytes``."""
        return search_batch_size(
            measure,
            self.safety_margin * free_bytes,
            estimate=estimate,
            cap=self.cap,
            reduction=self.reduction,
            max_fit_probes=self.max_fit_probes,
            logger=self.log,
        )

    def find(
        self,
        factory: Callable[[], ProbeSetup | None] | None,
        *,
        stage_kind: str,
        fallback: int = 1,
        cache_key: Mapping[str, Any] | None = None,
    ) -> int:
        """:func:`resolve_batch_size` for ``"auto"`` with this finder's settings."""
        return resolve_batch_size(
            "auto",
            stage_kind=stage_kind,
            fallback=fallback,
            measure_fn_factory=factory,
            cache_path=self.cache_path,
            cache_key=cache_key or {},
            safety_margin=self.safety_margin,
            cap=self.cap,
            logger=self.log,
        )

    def for_generation(
        self,
        model: Any,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        generation_kwargs: Mapping[str, Any] | None = None,
        *,
        fallback: int = 1,
    ) -> int:
        factory = generation_probe(
            model, prompt_ids, max_new_tokens, generation_kwargs, logger=self.log
        )
        return self.find(factory, stage_kind="generate", fallback=fallback)

    def for_training(
        self, model: Any, seq_ids: Sequence[int], *, fallback: int = 1, **probe_kwargs: Any
    ) -> int:
        factory = training_probe(model, seq_ids, logger=self.log, **probe_kwargs)
        return self.find(factory, stage_kind="train", fallback=fallback)


def search_result_dict(result: SearchResult) -> dict[str, Any]:
    """A JSON-ready view of a search (for logs and benchmarks)."""
    out = asdict(result)
    out["trace"] = [
        {**asdict(t), "bytes": None if math.isinf(t.bytes) else t.bytes} for t in result.trace
    ]
    return out
