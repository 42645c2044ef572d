"""CUDA probes: measure the peak memory of a real model's generation or training step at
a given batch size (torch imported inside).

Part of pita.runtime.batch_size (see its docstring for how the probe works).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pita.runtime.batch_size.resolve import ProbeSetup
from pita.runtime.batch_size.search import (
    Measure,
    MemoryEstimate,
    _checkpointing,
    _gib,
    estimate_from_model,
)
from pita.runtime.oom import classify_exception

_log = logging.getLogger("pita.runtime.batch_size")


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
