"""One orchestrator per run folder: an exclusive `flock` on `<run>/.lock` for the life of a
run or resume.

Two `resume_from=` of one folder would both redo every remaining task and commit over
each other. The lock is taken before the plan, the journal or any worker exists; a
second orchestrator gets a ConfigError (exit 2) naming the holder: pid, host, start time.
The kernel drops the lock when its holder dies, even by SIGKILL, so a crashed run never
leaves a stale lock behind; the file's text is only a description of the last holder.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from pita.core.errors import ConfigError
from pita.core.paths import RunPaths


class RunLock:
    def __init__(self, run_dir: Path | str):
        self.path = RunPaths(run_dir).lock
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise ConfigError(
                f"run folder {self.path.parent}: in use by {self.holder()}; "
                f"wait for that run to end or stop it first"
            ) from None
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "argv": sys.argv[1:],
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        self._fd = fd
        return self

    def holder(self) -> str:
        """'pid 123 on host since 2026-11-23 20:00:00', from the lock file's text."""
        try:
            info = json.loads(self.path.read_text())
            return f"pid {info['pid']} on {info['host']} since {info['started']}"
        except (OSError, ValueError, KeyError, TypeError):
            return "another pita process"

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
