"""What a resumed run may keep: verified task folders whose inputs are kept too.

A task counts as done only when its committed folder verifies (`TaskPaths.verify`: every
file's size and sha256, `result.json`, `log.txt` and the stage's declared outputs) AND
every task it depends on counts as done: a task that is redone produces new outputs, so
whatever consumed the old ones is redone after it. Temporary folders of attempts that
died (`tasks/.tmp-*`) are removed; the caller holds the run lock, so no live worker of
another orchestrator can be writing into them.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from pita.core.journal import replay
from pita.core.paths import RunPaths, TaskPaths

log = logging.getLogger("pita")


def completed_tasks(plan: Any, run_dir: Path) -> set[str]:
    """Task ids of `plan` (insertion order is topological) that resume may skip."""
    states = replay(RunPaths(run_dir).journal)
    done: set[str] = set()
    for tid, task in plan.tasks.items():
        journal_done = states.get(tid, {}).get("event") == "task_done"
        redo_dep = next((d for d in task.deps if d not in done), None)
        if redo_dep is not None:
            if TaskPaths(run_dir, tid).manifest.exists():
                log.warning("%s: redone because its input %s is redone", tid, redo_dep)
            continue
        why = TaskPaths(run_dir, tid).verify(task.outputs)
        if why is None:
            done.add(tid)
        elif journal_done or TaskPaths(run_dir, tid).final.exists():
            log.warning("%s: its folder does not verify (%s): running it again", tid, why)
    return done


def remove_stale_tmp(run_dir: Path) -> list[str]:
    """Delete `tasks/.tmp-*` folders left by attempts that died; returns their names."""
    removed = []
    tasks = RunPaths(run_dir).tasks
    for p in sorted(tasks.glob(".tmp-*")) if tasks.is_dir() else []:
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p.name)
    if removed:
        log.info("Removed %d temporary folder(s) of dead attempts", len(removed))
    return removed
