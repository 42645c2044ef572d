"""Where the time went, at the end of a run: `results/timeline.png` (a Gantt per device:
pita/results/timeline_plot.py) and the time table `results/time.{md,csv}`.

Everything here reads the journal (`task_running` / `task_done` / `task_failed` events, with
their timestamps and devices): it is the run's history, resumed sessions included. The
durations kept across runs for the ETA are pita/experiment/durations.py.
"""

from __future__ import annotations

import csv
import io
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pita.algos.registry import ANY
from pita.core.journal import read_events
from pita.core.paths import RunPaths, atomic_write_text

log = logging.getLogger("pita.report")

# an attempt's end; `task_stopped`: it stopped at a checkpoint to grow (pita/core/growth.py)
TASK_END = {"task_done": "done", "task_failed": "failed", "task_stopped": "stopped"}
KEPT = ("done", "stopped")  # attempts whose work counts (a stopped one resumes from its checkpoint)


# --- the run's history ------------------------------------------------------------------------


@dataclass
class Span:
    """One attempt of a task on its devices, in seconds from the run's first start."""

    task: str
    stage: str
    chain: str
    devices: list[int]
    start: float
    end: float
    outcome: str  # done | failed | stopped (to grow) | running (no end event: interrupted)
    attempt: int = 1  # > 1: a retry
    failure: str | None = None  # a failed attempt's class (oom, killed, error, ...)

    @property
    def seconds(self) -> float:
        return max(0.0, self.end - self.start)


def spans(events: list[dict[str, Any]], tasks: Mapping[str, Any]) -> tuple[list[Span], float]:
    """Every task attempt of the journal, and the run's wall time (the sessions' spans summed:
    a resumed run's pause is not time the devices could have worked)."""
    starts = [e["ts"] for e in events if e.get("event") == "task_running"]
    if not starts:
        return [], 0.0
    t0 = min(starts)
    open_: dict[str, dict] = {}
    out: list[Span] = []
    sessions: list[list[float]] = []
    last_ts = t0
    for e in events:
        kind, ts = e.get("event"), float(e.get("ts", last_ts))
        last_ts = max(last_ts, ts)
        if kind in ("run_started", "run_resumed"):
            _close_open(open_, out, tasks, t0, last_ts)
            sessions.append([ts, ts])
        elif kind == "task_running":
            open_[e["task"]] = e
        elif kind in TASK_END and e.get("task") in open_:
            start = open_.pop(e["task"])
            out.append(_span(start, tasks, t0, ts, TASK_END[kind], e.get("failure")))
        if sessions:
            sessions[-1][1] = ts
    _close_open(open_, out, tasks, t0, last_ts)
    if not sessions:
        sessions = [[t0, last_ts]]
    wall = sum(max(0.0, b - max(a, t0)) for a, b in sessions)
    return out, wall


def _span(
    start: dict,
    tasks: Mapping[str, Any],
    t0: float,
    end: float,
    outcome: str,
    failure: str | None = None,
) -> Span:
    t = tasks.get(start["task"])
    stage = t.stage if t is not None else start["task"].split(".")[-1]
    chain = t.chain if t is not None else "?"
    if t is not None and t.algo == ANY:  # shared by every chain of its dataset and family
        chain = f"shared: {t.dataset}.{t.family}"
    return Span(
        start["task"],
        stage,
        chain,
        list(start.get("devices") or []),
        start["ts"] - t0,
        end - t0,
        outcome,
        int(start.get("attempt") or 1),
        failure if outcome == "failed" else None,
    )


def _close_open(open_: dict, out: list[Span], tasks, t0: float, ts: float) -> None:
    for start in open_.values():  # no end event: the session stopped with it running
        out.append(_span(start, tasks, t0, ts, "running"))
    open_.clear()


# --- the time table -------------------------------------------------------------------------


