"""The interface every executor speaks, and the outcome of one task.

The DAG runner (pita/core/parallel_executor.py) only ever calls these methods, so the
per-device process pool (`WorkerPool`), the in-process executor (`InProcessExecutor`,
pdb works) and the Ray executor (`RayExecutor`) are interchangeable. Like submitit, an
executor speaks `concurrent.futures`: `submit` returns a `Future[TaskOutcome]`.

Executors live in the parent process and never import the worker runtime: the function
that runs a task in-process (or inside a Ray task) is handed to them by
pita/experiment/run.py as a `RunTask`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from pita.core.tasks import TaskSpec


@dataclass
class TaskOutcome:
    task_id: str
    ok: bool
    failure: str | None = None  # a pita.core.errors.FailureClass when not ok
    message: str = ""
    result: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0
    worker_pid: int | None = None
    devices: tuple[int, ...] = ()


# (task, resolved config as a plain dict, run folder, attempt) -> outcome; runs the stage
# in the calling process (pita.runtime.worker.run_task_here).
RunTask = Callable[[TaskSpec, dict, str, int], TaskOutcome]

# The GPU indices a task runs on, and a run folder as callers pass it.
Devices = Sequence[int]
StrPath = str | Path


class Executor(Protocol):
    def submit(
        self, task: TaskSpec, devices: Devices, cfg_dict: dict, run_dir: StrPath, attempt: int = 1
    ) -> Future[TaskOutcome]:
        """Start `task` on `devices`; the future completes with its outcome, never raises."""
        ...

    def warm_up(self, device_sets: Sequence[tuple[int, ...]]) -> None:
        """Start workers ahead of the first task (a no-op where there are none)."""
        ...

    def workers(self) -> list[dict[str, Any]]:
        """One dict per live worker (pid, devices, state) for the monitor and progress."""
        ...

    def worker_pids(self) -> list[int]:
        """Process ids of this run's workers (NVML attributes GPU memory to them)."""
        ...

    def shutdown(self, kill: bool = False, grace_s: float = 5.0) -> None:
        """Stop every worker; `kill` skips the grace period (Ctrl-C)."""
        ...
