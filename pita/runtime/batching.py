"""Batch sizes of stages: an int as configured, or `auto` through the probe.

An int is scaled by the task's `batch_scale` (halved after each OOM retry, the effective
batch being kept by the caller through accumulation). `auto` / `auto_batch_size` runs
`pita.runtime.batch_size` in the worker on the stage's worst case (longest prompt, full
`max_new_tokens`) with results cached across runs; on CPU it logs that there is nothing
to measure and uses the fallback.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pita.core.paths import pita_cache_dir
from pita.runtime.context import StageContext


def cache_path() -> Path:
    return pita_cache_dir() / "batch_sizes.json"


def generation_batch_size(
    ctx: StageContext,
    value: Any,
    *,
    model=None,
    prompts: list[list[int]] | None = None,
    max_new_tokens: int = 0,
    fallback: int = 64,
    extra_models=(),
) -> int:
    """Prompts per generate() call for `value` (int or auto); `extra_models` are the other
    models the stage holds on the same device (a guide), counted as resident."""
    if isinstance(value, int):
        return max(1, int(value * ctx.task.batch_scale))
    from pita.runtime.batch_size import generation_probe, resolve_batch_size

    factory = None
    if model is not None and prompts:
        longest = max(prompts, key=len)
        factory = generation_probe(
            model,
            longest,
            max_new_tokens,
            {"do_sample": True},
            extra_models=list(extra_models),
            logger=ctx.logger,
        )
    size = resolve_batch_size(
        value,
        stage_kind="generate",
        fallback=fallback,
        measure_fn_factory=factory,
        cache_path=cache_path(),
        cache_key={"stage": ctx.task.stage},
        safety_margin=ctx.batch_size_safety_margin,
        cap=max(1, len(prompts) if prompts else 4096),
        logger=ctx.logger,
    )
    return max(1, int(size * ctx.task.batch_scale))


def training_micro_batch(
    *,
    model: Any,
    batch: int,
    seq_tokens: int,
    make_batch: Callable[[int], Any],
    loss_fn: Callable[[Any, Any], Any],
    fallback: int,
    cache_key: dict[str, Any],
    safety_margin: float,
    batch_scale: float = 1.0,
    logger: logging.Logger | None = None,
) -> int:
    """Micro-batch of a training stage whose `algos.<NAME>.batch_size` is auto.

    The effective batch is an algorithm setting; memory limits the micro-batch, so the
    probe measures >= 2 optimizer steps (forward, backward, AdamW state) at candidate
    micro-batches on the worst-case sequence length. Call it before the real optimizer
    exists. On CPU: the fallback, logged. Values, not a context: `cache_key` names the
    stage in the batch-size cache, `safety_margin` is `batch_size_safety_margin`,
    `batch_scale` the task's (< 1 after an OOM retry).
    """
    from pita.runtime.batch_size import resolve_batch_size, training_probe

    factory = training_probe(
        model, make_batch=make_batch, seq_tokens=seq_tokens, loss_fn=loss_fn, logger=logger
    )
    size = resolve_batch_size(
        "auto",
        stage_kind="train",
        fallback=fallback,
        measure_fn_factory=factory,
        cache_path=cache_path(),
        cache_key=cache_key,
        safety_margin=safety_margin,
        cap=batch,
        logger=logger,
    )
    return max(1, min(batch, int(size * batch_scale)))
