"""One orchestrator per run folder: an exclusive `flock` on `<run>/.lock` for the life of a
run or resume.

Two `resume_from=` of one folder would both redo every remaining task and commit over
each other. The lock is taken before anything is written in the folder (Hydra's `.hydra/`
included: pita/experiment/cli.py); a second orchestrator gets a ConfigError (exit 2)
naming the holder. The kernel drops the lock when its holder dies, even by SIGKILL, so a
crashed run never leaves a stale lock behind.

The file is opened like every control file (`safe_files.open_control`: no symlink, a
regular file of yours) and is 0600, so nobody else can open it to `flock` it and block
your resume. The holder is read from the kernel's lock table (`/proc/locks`), not from
the file's text, which only describes the last holder.
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
from pita.core.safe_files import group_shared, open_control


def lock_holder_pid(path: Path, locks_table: Path = Path("/proc/locks")) -> int | None:
    """The pid holding a `flock` on `path`, read from the kernel's lock table (Linux)."""
    try:
        st = os.stat(path, follow_symlinks=False)
        table = locks_table.read_text()
    except OSError:
        return None
    ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in table.splitlines():
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF" ("->" marks a waiter)
        if "->" in fields or len(fields) < 6 or fields[1] != "FLOCK":
            continue
        if fields[5] == ident and fields[4].isdigit():
            return int(fields[4])
    return None


def _process_start(pid: int) -> str | None:
    try:
        started = os.stat(f"/proc/{pid}").st_mtime
    except OSError:
        return None
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))


# Run folders whose lock this process holds and shares (realpath -> holders): the command
# line takes the lock before Hydra writes `.hydra/` (`acquire(share=True)`), and `run()`
# takes it again inside the same process. An unshared lock is exclusive even in-process.
_HELD: dict[str, int] = {}


class RunLock:
    def __init__(self, run_dir: Path | str):
        self.path = RunPaths(run_dir).lock
        self._fd: int | None = None
        self._nested = False

    def acquire(self, share: bool = False) -> RunLock:
        key = os.path.realpath(self.path)
        if _HELD.get(key):  # this process holds it already: a nested holder, no second flock
            _HELD[key] += 1
            self._nested = True
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = open_control(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except PermissionError:  # a teammate's run whose lock is private to its owner
            raise ConfigError(
                f"{self.path} is private to its owner; they share the run by resuming it once "
                f"with system.trust_group=true (the lock becomes the group's)"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise ConfigError(
                f"run folder {self.path.parent}: in use by {self.holder()}; "
                f"wait for that run to end or stop it first"
            ) from None
        if os.fstat(fd).st_uid == os.geteuid():  # an older pita made it 0644: anyone could flock
            os.fchmod(fd, 0o660 if group_shared() else 0o600)  # a shared run: the group's
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "argv": sys.argv[1:],
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        self._fd = fd
        if share:
            _HELD[key] = 1
        return self

    def holder(self) -> str:
        """'pid 123 on host since 2026-11-23 20:00:00': the pid from the kernel's lock
        table; host and start from the file's text only when its pid is that holder."""
        pid = lock_holder_pid(self.path)
        if pid is None:
            return "another pita process"
        try:
            fd = open_control(self.path, os.O_RDONLY)
            try:
                info = json.loads(os.read(fd, 4096).decode(errors="replace"))
            finally:
                os.close(fd)
            if isinstance(info, dict) and info.get("pid") == pid:
                return f"pid {pid} on {info['host']} since {info['started']}"
        except (OSError, ValueError, KeyError, ConfigError):
            pass
        since = _process_start(pid)
        return f"pid {pid} on {socket.gethostname()}" + (f" since {since}" if since else "")

    def release(self) -> None:
        key = os.path.realpath(self.path)
        if self._nested:
            self._nested = False
            _HELD[key] = max(0, _HELD.get(key, 1) - 1)
            return
        if self._fd is not None:
            _HELD.pop(key, None)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        held = self._fd is not None or self._nested  # acquired already: `with` just releases
        return self if held else self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
