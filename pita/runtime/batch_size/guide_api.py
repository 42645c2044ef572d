"""The batch-size guide's API (docs/guides/auto_batch_size.txt: `find_optimal_batch_size_for_llm`, `measure_memory_usage`,
`BatchSizeFinder`) on top of the search and the probes.

Part of pita.runtime.batch_size (see its docstring for how the probe works).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pita.runtime.batch_size.probes import (
    _cuda_available,
    _cuda_devices,
    _empty_cache,
    generation_probe,
    generation_workload,
    training_probe,
)
from pita.runtime.batch_size.resolve import ProbeSetup, _check_margin, resolve_batch_size
from pita.runtime.batch_size.search import (
    DEFAULT_CAP,
    DEFAULT_REDUCTION,
    DEFAULT_SAFETY_MARGIN,
    Measure,
    MemoryEstimate,
    SearchResult,
    search_batch_size,
)

_log = logging.getLogger("pita.runtime.batch_size")


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