def _busy(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of intervals (packed tasks overlap on one device)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def time_rows(all_spans: list[Span], wall: float, labels: list[str]) -> list[dict[str, Any]]:
    """Rows of the time table: per stage, per chain, per device (busy %)."""
    task_total = sum(s.seconds for s in all_spans) or 1.0
    rows: list[dict[str, Any]] = []
    for section, name_of in (("stage", lambda s: s.stage), ("chain", lambda s: s.chain)):
        groups: dict[str, list[Span]] = {}
        for s in all_spans:
            groups.setdefault(name_of(s), []).append(s)
        for name, members in sorted(groups.items(), key=lambda kv: -sum(s.seconds for s in kv[1])):
            seconds = sum(s.seconds for s in members)
            rows.append(
                {
                    "section": section,
                    "name": name,
                    "tasks": len({s.task for s in members}),
                    "seconds": round(seconds, 1),
                    "share_%": round(100 * seconds / task_total, 1),
                    "failed_s": round(sum(s.seconds for s in members if s.outcome not in KEPT), 1),
                }
            )
    for i, label in enumerate(labels):
        on = [s for s in all_spans if i in s.devices]
        busy = _busy([(s.start, s.end) for s in on])
        rows.append(
            {
                "section": "device",
                "name": label,
                "tasks": len({s.task for s in on}),
                "seconds": round(busy, 1),
                "share_%": round(100 * busy / wall, 1) if wall > 0 else 0.0,
                "failed_s": round(sum(s.seconds for s in on if s.outcome not in KEPT), 1),
            }
        )
    return rows


TIME_COLUMNS = ["section", "name", "tasks", "seconds", "share_%", "failed_s"]
HEADERS = {
    "stage": "| stage | tasks | task seconds | share of task time | not done (s) |",
    "chain": "| chain | tasks | task seconds | share of task time | not done (s) |",
    "device": "| device | tasks | busy seconds | busy % of the run | not done (s) |",
}


def time_markdown(rows: list[dict[str, Any]], wall: float) -> str:
    lines = [f"Where the time went ({wall:.1f} s of run time, task seconds from the journal)"]
    for section in ("stage", "chain", "device"):
        lines += ["", HEADERS[section], "|---|---:|---:|---:|---:|"]
        for r in rows:
            if r["section"] == section:
                lines.append(
                    f"| {r['name']} | {r['tasks']} | {r['seconds']:.1f} | {r['share_%']:.1f} % "
                    f"| {r['failed_s']:.1f} |"
                )
    return "\n".join(lines) + "\n"


def resize_marks(events: list[dict[str, Any]]) -> list[tuple[float, str, int]]:
    """(seconds since the first start, task, new k) of each journaled resize of a gang."""
    starts = [e["ts"] for e in events if e.get("event") == "task_running"]
    if not starts:
        return []
    t0 = min(starts)
    return [
        (float(e["ts"]) - t0, str(e["task"]), int(e.get("ranks", 1)))
        for e in events
        if e.get("event") == "task_resized" and "ts" in e
    ]


def with_nodes(labels: list[str], events: list[dict[str, Any]]) -> list[str]:
    """Device labels with the Ray node(s) their tasks ran on (`cpu2 @ 9bd6acfc`), from the
    journal's `task_running` events (`nodes`, one per device); unchanged off Ray."""
    seen: dict[int, list[str]] = {}
    for e in events:
        if e.get("event") == "task_running" and e.get("nodes"):
            for device, node in zip(e.get("devices") or [], e["nodes"]):
                if 0 <= device < len(labels) and node[:8] not in seen.setdefault(device, []):
                    seen[device].append(node[:8])
    return [
        f"{label} @ {'/'.join(seen[i])}" if i in seen else label for i, label in enumerate(labels)
    ]


def write_time_report(
    run_dir: Path,
    tasks: Mapping[str, Any],
    labels: list[str],
    *,
    events: list[dict[str, Any]] | None = None,
    plot: bool = True,
) -> str | None:
    """results/timeline.png (unless not `plot`: executor.timeline_plot) and
    results/time.{md,csv}; the table's text (None: no task ran). `events`: the run's journal
    when the caller has read it already."""
    paths = RunPaths(run_dir)
    events = read_events(paths.journal) if events is None else events
    all_spans, wall = spans(events, tasks)
    if not all_spans:
        return None
    n_devices = max([len(labels)] + [d + 1 for s in all_spans for d in s.devices])
    labels = list(labels) + [f"device {i}" for i in range(len(labels), n_devices)]
    labels = with_nodes(labels, events)
    rows = time_rows(all_spans, wall, labels)
    table = time_markdown(rows, wall)
    atomic_write_text(paths.results / "time.md", table)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=TIME_COLUMNS)
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(paths.results / "time.csv", buf.getvalue())
    if not plot:
        return table
    from pita.results.timeline_plot import draw_timeline, timeline_model

    model = timeline_model(all_spans, labels, resize_marks(events))
    draw_timeline(model, paths.results / "timeline.png")
    return table
