"""Append-only journal of task state changes (`journal.jsonl`), fsync'd per event.

The journal is the history a user reads and resume replays; the task manifests are the
proof of completion (a task counts as done on resume only if its manifest verifies).
It is opened like every control file (`safe_files`: no symlink, a regular file of yours),
and a line torn by a crash or a full disk is ended before the next event is appended, so
the two never glue into one unreadable line.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from pita.core.paths import current_umask
from pita.core.safe_files import MAX_JOURNAL_BYTES, open_control, read_control


class Journal:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        fd = open_control(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666 & ~current_umask())
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            os.write(fd, b"\n")  # end a torn last line: the next event starts on its own line
        self._fh = os.fdopen(fd, "a", encoding="utf-8")

    def append(self, event: str, **fields: Any) -> None:
        record = {"ts": round(time.time(), 3), "event": event, **fields}
        line = json.dumps(record, default=str) + "\n"
        with self._lock:
            self._fh.write(line)
            self._fh.flush()
            os.fsync(self._fh.fileno())

    def close(self) -> None:
        with self._lock:
            if not self._fh.closed:
                self._fh.close()


def read_events(path: Path) -> list[dict[str, Any]]:
    """Every readable event of a journal, in order. A torn line, a line that is not a
    JSON object, or bytes that are not UTF-8 are skipped; an absent journal is empty."""
    try:
        data = read_control(path, MAX_JOURNAL_BYTES)
    except FileNotFoundError:
        return []
    events = []
    for raw in data.splitlines():
        try:
            rec = json.loads(raw.decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            continue
        if isinstance(rec, dict):
            events.append(rec)
    return events


def replay(path: Path) -> dict[str, dict[str, Any]]:
    """Last recorded state per task id."""
    states: dict[str, dict[str, Any]] = {}
    for rec in read_events(path):
        tid = rec.get("task")
        if isinstance(tid, str) and tid:
            states[tid] = rec
    return states
