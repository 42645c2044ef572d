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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pita.core.journal import replay
from pita.core.paths import RunPaths, TaskPaths

log = logging.getLogger("pita")


def completed_tasks(plan: Any, run_dir: Path, touched: Mapping[str, str] | None = None) -> set[str]:
    """Task ids of `plan` (insertion order is topological) that resume may skip;
    `touched`: tasks a changed config makes run again (pita/experiment/resume_fix.py)."""
    why = resume_reasons(plan, run_dir, touched, warn=True)
    return {tid for tid in plan.tasks if tid not in why}


def resume_reasons(
    plan: Any, run_dir: Path, touched: Mapping[str, str] | None = None, *, warn: bool = False
) -> dict[str, str]:
    """task id -> why it runs on this resume, for every task that is not kept (the dry
    run of a resume prints it). With `warn`, a finished folder that is not kept is a WARNING."""
    states = replay(RunPaths(run_dir).journal)
    touched = touched or {}
    done: set[str] = set()
    why: dict[str, str] = {}
    for tid, task in plan.tasks.items():
        last = states.get(tid, {}).get("event")
        paths = TaskPaths(run_dir, tid)
        if tid in touched:
            why[tid] = touched[tid]
            continue
        redo_dep = next((d for d in task.deps if d not in done), None)
        if redo_dep is not None:
            why[tid] = f"its input {redo_dep} runs again"
            if warn and paths.manifest.exists():
                log.warning("%s: redone because its input %s is redone", tid, redo_dep)
            continue
        problem = paths.verify(task.outputs)
        if problem is None:
            done.add(tid)
        elif last == "task_done" or paths.final.exists():
            why[tid] = f"its folder does not verify ({problem})"
            if warn:
                log.warning("%s: its folder does not verify (%s): running it again", tid, problem)
        else:
            why[tid] = {"task_failed": "failed", "task_skipped": "skipped (an input failed)"}.get(
                str(last), "not finished"
            )
    return why


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
