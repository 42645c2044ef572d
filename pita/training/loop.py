"""The parts of a readable hand-written training loop.

A stage keeps its loop in plain view and hands the mechanics of one optimizer step to
`TrainStep`:

    micro, n_micro = accumulation_plan(batch, micro_batch_size, accumulation_steps, batch_scale)
    step = TrainStep(model, optim, precision, scheduler=sched)
    for _ in range(steps):
        batch = next_batch()
        step.run(split_batch(batch, micro), lambda mb: model(**mb).loss, samples=len(batch))

`TrainStep(sync_every=N)` keeps the GPU busy: the step's loss, extras and gradient norm stay
on the device and are read back in one transfer every N steps (`flush()`, also done by
`metrics_rows()` and the report), so the host never waits for the device inside the loop;
step times are then the mean over each window. `sync_every=1` (the default) reads every
step back, as before.

`TrainStep.run` does, per optimizer step: autocast (bf16 / fp16 per `Precision`), the
backward of each micro-batch's weighted loss (scaled by a GradScaler for fp16; DDP's
gradient all-reduce only on the last micro-batch), unscale + gradient clipping,
optimizer and scheduler step, `system.clear_cache_interval`, and the step's time,
samples, tokens and peak memory in `TrainingMetrics` (what `report.py` writes).

Gradient accumulation is exact: a micro-batch's mean loss is weighted by its share of the
batch (`token_weights` for token-mean losses), so the summed gradients equal those of the
whole batch at once. `accumulation_plan` keeps the effective batch when an OOM retry halves
the micro-batch (the task's `batch_scale`).

Also here: `compile_model` (torch.compile in place, eager fallback with the reason),
`enable_gradient_checkpointing`, `dataloader_kwargs`, `clear_cache`. Written by hand:
TRL / accelerate do these inside their Trainer, which the hand-written stages do not use.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pita.training.precision import Precision

log = logging.getLogger(__name__)


# --- batch arithmetic ----------------------------------------------------------------------


def accumulation_plan(
    batch_size: int, micro_batch_size: int, accumulation_steps: int = 0, batch_scale: float = 1.0
) -> tuple[int, int]:
    """(micro-batch, accumulation steps) with micro × steps == batch_size exactly.

    `accumulation_steps > 0` fixes the number of steps (micro = batch / steps); otherwise
    the micro-batch is `micro_batch_size × batch_scale` (the scale is halved on each OOM
    retry). The micro-batch is then lowered to the largest divisor of the batch, so the
    effective batch never changes.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: must be >= 1")
    if accumulation_steps > 0:
        micro = math.ceil(batch_size / accumulation_steps)
    else:
        micro = int(micro_batch_size * batch_scale)
    micro = max(1, min(micro, batch_size))
    while batch_size % micro:  # the largest micro-batch that divides the effective batch
        micro -= 1
    return micro, batch_size // micro


def micro_batch_plan(
    batch_size: int, training: Any, batch_scale: float = 1.0, *, whole_batch: bool
) -> tuple[int, int]:
    """THE micro-batch rule of every training stage (pretrain, value training, TRL stages).

    `training.accumulation_steps > 0` fixes the number of steps. Otherwise a stage whose
    model is built in the run (`whole_batch`: the tiny models, where a small micro-batch
    only slows a CPU down — a GRPO step 7x at micro 4) takes the whole batch at once and a
    hub model takes `training.micro_batch_size`; either is scaled by `batch_scale`, which
    each OOM retry halves. The effective batch never changes (`accumulation_plan`).
    """
    requested = batch_size if whole_batch else int(training.micro_batch_size)
    return accumulation_plan(batch_size, requested, int(training.accumulation_steps), batch_scale)


