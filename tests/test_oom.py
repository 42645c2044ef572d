"""Failure classification from real exception types and messages."""

from __future__ import annotations

import pytest
import torch

from pita.runtime.oom import classify_exception

KERNEL_NOTE = (
    "\nCUDA kernel errors might be asynchronously reported at some other API call, so the "
    "stacktrace below might be incorrect.\nFor debugging consider passing "
    "CUDA_LAUNCH_BLOCKING=1\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side assertions."
)


def real_cpu_oom() -> RuntimeError:
    try:
        torch.empty(2**62, dtype=torch.uint8)
    except RuntimeError as exc:
        return exc
    pytest.skip("this machine allocated 4 EiB")


def real_shape_error() -> RuntimeError:
    try:
        torch.zeros(2, 3) @ torch.zeros(4, 5)
    except RuntimeError as exc:
        return exc
    raise AssertionError("matmul of mismatched shapes did not raise")


@pytest.mark.parametrize(
    "exc",
    [
        torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
            "79.19 GiB of which 1.06 GiB is free. Including non-PyTorch memory, this process "
            "has 78.12 GiB memory in use."
        ),
        torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB"),
        RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
        RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),
        RuntimeError("cuDNN error: CUDNN_STATUS_NOT_ENOUGH_MEMORY"),
        RuntimeError("CUDA error: out of memory" + KERNEL_NOTE),
        torch.AcceleratorError("CUDA error: out of memory" + KERNEL_NOTE),
        RuntimeError("HIP out of memory. Tried to allocate 1.00 GiB"),
        MemoryError(),
    ],
    ids=lambda e: f"{type(e).__name__}:{str(e)[:40]}",
)
def test_out_of_memory(exc: BaseException) -> None:
    assert classify_exception(exc) == "oom"


def test_real_cpu_allocation_failure_is_oom() -> None:
    exc = real_cpu_oom()
    assert "DefaultCPUAllocator" in str(exc)
    assert classify_exception(exc) == "oom"


@pytest.mark.parametrize(
    "exc",
    [
        torch.AcceleratorError(
            "CUDA error: an illegal memory access was encountered" + KERNEL_NOTE
        ),
        RuntimeError("CUDA error: an illegal memory access was encountered" + KERNEL_NOTE),
        RuntimeError("CUDA error: device-side assert triggered" + KERNEL_NOTE),
        RuntimeError("CUDA error: unspecified launch failure" + KERNEL_NOTE),
        RuntimeError("CUDA error: misaligned address"),
        RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx(...)`"),
        torch.AcceleratorError("CUDA error: invalid configuration argument"),
        RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error"),
    ],
    ids=lambda e: f"{type(e).__name__}:{str(e)[:40]}",
)
def test_cuda_fault(exc: BaseException) -> None:
    assert classify_exception(exc) == "cuda_fault"


@pytest.mark.parametrize(
    "exc",
    [
        ValueError("batch_size must be positive"),
        ValueError("CUDA out of memory"),  # a message alone does not make our bug an OOM
        KeyError("input_ids"),
        TypeError("forward() got an unexpected keyword argument 'labels'"),
        RuntimeError("Expected all tensors to be on the same device"),
    ],
    ids=lambda e: f"{type(e).__name__}:{str(e)[:40]}",
)
def test_ordinary_error(exc: BaseException) -> None:
    assert classify_exception(exc) == "error"


def test_real_shape_error_is_error() -> None:
    assert classify_exception(real_shape_error()) == "error"


def test_chained_exceptions_keep_their_class() -> None:
    def stage() -> None:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        except torch.OutOfMemoryError as exc:
            raise RuntimeError("stage collect failed") from exc

    with pytest.raises(RuntimeError) as info:
        stage()
    assert classify_exception(info.value) == "oom"

    try:  # implicit context: failed while handling a fault
        try:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        except RuntimeError:
            raise KeyError("cleanup")  # noqa: B904 - the implicit context is the point
    except KeyError as exc:
        assert classify_exception(exc) == "cuda_fault"


def test_fault_wins_over_oom_in_a_chain() -> None:
    oom = torch.OutOfMemoryError("CUDA out of memory.")
    fault = RuntimeError("CUDA error: an illegal memory access was encountered")
    fault.__cause__ = oom
    assert classify_exception(fault) == "cuda_fault"


def test_no_torch_import_at_module_level() -> None:
    import subprocess
    import sys

    code = (
        "import sys, pita.runtime.oom, pita.runtime.batch_size; assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
