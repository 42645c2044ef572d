"""Which precision a training task runs in, and on which device.

`choose_precision` turns `training.mixed_precision` / `training.precision_type` and the
task's device into a `Precision`: master weights always stay fp32; on CUDA the forward and
backward run under `torch.autocast` in bf16 (compute capability >= 8.0: Ampere and newer)
or fp16 (older GPUs, with a `GradScaler` so small gradients do not underflow to zero). On
the CPU everything is fp32: CPU autocast is slow for these models and TRL's bf16 default
would turn it on, so an explicit fp16 / bf16 request is dropped there with a logged reason.

`trl_precision_kwargs` gives the same decision as TRL/transformers `bf16=` / `fp16=` flags.
`training_device` says what `system.gpu_mode` (auto | cpu | single_gpu | multi_gpu) means
for a task: which device it trains on and how many of its gang's GPUs it may use.

Hand-written because the choice depends on our config keys; the mechanics (autocast,
GradScaler) are torch's own.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from pita.core.schema import GPU_MODES, PRECISION_TYPES  # noqa: F401 (owned by the schema)

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Precision:
    """How a training step computes. Master weights and the optimizer state stay fp32."""

    name: str  # "bf16" | "fp16" | "fp32"
    dtype: torch.dtype  # the dtype forward/backward compute in
    autocast_dtype: torch.dtype | None  # what torch.autocast gets; None = no autocast
    use_grad_scaler: bool  # fp16 only: scale the loss so small gradients survive
    device_type: str = "cpu"  # "cuda" | "cpu"
    reason: str = ""  # why this choice, one line for the task log

    def autocast(self) -> contextlib.AbstractContextManager:
        """The autocast context of the forward pass (a no-op for fp32)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.autocast_dtype)

    def grad_scaler(self) -> torch.amp.GradScaler:
        """A GradScaler, enabled only for fp16 (disabled, it passes everything through)."""
        return torch.amp.GradScaler(self.device_type, enabled=self.use_grad_scaler)

    def trl_kwargs(self) -> dict[str, bool]:
        return {"bf16": self.name == "bf16", "fp16": self.name == "fp16"}


def _is_cuda(device: str | torch.device) -> bool:
    return torch.device(device).type == "cuda"


def _capability(device: str | torch.device, compute_capability: Any) -> float | None:
    """Compute capability as a float (8.0, 9.0, 7.5), from the argument or the device."""
    if compute_capability is not None:
        if isinstance(compute_capability, (tuple, list)):
            major, minor = compute_capability
            return float(major) + float(minor) / 10
        return float(compute_capability)
    if torch.cuda.is_available():  # guarded: a CPU build never touches CUDA
        major, minor = torch.cuda.get_device_capability(torch.device(device))
        return major + minor / 10
    return None


def choose_precision(
    precision_type: str = "auto",
    mixed_precision: bool = True,
    device: str | torch.device = "cpu",
    compute_capability: Any = None,
    logger: logging.Logger | None = None,
) -> Precision:
    """The precision of a training task.

    auto: bf16 on compute capability >= 8.0, fp16 + GradScaler below, fp32 on the CPU.
    fp16 / bf16: honoured on CUDA (bf16 below 8.0 becomes fp16: no bf16 tensor cores);
    forced to fp32 on the CPU with a logged reason. fp32 or `mixed_precision=False`: fp32.
    `compute_capability` ((8, 0), 8.0 or "8.0") simulates a GPU; None asks the device.
    """
    if precision_type not in PRECISION_TYPES:
        raise ValueError(
            f"training.precision_type={precision_type!r}: allowed: {' | '.join(PRECISION_TYPES)}"
        )
    log = logger or logging.getLogger(__name__)
    cuda = _is_cuda(device)
    cc = _capability(device, compute_capability) if cuda else None

    def fp32(reason: str, warn: bool = False) -> Precision:
        (log.warning if warn else log.info)("precision: fp32 (%s)", reason)
        return Precision("fp32", torch.float32, None, False, "cuda" if cuda else "cpu", reason)

    if not cuda or cc is None:
        where = "cpu" if not cuda else "cuda requested but CUDA is not available"
        if mixed_precision and precision_type in ("fp16", "bf16"):
            return fp32(
                f"training.precision_type={precision_type} ignored on {where}: "
                "mixed precision runs on CUDA only",
                warn=True,
            )
        return fp32(f"no mixed precision on {where}")
    if not mixed_precision:
        return fp32("training.mixed_precision=false")
    if precision_type == "fp32":
        return fp32("training.precision_type=fp32")

    name, reason = (
        precision_type,
        f"training.precision_type={precision_type} on compute capability {cc:.1f}",
    )
    if precision_type == "auto":
        name = "bf16" if cc >= 8.0 else "fp16"
        reason = f"auto on compute capability {cc:.1f}: " + (
            "bf16 (Ampere or newer)"
            if name == "bf16"
            else "fp16 with a GradScaler (no bf16 below 8.0)"
        )
    elif precision_type == "bf16" and cc < 8.0:
        name = "fp16"
        reason = f"training.precision_type=bf16 needs compute capability >= 8.0 (this GPU: {cc:.1f}); fp16 with a GradScaler"
        log.warning("precision: %s", reason)
    p = Precision(name, _DTYPES[name], _DTYPES[name], name == "fp16", "cuda", reason)
    log.info("precision: %s (%s)", p.name, p.reason)
    return p


