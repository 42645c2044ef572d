"""Error hierarchy of pita (modelled on submitit's three classes).

`PitaError` is the root. `ConfigError` is raised for anything a user can fix in the
config or the command line; the entry point prints its one-line message and exits 2.
`TaskFailed` carries the tail of a task's log; `WorkerLost` means a worker process died
or stopped answering.
"""

from __future__ import annotations


class PitaError(Exception):
    """Base class of every error pita raises on purpose."""


class ConfigError(PitaError):
    """A bad config value, override or resume path. Exit code 2, no traceback.

    Holds one or more one-line messages, each naming the key and what is allowed.
    """

    def __init__(self, messages: str | list[str]):
        self.messages = [messages] if isinstance(messages, str) else list(messages)
        super().__init__("\n".join(self.messages))


class TaskFailed(PitaError):
    """A task ended in a classified failure; `log_tail` quotes the end of its log."""

    def __init__(self, task_id: str, failure: str, message: str, log_tail: str = ""):
        self.task_id, self.failure, self.message, self.log_tail = task_id, failure, message, log_tail
        super().__init__(f"{task_id} failed ({failure}): {message}")


class WorkerLost(PitaError):
    """A worker process exited, was killed or stopped sending heartbeats."""