def split_batch(batch: Any, micro: int) -> list[Any]:
    """Cut a batch (a tensor, a dict / tuple of tensors, or a list) into micro-batches."""
    if isinstance(batch, torch.Tensor):
        return list(batch.split(micro))
    if isinstance(batch, dict):
        by_key = {k: split_batch(v, micro) for k, v in batch.items()}
        n = len(next(iter(by_key.values())))
        return [{k: v[i] for k, v in by_key.items()} for i in range(n)]
    if isinstance(batch, tuple):
        parts = [split_batch(v, micro) for v in batch]
        return [tuple(p[i] for p in parts) for i in range(len(parts[0]))]
    return [batch[i : i + micro] for i in range(0, len(batch), micro)]


def token_weights(
    counts: Sequence[int], total: int | None = None, world_size: int = 1
) -> list[float]:
    """Weights of micro-batch losses that are means over `counts[i]` tokens, so their sum is
    the mean over the whole batch (`total` tokens; over all ranks when data parallel: DDP
    averages the ranks' gradients, hence the factor `world_size`)."""
    total = sum(counts) if total is None else total
    return [c * world_size / total for c in counts]


# --- model preparation -----------------------------------------------------------------------


@dataclass
class CompileStatus:
    requested: bool
    compiled: bool = False
    mode: str = "default"
    reason: str = ""
    verified: bool = False  # a forward + backward ran compiled
    module: Any = field(default=None, repr=False)

    def __str__(self) -> str:
        if not self.requested:
            return "off (eager)"
        if self.compiled:
            return f"compiled (mode={self.mode}{'' if self.verified else ', not yet verified'})"
        return f"eager fallback ({self.reason})"

    def fall_back(self, exc: BaseException, logger: logging.Logger | None = None) -> None:
        """Undo `compile_model`: the module runs eagerly again; the reason is kept."""
        if self.module is not None:
            self.module._compiled_call_impl = None  # what nn.Module.compile sets
        with contextlib.suppress(Exception):
            torch._dynamo.reset()
        self.compiled, self.reason = False, _one_line(exc)
        (logger or log).warning("torch.compile failed, training eagerly: %s", self.reason)


def _one_line(exc: BaseException) -> str:
    """`Type: first line`, plus the root cause (a backend's own error hides under
    BackendCompilerFailed's `__cause__`)."""

    def line(e: BaseException) -> str:
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
        return f"{type(e).__name__}: {first[:200]}".rstrip(": ")

    root: BaseException = exc
    seen = {id(exc)}
    while (nxt := getattr(root, "inner_exception", None) or root.__cause__) is not None:
        if id(nxt) in seen:
            break
        root = nxt
        seen.add(id(root))
    return line(exc) if root is exc else f"{line(exc)} <- {line(root)}"


def _compile_error(exc: BaseException) -> bool:
    """An exception raised by dynamo / inductor / a compile backend (not by the model)."""
    names = [type(exc).__module__] + [
        type(e).__module__ for e in (exc.__cause__, exc.__context__) if e
    ]
    return any(n.startswith(("torch._dynamo", "torch._inductor", "torch.fx")) for n in names)


def compile_model(
    model: torch.nn.Module,
    enabled: bool,
    mode: str = "default",
    *,
    example: Any = None,
    backend: Any = "inductor",
    logger: logging.Logger | None = None,
) -> CompileStatus:
    """`torch.compile` the model in place (`nn.Module.compile`: the same object, so its
    state_dict and `save_pretrained` are unchanged).

    With `example` (a dict of forward kwargs, or a tuple of args) a forward + backward is
    run now and any compile failure falls back to eager with the reason; without it the
    first `TrainStep.run` does the same. Gradients are cleared after the probe.
    """
    logger = logger or log
    status = CompileStatus(requested=bool(enabled), mode=mode)
    if not enabled:
        return status
    if not hasattr(torch, "compile") or not hasattr(model, "compile"):
        status.reason = f"torch {torch.__version__} has no torch.compile"
        logger.warning("training.compile=true ignored: %s", status.reason)
        return status
    kwargs = {"backend": backend}
    if backend == "inductor" and mode != "default":
        kwargs["mode"] = mode
    try:
        model.compile(**kwargs)
    except Exception as exc:  # noqa: BLE001 - e.g. an unsupported Python version
        status.module = model
        status.fall_back(exc, logger)
        return status
    status.compiled, status.module = True, model
    if example is not None:
        try:
            with torch.random.fork_rng(devices=[]):  # the probe must not shift the RNG stream
                out = model(**example) if isinstance(example, dict) else model(*example)
                _probe_loss(out).backward()
            status.verified = True
        except Exception as exc:  # noqa: BLE001 - any compile failure means eager
            status.fall_back(exc, logger)
        finally:
            model.zero_grad(set_to_none=True)
    if status.compiled:
        logger.info("torch.compile: %s", status)
    return status


