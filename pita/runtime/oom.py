"""Classify a worker's failure (out of memory, CUDA fault, ordinary error).

The executor retries by class (docs/DESIGN.md §3): ``oom`` → the same task with a smaller micro
batch, the effective batch kept through gradient accumulation; ``cuda_fault`` → recycle the
worker (the CUDA context may be poisoned) and retry; ``error`` → fail that task fast.

Written by hand because no library classifies both kinds: accelerate's
``should_reduce_batch_size`` knows out-of-memory messages but not sticky CUDA faults, and it
only looks at ``RuntimeError``s with one argument. This module imports only the standard
library; torch's exception types are looked up in ``sys.modules``, so an exception can only
be a torch type if torch was already imported by whoever raised it.
"""

from __future__ import annotations

import re
import sys
from typing import Literal, cast

# What an exception raised by a stage can be: a subset of pita.core.errors.FailureClass.
StageFailure = Literal["oom", "cuda_fault", "killed", "stalled", "error"]
# An exception may carry its class (`failure_class`): a gang's rank that died of a signal
# (pita.training.ddp.RankDied: "killed") or stopped stepping (GangStalled: "stalled").
_OWN_CLASSES = ("killed", "stalled")

# Sticky or hardware faults: after one of these the CUDA context is unusable (or suspect), so
# the worker process must be replaced. Checked first: "CUDA kernel errors might be
# asynchronously reported" follows both kinds of message and decides nothing.
_FAULT_PATTERNS = (
    r"illegal memory access",
    r"device-side assert triggered",
    r"unspecified launch failure",
    r"misaligned address",
    r"illegal instruction",
    r"launch timed out",
    r"uncorrectable ECC error",
    r"CUBLAS_STATUS_EXECUTION_FAILED",
    r"CUBLAS_STATUS_INTERNAL_ERROR",
    r"CUDNN_STATUS_EXECUTION_FAILED",
    r"CUDNN_STATUS_INTERNAL_ERROR",
    r"CUDNN_STATUS_MAPPING_ERROR",
    r"cudaErrorIllegalAddress",
    r"cudaErrorLaunchFailure",
    r"unhandled cuda error",  # NCCL wraps a failed CUDA call this way
    r"GPU is lost",
)
_FAULT = re.compile("|".join(_FAULT_PATTERNS))

# Allocation failures: a smaller batch (or an emptied cache) fixes them. The cuBLAS / cuDNN /
# cuFFT / cuSOLVER / cuSPARSE handles allocate workspaces outside the caching allocator and
# report failure with their own status codes instead of torch.OutOfMemoryError.
_OOM_PATTERNS = (
    r"\bout of memory\b",  # CUDA / HIP / XPU / MPS, and "CUDA error: out of memory"
    r"CU[A-Z]+_STATUS_ALLOC_FAILED",  # CUBLAS_, CUDNN_, CUSOLVER_, CUSPARSE_
    r"CUFFT_ALLOC_FAILED",
    r"CUDNN_STATUS_NOT_ENOUGH_MEMORY",
    r"cudaErrorMemoryAllocation",
    r"DefaultCPUAllocator: can't allocate memory",
    r"PT_DEVMEM Allocation failed",
    # accelerate counts this as "reduce the batch": cuDNN refuses very large batches.
    r"CUDNN_STATUS_NOT_SUPPORTED\.",
)
_OOM = re.compile("|".join(_OOM_PATTERNS))

# The advice torch appends to every CUDA error, OOM included ("... to enable device-side
# assertions"): removed before matching so it cannot make an OOM look like a fault.
_BOILERPLATE = re.compile(
    r"CUDA kernel errors might be asynchronously reported[^\n]*"
    r"|For debugging consider passing CUDA_LAUNCH_BLOCKING=1[^\n]*"
    r"|Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions\.?"
    r"|Search for `cudaError\w*' in https://[^\n]*"
)

# Any other CUDA runtime/driver failure: treat as a fault (recycle and retry, bounded by
# executor.max_retries) rather than as a bug in our code.
_CUDA_OTHER = re.compile(r"CUDA error:|CUDA driver error|CUDA error \d+|cudaError\w+")


def _torch_type(name: str) -> type | None:
    torch = sys.modules.get("torch")
    t = getattr(torch, name, None) if torch is not None else None
    return t if isinstance(t, type) else None


def _inspect_text(exc: BaseException) -> bool:
    """Only runtime-ish exceptions are classified by message: a ValueError that happens to
    mention memory is still a bug in our code."""
    if isinstance(exc, RuntimeError):
        return True
    module = type(exc).__module__ or ""
    return module.split(".")[0] in {"torch", "triton", "bitsandbytes", "cupy", "pynvml"}


def _classify_one(exc: BaseException) -> StageFailure:
    own = getattr(exc, "failure_class", None)
    if own in _OWN_CLASSES:
        return cast(StageFailure, own)
    text = _BOILERPLATE.sub("", str(exc))
    inspect_text = _inspect_text(exc)
    if inspect_text and _FAULT.search(text):
        return "cuda_fault"
    oom_type = _torch_type("OutOfMemoryError")
    if (oom_type is not None and isinstance(exc, oom_type)) or isinstance(exc, MemoryError):
        return "oom"
    if inspect_text and _OOM.search(text):
        return "oom"
    accel = _torch_type("AcceleratorError")
    if accel is not None and isinstance(exc, accel):
        return "cuda_fault"
    if inspect_text and _CUDA_OTHER.search(text):
        return "cuda_fault"
    return "error"


def classify_exception(exc: BaseException) -> StageFailure:
    """``"oom"``, ``"cuda_fault"``, ``"killed"`` / ``"stalled"`` (a gang's rank died or
    stopped stepping: the exception's own ``failure_class``) or ``"error"`` for an
    exception raised by a stage.

    Looks through the explicit and implicit chain (``__cause__``, ``__context__``), so an
    out-of-memory error re-raised as another exception keeps its class. A fault anywhere in
    the chain wins over an out-of-memory error (the context may be poisoned either way).
    """
    seen: set[int] = set()
    found: set[str] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen and len(seen) < 32:
        seen.add(id(cur))
        found.add(_classify_one(cur))
        cur = cur.__cause__ or cur.__context__
    if "cuda_fault" in found:
        return "cuda_fault"
    if "oom" in found:
        return "oom"
    return next((cast(StageFailure, c) for c in _OWN_CLASSES if c in found), "error")
