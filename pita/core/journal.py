"""Append-only journal of task state changes (`journal.jsonl`), fsync'd per event.

The journal is the history a user reads and resume replays; the task manifests are the
proof of completion (a task counts as done on resume only if its manifest verifies).
It is opened like every control file (`safe_files`: no symlink, a regular file of yours),
and a line torn by a crash or a full disk is ended before the next event is appended, so
the two never glue into one unreadable line. A journal that cannot be opened or appended
(a full disk, an immutable or read-only file) raises `RunFileError`, one line naming the
file and the cause: the run stops there and a resume finishes it once the cause is gone.
Every reader gets its events from `read_events`, which skips a line of the wrong shape (a
list as `task`, `"abc"` as `wall_s`) with one WARNING, so no reader meets one.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

from pita.core.errors import PitaError
from pita.core.paths import current_umask
from pita.core.safe_files import MAX_JOURNAL_BYTES, open_control, read_control

log = logging.getLogger("pita")


class RunFileError(PitaError):
    """A file of the run itself (the journal) cannot be written: a full disk, an immutable
    or read-only file or folder. The run stops at once; `str()` is one line naming the
    file and the cause."""


def run_file_error(path: Path | str, exc: OSError) -> RunFileError:
    return RunFileError(f"cannot write {exc.filename or path}: {exc.strerror or exc}")


# A task that could not write into the run folder answers with a message that starts so;
# the DAG runner then stops the run (every other task would fail the same way).
RUN_FILE_PREFIX = "run folder: "
# Causes that are the run folder's, not the task's: a full disk or quota, a read-only file
# system, a file or folder nobody may write (immutable, or another user's).
RUN_FILE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EPERM, errno.EACCES})


def run_folder_problem(
    exc: BaseException, run_dir: Path | str, folder: Path | str | None = None
) -> str | None:
    """`run folder: cannot write <file>: <cause>` when `exc` is a write into `run_dir`
    that failed for one of RUN_FILE_ERRNOS, else None. A write() on a full disk names no
    file: then `folder` (the task's folder being written) is named."""
    if not isinstance(exc, OSError) or exc.errno not in RUN_FILE_ERRNOS:
        return None
    name = str(exc.filename or "")
    root = os.path.abspath(run_dir)
    if name and not os.path.abspath(name).startswith(root + os.sep):
        return None  # a file outside the run (a dataset, a cache): the task's own error
    where = name or f"into {folder or root}"
    return f"{RUN_FILE_PREFIX}cannot write {where}: {exc.strerror or exc}"


class Journal:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        try:
            fd = open_control(
                self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666 & ~current_umask()
            )
        except OSError as exc:  # an immutable or read-only journal, a full disk
            raise run_file_error(self.path, exc) from None
        self._fd: int | None = fd
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            self._write(b"\n")  # end a torn last line: the next event starts on its own line

    def _write(self, data: bytes) -> None:
        """Append `data` whole and fsync it, or raise RunFileError (a short write on a
        full disk leaves a torn line, ended by the next Journal of this file)."""
        assert self._fd is not None, "journal used after close()"
        try:
            while data:
                data = data[os.write(self._fd, data) :]
            os.fsync(self._fd)
        except OSError as exc:
            raise run_file_error(self.path, exc) from None

    def append(self, event: str, **fields: Any) -> None:
        record = {"ts": round(time.time(), 3), "event": event, **fields}
        line = json.dumps(record, default=str) + "\n"
        with self._lock:
            self._write(line.encode("utf-8"))

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


# The shape of each field pita writes; a line whose field has another shape is skipped.
_NUMBER = (int, float)
FIELD_SHAPES: dict[str, tuple[type, ...]] = {
    "event": (str,),
    "task": (str,),
    "ts": _NUMBER,
    "wall_s": _NUMBER,
    "batch_scale": _NUMBER,
    "attempt": (int,),
    "tasks": (int,),
    "already_done": (int,),
    "done": (int,),
    "failed": (int,),
    "skipped": (int,),
    "worker_pid": (int, type(None)),
    "devices": (list,),
    "running": (list,),
    "report": (bool,),
    "config_sha256": (str, type(None)),
}
_WARNED: set[tuple[str, int]] = set()  # (journal, line): each bad line is one WARNING a process


def shape_problem(rec: dict[str, Any]) -> str | None:
    """Why an event does not have the shape pita writes, or None when it does."""
    if "event" not in rec:
        return "no event"
    for key, types in FIELD_SHAPES.items():
        if key not in rec:
            continue
        v = rec[key]
        bad = not isinstance(v, types) or (isinstance(v, bool) and bool not in types)
        if isinstance(v, float) and not math.isfinite(v):
            bad = True
        if key in ("devices", "running") and not bad:
            bad = not all(isinstance(x, int if key == "devices" else str) for x in v)
        if key == "task" and not bad and not v:
            bad = True
        if bad:
            return f"{key} is {json.dumps(v, default=str)[:40]}"
    return None


def read_events(path: Path) -> list[dict[str, Any]]:
    """Every readable event of a journal, in order. A torn line, a line that is not a
    JSON object, or bytes that are not UTF-8 are skipped; so is a line of the wrong shape
    (`shape_problem`), with one WARNING; an absent journal is empty."""
    try:
        data = read_control(path, MAX_JOURNAL_BYTES)
    except FileNotFoundError:
        return []
    events = []
    for n, raw in enumerate(data.splitlines(), 1):
        try:
            rec = json.loads(raw.decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            continue
        if not isinstance(rec, dict):
            continue
        why = shape_problem(rec)
        if why is None:
            events.append(rec)
        elif (str(path), n) not in _WARNED:
            _WARNED.add((str(path), n))
            log.warning("%s line %d: %s, not what pita writes; line skipped", path, n, why)
    return events


def replay(path: Path) -> dict[str, dict[str, Any]]:
    """Last recorded state per task id."""
    states: dict[str, dict[str, Any]] = {}
    for rec in read_events(path):
        tid = rec.get("task")
        if isinstance(tid, str) and tid:
            states[tid] = rec
    return states