def _probe_loss(out: Any) -> torch.Tensor:
    if getattr(out, "loss", None) is not None:
        return out.loss
    if isinstance(out, torch.Tensor):
        return out.float().mean()
    first = (
        out[0]
        if isinstance(out, (tuple, list))
        else next(v for v in out.values() if isinstance(v, torch.Tensor))
    )
    return first.float().mean()


def enable_gradient_checkpointing(
    model: torch.nn.Module, enabled: bool, logger: logging.Logger | None = None
) -> bool:
    """Recompute activations in backward (transformers' `activation_checkpointing_enable`,
    `gradient_checkpointing_enable` before 5.x) when asked and supported; True if enabled."""
    if not enabled:
        return False
    if not (
        getattr(model, "supports_gradient_checkpointing", False)
        and hasattr(model, "gradient_checkpointing_enable")
    ):
        (logger or log).warning(
            "training.gradient_checkpointing=true ignored: %s does not support it",
            type(model).__name__,
        )
        return False
    if hasattr(model, "activation_checkpointing_enable"):  # the name since transformers 5
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}
        )
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if getattr(model, "config", None) is not None:
        model.config.use_cache = False  # a KV cache is useless in training and conflicts with it
    (logger or log).info("gradient checkpointing on (activations recomputed in backward)")
    return True


def dataloader_kwargs(
    num_workers: int, pin_memory: bool, device: str | torch.device
) -> dict[str, Any]:
    """DataLoader kwargs (the TRL stages' `dataloader_*` fields, pita/algos/trl_common.py):
    `num_workers=-1` = auto = this worker's thread budget - 1, at most 4 (on a GPU host the
    pool's budget, `PITA_DATALOADER_WORKERS`; elsewhere the cores this process may use - 1);
    pinned memory only when the batches go to a CUDA device (pinning for the CPU only costs)."""
    if num_workers < 0:
        budget = os.environ.get("PITA_DATALOADER_WORKERS", "")
        if budget.isdigit():
            num_workers = min(4, int(budget))
        else:
            cores = (
                len(os.sched_getaffinity(0))
                if hasattr(os, "sched_getaffinity")
                else (os.cpu_count() or 1)
            )
            num_workers = max(0, min(4, cores - 1))
    cuda = torch.device(device).type == "cuda"
    kwargs: dict[str, Any] = {"num_workers": num_workers, "pin_memory": bool(pin_memory and cuda)}
    if num_workers > 0:
        kwargs["persistent_workers"] = True
    return kwargs


def clear_cache(device: str | torch.device) -> None:
    """Release the CUDA allocator's cached blocks; nothing off CUDA (no CUDA call at all)."""
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()


# --- metrics ---------------------------------------------------------------------------------


_PERF_KEYS = ("step_time_s", "samples", "tokens")


