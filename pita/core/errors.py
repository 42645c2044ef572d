"""Errors pita raises on purpose, and the one list of task failure classes.

`ConfigError` is raised for anything a user can fix in the config or the command line;
the entry point prints its one-line messages and exits 2. A task that fails is not an
exception in the orchestrator: its worker answers with one of the `FailureClass` values, and the
DAG runner retries by class (docs/DESIGN.md §3):

- ``oom``: out of memory — the same task again at half the micro-batch;
- ``cuda_fault``: a sticky CUDA error — recycle the worker, retry;
- ``killed``: the worker died, stopped answering or could not be reached — retry on a
  fresh worker; or a rank of the task's gang died of a signal (the kernel's OOM killer's
  SIGKILL) — retry, from the task's checkpoint when it wrote one;
- ``stalled``: a rank of the task's gang made no step for ``executor.gang_stall_s`` (by
  default derived from the gang's step times) — its ranks are killed, retry;
- ``timeout``: the task overran ``executor.task_timeout_s`` — retry on a fresh worker;
- ``error``: a Python exception in a stage — fail the task and its dependants;
- ``interrupted``: Ctrl-C / SIGTERM reached the task — the run stops (resumable).
- ``node_lost``: the Ray node (or one node of the gang) it ran on died — retry on the nodes
  left; it does not use up the task's retries, which are for its own faults
  (pita/core/ray_executor.py).

Not a failure: ``stopped`` — the task checkpointed and stopped because the orchestrator
asked it to (`TaskPaths.stop_request`, pita/core/growth.py: it restarts on a larger gang
from that checkpoint). It is dispatched again at once and never counts as a retry.
"""

from __future__ import annotations

from typing import Literal

FailureClass = Literal[
    "oom",
    "cuda_fault",
    "killed",
    "stalled",
    "timeout",
    "error",
    "interrupted",
    "stopped",
    "node_lost",
]
NODE_LOST = "node_lost"  # not the task's fault: retried without counting against its retries
STOPPED = "stopped"  # the outcome of a task that stopped at a checkpoint on request
# Classes worth another attempt (up to executor.max_retries); the rest fail the task.
RETRYABLE: tuple[str, ...] = ("oom", "cuda_fault", "killed", "stalled", "timeout")
# Classes after which a worker process is replaced rather than reused.
RECYCLE_WORKER: tuple[str, ...] = ("oom", "cuda_fault", "interrupted")


class PitaError(Exception):
    """Base class of every error pita raises on purpose."""


class ConfigError(PitaError):
    """A bad config value, override or resume path. Exit code 2, no traceback.

    Holds one or more one-line messages, each naming the key and what is allowed.
    """

    def __init__(self, messages: str | list[str]):
        self.messages = [messages] if isinstance(messages, str) else list(messages)
        super().__init__("\n".join(self.messages))


class ExecutorBroken(PitaError):
    """The executor can no longer complete futures (a worker-pool thread stopped): the run
    fails now, exit 1 with the journal written, rather than waiting forever."""


class StoppedAtCheckpoint(PitaError):
    """Raised inside a training loop (on every rank of a gang) once it has written its
    in-task checkpoint because the orchestrator asked it to stop (`TaskPaths.stop_request`);
    the worker reports the outcome `stopped`, not a failure."""

    def __init__(self, step: int):
        self.step = int(step)
        super().__init__(f"stopped at a checkpoint after step {self.step}, as requested")
