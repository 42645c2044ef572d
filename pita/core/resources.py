"""How many tasks share a device, and how many CPU threads each worker gets.

Parent side, torch-free. Two decisions live here because they must agree: the scheduler
admits up to `max_tasks_per_device(...)` tasks per device (while their memory estimates
fit), and the worker pool starts each worker with `thread_budget(...)` torch threads so
that the packed workers share the host's cores instead of oversubscribing them.

Policy (`executor.max_tasks_per_gpu`):
- an integer keeps its old meaning: at most that many tasks per device;
- `auto` (the default): on GPUs (real or `fake:`), memory decides, capped at
  AUTO_MAX_TASKS_PER_GPU and at one task per core of the device's share of the host (each
  packed worker keeps at least one core). The cap of 8 is the measured point: on one H100
  the default experiment took 273 s with 1 task per GPU and 121 s with 8 (GPU 77–80 %
  busy while the DAG is wide; the tail is one chain's critical path, which more packing
  cannot shorten). On CPU slots `auto` is 1, as before: a CPU slot *is* a share of cores.

Threads: on a GPU host each worker gets cores ÷ (devices × tasks per device), at least 1;
data-loader workers get the same share minus the main thread. CPU slots keep
`system.threads_per_worker` (CPU mode is unchanged).
"""

from __future__ import annotations

import os
from typing import Any

AUTO_MAX_TASKS_PER_GPU = 8
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "PITA_TORCH_THREADS")
DATALOADER_ENV = "PITA_DATALOADER_WORKERS"


def host_cores() -> int:
    """Cores this process may run on (affinity-aware)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


def max_tasks_per_device(value: Any, kind: str, n_devices: int, cores: int | None = None) -> int:
    """The per-device task cap for `executor.max_tasks_per_gpu` = `value` on `kind` devices."""
    if not is_auto(value):
        return max(1, int(value))
    if kind == "cpu":
        return 1
    cores = host_cores() if cores is None else cores
    return max(1, min(AUTO_MAX_TASKS_PER_GPU, cores // max(1, n_devices)))


def thread_budget(
    kind: str,
    n_devices: int,
    tasks_per_device: int,
    threads_per_worker: int = 1,
    cores: int | None = None,
) -> int:
    """torch threads for one worker: cores ÷ concurrent workers on GPU hosts, else as configured."""
    if kind == "cpu":
        return max(1, int(threads_per_worker))
    cores = host_cores() if cores is None else cores
    return max(1, cores // max(1, n_devices * tasks_per_device))


def thread_env(threads: int) -> dict[str, str]:
    """The environment a worker starts with (read by the worker before any torch work)."""
    env = {var: str(threads) for var in THREAD_ENV}
    env[DATALOADER_ENV] = str(max(0, threads - 1))
    return env
