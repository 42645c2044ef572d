"""Where the time went: task durations across runs (for the ETA), and at the end of a run
`results/timeline.png` (a Gantt per device) and the time table `results/time.{md,csv}`.

Everything here reads the journal (`task_running` / `task_done` / `task_failed` events, with
their timestamps and devices): it is the run's history, resumed sessions included. The
durations of finished tasks are kept per user in `$PITA_CACHE_DIR/task_durations.json`
(next to the peaks cache of pita/experiment/estimates.py), keyed by the task id, its
sharding, the device kind and a fingerprint of the config that changes a task's work, so a
later run of the same experiment starts with an ETA from measured durations.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pita.algos.registry import ANY
from pita.core.journal import read_events
from pita.core.paths import RunPaths, atomic_write_json, atomic_write_text, pita_cache_dir

log = logging.getLogger("pita.report")

# Config sections that do not change how long a task works (where, how it is logged).
NOT_WORK = ("system", "executor", "logger", "hydra", "resume_from", "dry_run")
TASK_END = {"task_done": "done", "task_failed": "failed"}


# --- durations across runs ------------------------------------------------------------------


def durations_cache_path() -> Path:
    return pita_cache_dir() / "task_durations.json"


def duration_key(cfg: Any, device_kind: str) -> Callable[[Any], str]:
    """task -> cache key: task id, shard count, stage function, device kind, config print."""
    from omegaconf import OmegaConf

    try:
        resolved = OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # a partial config in a unit test: no print, ids still distinguish
        resolved = {}
    work: dict[str, Any] = (
        {str(k): v for k, v in resolved.items()} if isinstance(resolved, dict) else {}
    )
    work = {k: v for k, v in work.items() if k not in NOT_WORK}
    if isinstance(work.get("experiment"), dict):  # seeds of a sweep take as long as each other
        work["experiment"] = {k: v for k, v in work["experiment"].items() if k != "seed"}
    blob = json.dumps(work, sort_keys=True, default=str)
    print_ = hashlib.sha256(blob.encode()).hexdigest()[:12]
    return lambda t: f"{t.id}|{t.num_shards}|{t.fn}|{device_kind}|{print_}"


def load_durations(path: Path | None = None) -> dict[str, float]:
    """Recorded durations, key -> seconds ({} when there is no readable cache)."""
    try:
        data = json.loads((path or durations_cache_path()).read_text())
        return {k: float(v["wall_s"]) for k, v in data.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def load_rank_history(path: Path | None = None) -> dict[str, dict[str, Any]]:
    """Recorded seconds per rank count: key -> {"curve": stage|family, "by_ranks": {k: s}}
    (what pita/core/elastic.py fits speedup curves from)."""
    try:
        data = json.loads((path or durations_cache_path()).read_text())
        return {
            k: {
                "curve": str(v["curve"]),
                "by_ranks": {str(r): float(x) for r, x in v["by_ranks"].items()},
            }
            for k, v in data.items()
            if isinstance(v, dict) and isinstance(v.get("by_ranks"), dict) and "curve" in v
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def ranks_of(events: list[dict[str, Any]]) -> dict[str, int]:
    """task id -> how many devices (ranks) its last started attempt had."""
    return {
        e["task"]: max(1, len(e.get("devices") or [0]))
        for e in events
        if e.get("event") == "task_running"
    }


def record_durations(
    run_dir: Path,
    tasks: Mapping[str, Any],
    key: Callable[[Any], str],
    path: Path | None = None,
    one_rank: Callable[[Any, float, int], float] | None = None,
) -> int:
    """Add this run's finished tasks' durations to the cache; how many were recorded.

    `wall_s` is what the task stands for on one rank (`one_rank(task, wall, k)` converts a
    gang's wall time); an elastic task also keeps its raw seconds per rank count
    (`by_ranks`, across runs) and its curve key, from which speedup curves are fitted."""
    from pita.core.elastic import curve_key

    path = path or durations_cache_path()
    events = read_events(RunPaths(run_dir).journal)
    walls = done_walls(events)
    ranks = ranks_of(events)
    if not walls:
        return 0
    try:
        data = json.loads(path.read_text()) if path.is_file() else {}
        if not isinstance(data, dict):
            data = {}
    except (OSError, ValueError):
        data = {}
    for tid, wall in walls.items():
        if tid in tasks:
            t, k = tasks[tid], ranks.get(tid, 1)
            entry: dict[str, Any] = {"run": str(run_dir)}
            entry["wall_s"] = round(one_rank(t, wall, k) if one_rank and k > 1 else wall, 3)
            if getattr(t, "elastic", False):
                old = data.get(key(t))
                by = dict(old.get("by_ranks") or {}) if isinstance(old, dict) else {}
                entry.update(curve=curve_key(t), by_ranks={**by, str(k): round(wall, 3)})
            data[key(t)] = entry
    try:
        atomic_write_json(path, data)
    except OSError as exc:
        log.warning("cannot write the durations cache %s: %s", path, exc)
        return 0
    return len(walls)


def done_walls(events: list[dict[str, Any]]) -> dict[str, float]:
    """task id -> wall_s of its (last) task_done event."""
    return {
        e["task"]: float(e.get("wall_s") or 0.0) for e in events if e.get("event") == "task_done"
    }


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
    outcome: str  # done | failed | running (no end event: interrupted)

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
            out.append(_span(start, tasks, t0, ts, TASK_END[kind]))
        if sessions:
            sessions[-1][1] = ts
    _close_open(open_, out, tasks, t0, last_ts)
    if not sessions:
        sessions = [[t0, last_ts]]
    wall = sum(max(0.0, b - max(a, t0)) for a, b in sessions)
    return out, wall


def _span(start: dict, tasks: Mapping[str, Any], t0: float, end: float, outcome: str) -> Span:
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
                    "failed_s": round(sum(s.seconds for s in members if s.outcome != "done"), 1),
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
                "failed_s": round(sum(s.seconds for s in on if s.outcome != "done"), 1),
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


def plot_timeline(
    all_spans: list[Span],
    labels: list[str],
    path: Path,
    resizes: list[tuple[float, str, int]] = (),  # type: ignore[assignment]
) -> None:
    """A Gantt per device: one bar per task attempt, coloured by stage (failed: hatched); a
    k-rank gang is a bar on each of its devices labelled `k ranks`, a resize a red marker."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    stages = sorted({s.stage for s in all_spans})
    colour = {st: f"C{i % 10}" for i, st in enumerate(stages)}
    fig = Figure(figsize=(11, 1.2 + 0.55 * len(labels)), layout="constrained")
    ax = fig.subplots()
    for s in all_spans:
        for d in s.devices:
            ax.broken_barh(
                [(s.start, max(s.seconds, 1e-3))],
                (d - 0.4, 0.8),
                facecolors=colour[s.stage],
                edgecolor="black" if s.outcome == "done" else "red",
                linewidth=0.3,
                hatch=None if s.outcome == "done" else "//",
            )
        if len(s.devices) > 1:
            ax.text(s.start, min(s.devices), f" {len(s.devices)} ranks", fontsize=6, va="center")
    for at, task, k in resizes:
        devs = next((s.devices for s in all_spans if s.task == task and s.start >= at), [])
        for d in devs or [0]:
            ax.plot([at], [d], marker="v", color="red", markersize=5)
        ax.annotate(f"resize -> {k}", (at, min(devs or [0])), fontsize=6, color="red")
    ax.set_yticks(range(len(labels)), labels)
    ax.set_ylim(-0.6, len(labels) - 0.4)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first task started")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(
        handles=[Patch(color=colour[st], label=st) for st in stages],
        fontsize=7,
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def write_time_report(run_dir: Path, tasks: Mapping[str, Any], labels: list[str]) -> str | None:
    """results/timeline.png and results/time.{md,csv}; the table's text (None: no task ran)."""
    paths = RunPaths(run_dir)
    events = read_events(paths.journal)
    all_spans, wall = spans(events, tasks)
    if not all_spans:
        return None
    n_devices = max([len(labels)] + [d + 1 for s in all_spans for d in s.devices])
    labels = list(labels) + [f"device {i}" for i in range(len(labels), n_devices)]
    rows = time_rows(all_spans, wall, labels)
    table = time_markdown(rows, wall)
    atomic_write_text(paths.results / "time.md", table)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=TIME_COLUMNS)
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(paths.results / "time.csv", buf.getvalue())
    plot_timeline(all_spans, labels, paths.results / "timeline.png", resize_marks(events))
    return table
