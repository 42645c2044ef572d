"""`InProcessExecutor`: every task runs in the orchestrator's own process.

For debugging (`system.use_parallel_execution=false` or `executor.backend=inprocess`):
a breakpoint in a stage stops in the terminal and pdb works. It speaks the `Executor`
interface; the function that runs a task is injected (`RunTask`), so this module never
imports the worker runtime. That function (pita.runtime.worker.InProcessRunner) gives
each task a pool worker's torch threads and silences library progress bars, restoring
both afterwards: left to torch, one process on every core ran the default experiment 12x
slower than the pool (issue 22).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from pita.core.executor import Devices, RunTask, StrPath, TaskOutcome
from pita.core.tasks import TaskSpec


class InProcessExecutor:
    """Runs each submitted task to completion before `submit` returns."""

    def __init__(self, run_task: RunTask, on_shutdown: Callable[[], None] = lambda: None):
        self.run_task = run_task
        self.on_shutdown = on_shutdown

    def submit(
        self, task: TaskSpec, devices: Devices, cfg_dict: dict, run_dir: StrPath, attempt: int = 1
    ) -> Future[TaskOutcome]:
        future: Future[TaskOutcome] = Future()
        outcome = self.run_task(task, cfg_dict, str(run_dir), attempt)
        outcome.devices = tuple(devices)
        future.set_result(outcome)
        return future

    def warm_up(self, device_sets: Sequence[tuple[int, ...]]) -> None:
        pass

    def workers(self) -> list[dict[str, Any]]:
        return []

    def worker_pids(self) -> list[int]:
        return []

    def shutdown(self, kill: bool = False, grace_s: float = 5.0) -> None:
        self.on_shutdown()
