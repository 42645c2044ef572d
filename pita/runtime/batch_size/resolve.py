"""`resolve_batch_size`: an int as configured, or `auto` through the cache and the probe.

Part of pita.runtime.batch_size (see its docstring for how the probe works).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pita.runtime.batch_size.cache import BatchSizeCache, library_versions
from pita.runtime.batch_size.search import (
    AUTO_VALUES,
    DEFAULT_CAP,
    DEFAULT_SAFETY_MARGIN,
    Measure,
    MemoryEstimate,
    _gib,
    is_auto,
    search_batch_size,
)

_log = logging.getLogger("pita.runtime.batch_size")


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
