"""Automatic batch size: ``batch_size: auto_batch_size`` (alias ``auto``) for any stage.

A stage's batch size key (``generation.batch_size``, ``data_collection.reward_batch_size``,
``evaluation.batch_size``, ``algos.<NAME>.batch_size``) takes an int or ``auto``. For
``auto`` the worker probes, on its own devices, the largest batch whose memory stays within
``batch_size_safety_margin`` × the device's free memory, then keeps 95% of it.

``batch_size_safety_margin`` is the fraction of free memory to *target* (default 0.9). A
LOWER margin is SAFER: 0.8 leaves 20% of the free memory as headroom, 0.95 only 5%. (The
batch-size guide (docs/guides/auto_batch_size.txt) this replaces says the opposite in places; it is wrong there.) After an OOM
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

from pita.runtime.batch_size.cache import (  # noqa: F401
    BatchSizeCache,
    library_versions,
)
from pita.runtime.batch_size.probes import (  # noqa: F401
    _NO_EARLY_STOP,
    _causal_lm_batch,
    _cuda_available,
    _cuda_devices,
    _CudaMeter,
    _empty_cache,
    _model_key,
    generation_probe,
    generation_workload,
    training_probe,
    training_workload,
    workload_probe,
)
from pita.runtime.batch_size.resolve import (  # noqa: F401
    ProbeSetup,
    _check_margin,
    resolve_batch_size,
)
from pita.runtime.batch_size.search import (  # noqa: F401
    AUTO_VALUES,
    DEFAULT_CAP,
    DEFAULT_REDUCTION,
    DEFAULT_SAFETY_MARGIN,
    GIB,
    Measure,
    MemoryEstimate,
    SearchResult,
    StageMode,
    Trial,
    _Bracket,
    _checkpointing,
    _explore,
    _finish,
    _gib,
    _PoorFit,
    _power_binary,
    _secant,
    estimate_from_config,
    estimate_from_model,
    is_auto,
    power_binary_search,
    search_batch_size,
)

__all__ = [
    "AUTO_VALUES",
    "BatchSizeCache",
    "MemoryEstimate",
    "ProbeSetup",
    "SearchResult",
    "Trial",
    "estimate_from_config",
    "estimate_from_model",
    "generation_probe",
    "generation_workload",
    "is_auto",
    "library_versions",
    "power_binary_search",
    "resolve_batch_size",
    "search_batch_size",
    "training_probe",
    "training_workload",
    "workload_probe",
]
