"""Append-only journal of task state changes (`journal.jsonl`), fsync'd per event.

The journal is the history a user reads and resume replays; the task manifests are the
proof of completion (a task counts as done on resume only if its manifest verifies).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any


class Journal:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._fh = open(self.path, "a", encoding="utf-8")

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


def replay(path: Path) -> dict[str, dict[str, Any]]:
    """Last recorded state per task id. A torn last line (crash mid-write) is skipped."""
    states: dict[str, dict[str, Any]] = {}
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError:
        return states
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        tid = rec.get("task")
        if tid:
            states[tid] = rec
    return states