class TrainingMetrics:
    """Per optimizer step: loss, extras (accuracy...), time, samples, tokens, lr, grad norm;
    plus the task's peak memory (CUDA allocator peak, or the largest sampled process RSS)."""

    def __init__(self, device: str | torch.device = "cpu", tracker: Any = None):
        self.device = torch.device(device)
        self.rows: list[dict[str, float]] = []
        self._peak_rss = 0
        self.tracker = (
            tracker  # pita.training.tracking.Tracker: every row goes to logger.backend too
        )
        self.start()

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_available()

    def start(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        self._sample_rss()

    def _sample_rss(self) -> None:
        try:
            import psutil

            self._peak_rss = max(self._peak_rss, psutil.Process().memory_info().rss)
        except Exception:  # noqa: BLE001 - psutil missing: no RSS figure
            pass

    def record(self, **row: float | None) -> None:
        self.rows.append({k: float(v) for k, v in row.items() if v is not None})
        if not self.cuda:
            self._sample_rss()
        if self.tracker is not None and "step" in self.rows[-1]:
            last = self.rows[-1]
            self.tracker.log(
                {
                    (f"perf/{k}" if k in _PERF_KEYS else f"train/{k}"): v
                    for k, v in last.items()
                    if k != "step"
                },
                int(last["step"]),
            )

    def close_tracker(self) -> None:
        """Flush and close the tracker (the training report calls it once training ends)."""
        if self.tracker is not None:
            self.tracker.close()

    def series(self, key: str) -> tuple[list[float], list[float]]:
        """(steps, values) of one recorded quantity."""
        pts = [(r["step"], r[key]) for r in self.rows if key in r]
        return [p[0] for p in pts], [p[1] for p in pts]

    def peak_memory(self) -> tuple[int, str]:
        """(bytes, what) — CUDA allocator peak on CUDA, peak sampled process RSS elsewhere."""
        if self.cuda:
            return int(torch.cuda.max_memory_allocated(self.device)), "CUDA peak allocated"
        self._sample_rss()
        return self._peak_rss, "process RSS peak"

    def summary(self) -> dict[str, Any]:
        """Throughput over the steps after the first (compilation and warm-up are excluded
        when there is more than one step)."""
        rows = self.rows[1:] if len(self.rows) > 1 else self.rows
        seconds = sum(r.get("step_time_s", 0.0) for r in rows)
        samples = sum(r.get("samples", 0.0) for r in rows)
        tokens = sum(r.get("tokens", 0.0) for r in rows)
        peak, what = self.peak_memory()
        return {
            "steps": len(self.rows),
            "train_time_s": round(sum(r.get("step_time_s", 0.0) for r in self.rows), 3),
            "mean_step_time_s": round(seconds / len(rows), 5) if rows else None,
            "samples_per_s": round(samples / seconds, 2) if seconds > 0 and samples else None,
            "tokens_per_s": round(tokens / seconds, 2) if seconds > 0 and tokens else None,
            "peak_memory_mb": round(peak / 2**20, 1) if peak else None,
            "peak_memory_kind": what,
            "throughput_excludes_first_step": len(self.rows) > 1,
        }


# --- one optimizer step ----------------------------------------------------------------------


@dataclass
class StepResult:
    step: int
    loss: float
    grad_norm: float | None
    step_time_s: float
    skipped: bool  # fp16: the GradScaler found inf/nan gradients and skipped the update
    extras: dict[str, float]


class TrainStep:
    """One optimizer step over a list of micro-batches (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        precision: Precision,
        *,
        scheduler: Any = None,
        max_grad_norm: float = 0.0,
        clear_cache_interval: int = 0,
        device: str | torch.device = "cpu",
        compile_status: CompileStatus | None = None,
        metrics: TrainingMetrics | None = None,
        logger: logging.Logger | None = None,
        sync_every: int = 1,
        tracker: Any = None,
    ):
        self.model, self.optimizer, self.precision, self.scheduler = (
            model,
            optimizer,
            precision,
            scheduler,
        )
        self.sync_every = max(1, int(sync_every))
        self._pending: list[tuple] = []  # steps not read back yet (sync_every > 1)
        self._window_t0: float | None = None
        self.max_grad_norm = float(max_grad_norm)
        self.clear_cache_interval = int(clear_cache_interval)
        self.device = torch.device(device)
        self.compile_status = compile_status
        self.metrics = metrics or TrainingMetrics(device, tracker=tracker)
        self.logger = logger or log
        self.scaler = precision.grad_scaler()
        self.step = 0

    # -- the pieces, for loops that need them one by one --------------------------------------
    def autocast(self) -> contextlib.AbstractContextManager:
        return self.precision.autocast()

    def backward(self, loss: torch.Tensor, weight: float = 1.0) -> None:
        """Backward of `weight × loss` (loss scaled by the GradScaler for fp16)."""
        self.scaler.scale(loss.float() * weight).backward()

    def optimizer_step(self) -> tuple[float | None, bool]:
        """Unscale, clip, step, update the scale, zero the gradients, advance the schedule,
        clear the CUDA cache every `clear_cache_interval` steps. -> (grad norm, skipped)."""
        grad_norm = None
        if self.max_grad_norm > 0:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
            norm = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
            if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor over the shards, reduced here
                norm = norm.full_tensor()
            grad_norm = (
                norm.detach() if self.sync_every > 1 else float(norm)
            )  # no host sync when lazy
        scale = self.scaler.get_scale() if self.scaler.is_enabled() else None
        self.scaler.step(self.optimizer)
        self.scaler.update()
        skipped = scale is not None and self.scaler.get_scale() < scale  # inf/nan: no update made
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None and not skipped:
            self.scheduler.step()
        self.step += 1
        if self.clear_cache_interval > 0 and self.step % self.clear_cache_interval == 0:
            clear_cache(self.device)
        return grad_norm, skipped

    def lr(self) -> float:
        if self.scheduler is not None:
            return float(self.scheduler.get_last_lr()[0])
        return float(self.optimizer.param_groups[0]["lr"])

    # -- the whole step ---------------------------------------------------------------------------
    def run(
        self,
        micro_batches: Sequence[Any],
        loss_fn: Callable[[Any], Any],
        *,
        weights: Sequence[float] | None = None,
        samples: int | None = None,
        tokens: int | None = None,
    ) -> StepResult:
        """Accumulate the gradients of every micro-batch, then take one optimizer step.

        `loss_fn(micro_batch)` returns the micro-batch's mean loss, or (loss, {"accuracy": ..})
        whose extras are averaged with the same weights. `weights` default to equal shares
        (right for equal-sized micro-batches of a per-example mean loss).
        """
        if not micro_batches:
            raise ValueError("TrainStep.run: no micro-batches")
        t0 = time.perf_counter()
        if self._window_t0 is None:
            self._window_t0 = t0
        try:
            loss, extras = self._accumulate(micro_batches, loss_fn, weights)
        except Exception as exc:
            cs = self.compile_status
            if cs is None or not cs.compiled or cs.verified or not _compile_error(exc):
                raise
            cs.fall_back(exc, self.logger)  # a compile failure on the first step: redo it eagerly
            self.optimizer.zero_grad(set_to_none=True)
            loss, extras = self._accumulate(micro_batches, loss_fn, weights)
        if self.compile_status is not None and self.compile_status.compiled:
            self.compile_status.verified = True
        grad_norm, skipped = self.optimizer_step()
        loss, extras = _mean_over_ranks(loss, extras)
        if self.sync_every > 1:  # read back later, in one transfer for the whole window
            self._pending.append(
                (self.step, loss.detach(), grad_norm, extras, samples, tokens, self.lr())
            )
            if len(self._pending) >= self.sync_every:
                self.flush()
            return StepResult(self.step, float("nan"), None, 0.0, skipped, {})
        self._window_t0 = None
        loss_value = float(loss)  # .item() waits for the device: the step time below is real
        extras = {k: float(v) for k, v in extras.items()}
        dt = time.perf_counter() - t0
        self.metrics.record(
            step=self.step,
            loss=loss_value,
            step_time_s=dt,
            samples=samples,
            tokens=tokens,
            lr=self.lr(),
            grad_norm=grad_norm,
            **extras,
        )
        return StepResult(self.step, loss_value, grad_norm, dt, skipped, extras)

    def flush(self) -> None:
        """Read back the pending steps' figures (one device->host transfer) into the metrics."""
        if not self._pending:
            return
        scalars: list[Any] = []
        for _, loss, grad_norm, extras, *_ in self._pending:
            scalars.append(loss.float().reshape(()))
            for v in (grad_norm, *extras.values()):
                if isinstance(v, torch.Tensor):
                    scalars.append(v.detach().float().reshape(()).to(loss.device))
        values = iter(torch.stack(scalars).tolist())  # the one sync of the window
        dt = (time.perf_counter() - (self._window_t0 or time.perf_counter())) / len(self._pending)
        for step, _loss, grad_norm, extras, samples, tokens, lr in self._pending:
            loss_value = next(values)
            gn = next(values) if isinstance(grad_norm, torch.Tensor) else grad_norm
            ex = {
                k: (next(values) if isinstance(v, torch.Tensor) else float(v))
                for k, v in extras.items()
            }
            self.metrics.record(
                step=step,
                loss=loss_value,
                step_time_s=dt,
                samples=samples,
                tokens=tokens,
                lr=lr,
                grad_norm=gn,
                **ex,
            )
        self._pending.clear()
        self._window_t0 = None

    def metrics_rows(self) -> list[dict[str, float]]:
        """Every recorded step (pending ones read back first)."""
        self.flush()
        return self.metrics.rows

    def _accumulate(
        self,
        micro_batches: Sequence[Any],
        loss_fn: Callable[[Any], Any],
        weights: Sequence[float] | None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        n = len(micro_batches)
        weights = list(weights) if weights is not None else [1.0 / n] * n
        if len(weights) != n:
            raise ValueError(f"TrainStep.run: {len(weights)} weights for {n} micro-batches")
        total = torch.zeros((), device=self.device)
        extras: dict[str, Any] = {}  # floats, or device tensors (summed without a host sync)
        for i, (mb, w) in enumerate(zip(micro_batches, weights)):
            # DDP: all-reduce the gradients once, after the last micro-batch.
            last = i == n - 1
            sync = (
                self.model.no_sync()
                if hasattr(self.model, "no_sync") and not last
                else contextlib.nullcontext()
            )
            with sync:
                with self.autocast():
                    out = loss_fn(mb)
                loss, stats = out if isinstance(out, tuple) else (out, {})
                self.backward(loss, w)
            total += loss.detach().float() * w
            for k, v in stats.items():
                v = v.detach().float() if isinstance(v, torch.Tensor) else float(v)
                extras[k] = extras.get(k, 0.0) + v * w
        return total, extras


def is_main_rank() -> bool:
    """Not data parallel, or rank 0 of the process group (the rank that logs and writes)."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _mean_over_ranks(
    loss: torch.Tensor, extras: dict[str, float]
) -> tuple[torch.Tensor, dict[str, float]]:
    """Data parallel: the logged loss / extras are the whole batch's (mean over ranks of the
    ranks' weighted sums), not rank 0's share. One tiny all-reduce per step."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return loss, extras
    keys = sorted(extras)
    packed = torch.stack(
        [
            loss.detach().float(),
            *(
                torch.as_tensor(extras[k], dtype=torch.float32, device=loss.device).reshape(())
                for k in keys
            ),
        ]
    )
    dist.all_reduce(packed)
    packed /= dist.get_world_size()
    return packed[0], {k: float(v) for k, v in zip(keys, packed[1:].tolist())}
