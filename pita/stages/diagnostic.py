"""device_check: a small real computation on the worker's pinned device.

Used by test_parallel_setup.py. It reports what the worker sees (CUDA_VISIBLE_DEVICES,
torch.cuda.device_count(), device names), multiplies two matrices on the device and
checks the product against the CPU, and reports memory.
"""

from __future__ import annotations

import os
import time

from pita.runtime.context import StageContext


def device_check(ctx: StageContext) -> dict:
    """test_parallel_setup.py's per-device check: a matrix product on the worker's device.

    Reads: nothing but the device. Writes: only result.json (device, CUDA_VISIBLE_DEVICES,
    max error against the CPU, time).
    """
    import torch

    n_cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = torch.device("cuda:0" if ctx.device == "cuda" and n_cuda else "cpu")
    size = 1024 if device.type == "cuda" else 256
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=gen)
    b = torch.randn(size, size, generator=gen)
    t0 = time.time()
    product = (a.to(device) @ b.to(device)).cpu()
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.time() - t0
    max_err = float((product - a @ b).abs().max())
    info = {
        "pid": os.getpid(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "pita_device_indices": os.environ.get("PITA_DEVICE_INDICES"),
        "device_kind": os.environ.get("PITA_DEVICE_KIND"),
        "torch_cuda_device_count": n_cuda,
        "device": str(device),
        "device_names": [torch.cuda.get_device_name(i) for i in range(n_cuda)],
        "matmul_size": size,
        "matmul_ms": round(elapsed * 1000, 2),
        "matmul_max_abs_err": max_err,
        "torch_threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        info["allocated_mb"] = round(torch.cuda.memory_allocated(0) / 2**20, 1)
        info["reserved_mb"] = round(torch.cuda.memory_reserved(0) / 2**20, 1)
        free, total = torch.cuda.mem_get_info(0)
        info["free_mb"], info["total_mb"] = round(free / 2**20), round(total / 2**20)
    else:
        import psutil

        info["rss_mb"] = round(psutil.Process().memory_info().rss / 2**20, 1)
    ctx.logger.info("device check: %s", info)
    return info
