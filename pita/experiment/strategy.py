"""`training.parallel_strategy=auto` (the default): which strategy a run trains with.

Sizing at dispatch (pita/core/elastic.py) and growth at a checkpoint (pita/core/growth.py)
act on elastic training tasks, and a training task is elastic only under `data_parallel`
(pita/experiment/plan.py `Planner.elastic_ranks`). `auto` turns them on where k ranks run
faster than one, and off where they do not: it is resolved once per run, when the devices
are known and before anything is planned, recorded or sent to a worker
(`resolve_parallel_strategy`); every reader after that sees a concrete value.

A resume keeps the value its run resolved (`keep_run_strategy`): `auto` on a resume's
command line means that value, so a resume on other devices, or a command line that leaves
the default, neither changes what finished tasks were computed with nor is refused as
"another run".
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, MutableMapping
from typing import Any

from pita.core.parallel import AUTO, Strategy

NONE, DDP = Strategy.NONE.key, Strategy.DDP.key  # the config's names


def resolve_parallel_strategy(
    key: str, gpu_mode: str, device_kind: str, n_devices: int, in_process: bool = False
) -> tuple[str, str]:
    """(the strategy, why) for `training.parallel_strategy=key` on this run's devices.

    An explicit value (`none`, `data_parallel`, `fsdp`) is kept. `auto` is:

    - `data_parallel` on more than one real CUDA GPU (NVML found them; a Ray cluster's GPU
      slots count): each rank has its own device, so a training task on the critical path
      ends sooner on k of them, and sizing at dispatch and growth give it the idle ones;
    - `none` on `fake:` devices and CPU slots: their workers compute on the same CPU cores,
      so k ranks do not run k times faster (the 2-rank gloo bench, bench/ddp.py, measures
      s(2) = 1.38, alpha = 0.45 on this 2-core machine: bench/README.md), and the cores a
      gang takes are the ones the other chains' tasks would use;
    - `none` with one device (`system.gpu_mode=single_gpu` or cpu, or one GPU): no gang;
    - `none` when tasks run in the orchestrator's process (`executor.backend=inprocess`,
      `system.use_parallel_execution=false`: debugging), so a breakpoint in a training
      stage still stops there rather than in k rank processes.
    """
    if key != AUTO:
        return key, "explicit"
    if gpu_mode in ("cpu", "single_gpu"):
        return NONE, f"system.gpu_mode={gpu_mode}: one device per task"
    if in_process:
        return NONE, "tasks run in this process"
    if device_kind == "cuda" and n_devices > 1:
        return DDP, f"{n_devices} CUDA devices"
    if device_kind == "cuda":
        return NONE, "one CUDA device"
    if device_kind == "fake":
        return NONE, "fake devices share the CPU"
    return NONE, "CPU slots share the CPU cores"


def resolved_config(cfg: Any, device_kind: str, n_devices: int) -> tuple[Any, str | None]:
    """(cfg with `auto` resolved, the run log's line), or (cfg itself, None) when the key is
    explicit. A copy, so the caller's config (a dry run's, the preflight's) keeps `auto`."""
    key = str(cfg.training.parallel_strategy)
    if key != AUTO:
        return cfg, None
    in_process = cfg.executor.backend == "inprocess" or not cfg.system.use_parallel_execution
    value, why = resolve_parallel_strategy(
        key, str(cfg.system.gpu_mode), device_kind, n_devices, in_process
    )
    out = copy.deepcopy(cfg)
    out.training.parallel_strategy = value
    return out, f"training.parallel_strategy=auto -> {value} ({why})"


def keep_run_strategy(cfg: Any, run: Any) -> None:
    """Where `cfg` (a config, or its plain dict) says `auto`, put the value `run` holds: a
    resume's `auto` is what its run resolved when it started (a run's saved config holds
    that value; one that stopped before writing it still holds `auto`, and then the
    resumed run's value is taken for it)."""
    training, other = cfg.get("training"), run.get("training")
    if not (isinstance(training, MutableMapping) and isinstance(other, Mapping)):
        return  # a saved config without the group: the resumed run resolves `auto` itself
    value = other.get("parallel_strategy")
    if training.get("parallel_strategy") == AUTO and value is not None:
        training["parallel_strategy"] = value