def training_precision(
    training_cfg: Any,
    device: str | torch.device,
    compute_capability: Any = None,
    logger: logging.Logger | None = None,
) -> Precision:
    """`choose_precision` from a task's `training.*` settings (`precision_type`,
    `mixed_precision`), logged to `logger` (the task log)."""
    return choose_precision(
        str(training_cfg.precision_type),
        bool(training_cfg.mixed_precision),
        device,
        compute_capability,
        logger=logger,
    )


def trl_precision_kwargs(
    training_cfg: Any,
    device: str | torch.device,
    compute_capability: Any = None,
    logger: logging.Logger | None = None,
) -> dict[str, bool]:
    """`{"bf16": .., "fp16": ..}` for a TRL / transformers TrainingArguments.

    Always pass both explicitly: TRL's configs default to bf16=True, which must be False on
    the CPU (and on GPUs older than compute capability 8.0).
    """
    return training_precision(training_cfg, device, compute_capability, logger).trl_kwargs()


class DeviceChoice(NamedTuple):
    device: str  # "cpu", or "cuda:<i>" (the given GPU, else the first of the task's pinned GPUs)
    n_devices: int  # how many of the task's GPUs it may use (data parallel ranks / shards)
    reason: str


def training_device(
    gpu_mode: str, device: str | torch.device = "cpu", cuda_count: int | None = None
) -> DeviceChoice:
    """What `system.gpu_mode` means for a task whose worker runs on `device` (the stage's device).

    cpu: the CPU even on a GPU worker. single_gpu: the first pinned GPU only. multi_gpu and
    auto: every GPU of the task's gang. Without a usable GPU, every mode trains on the CPU
    (with the reason, so the task log says why). `cuda_count` simulates the visible GPUs.
    """
    if gpu_mode not in GPU_MODES:
        raise ValueError(f"system.gpu_mode={gpu_mode!r}: allowed: {' | '.join(GPU_MODES)}")
    if gpu_mode == "cpu":
        return DeviceChoice("cpu", 1, "system.gpu_mode=cpu")
    if cuda_count is None:
        cuda_count = (
            torch.cuda.device_count() if _is_cuda(device) and torch.cuda.is_available() else 0
        )
    if not _is_cuda(device) or cuda_count == 0:
        return DeviceChoice(
            "cpu", 1, f"system.gpu_mode={gpu_mode} but this task has no CUDA device; cpu"
        )
    index = torch.device(device).index  # a DDP rank's own GPU stays its own
    first = f"cuda:{index if index is not None else 0}"
    if gpu_mode == "single_gpu":
        note = f" (1 of the {cuda_count} pinned GPUs)" if cuda_count > 1 else ""
        return DeviceChoice(first, 1, f"system.gpu_mode=single_gpu{note}")
    note = (
        " (only one GPU pinned to this task)" if gpu_mode == "multi_gpu" and cuda_count == 1 else ""
    )
    return DeviceChoice(first, cuda_count, f"system.gpu_mode={gpu_mode}: {cuda_count} GPU(s){note}")
