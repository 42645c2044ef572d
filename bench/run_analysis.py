"""What a finished run folder says about packing: concurrency, reservations, utilisation.

Shared by bench/packing.py (fake GPUs, CPU) and bench/gpu_utilisation.py (CUDA). Reads only
the run folder: `journal.jsonl` (task_running / task_done / task_failed with timestamps and
devices), `plan.json` (each task's memory estimate) and `gpu_monitor.jsonl` (NVML samples).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path


def _jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def intervals(run_dir: Path) -> list[tuple[float, float, str, list[int]]]:
    """(start, end, task id, devices) of every task attempt in the journal."""
    started: dict[str, tuple[float, list[int]]] = {}
    out = []
    for e in _jsonl(Path(run_dir) / "journal.jsonl"):
        if e["event"] == "task_running":
            started[e["task"]] = (e["ts"], e.get("devices", []))
        elif e["event"] in ("task_done", "task_failed") and e["task"] in started:
            t0, devs = started.pop(e["task"])
            out.append((t0, e["ts"], e["task"], devs))
    return out


def packing(run_dir: Path) -> dict:
    """Most tasks at once on one device, and the most memory their estimates reserved there."""
    plan = {t["id"]: t for t in json.loads((Path(run_dir) / "plan.json").read_text())["tasks"]}
    spans = intervals(run_dir)
    events = sorted(
        [(s, 1, tid, d) for s, _, tid, d in spans] + [(e, -1, tid, d) for _, e, tid, d in spans],
        key=lambda x: (x[0], x[1]),
    )  # ends before starts at the same instant
    running: dict[int, dict[str, int]] = {}
    most_tasks, most_mb = 0, 0
    for _, kind, tid, devs in events:
        task = plan[tid]
        per_device = -(-int(task["mem_mb"]) // max(1, int(task["gpus"])))
        for d in devs:
            on = running.setdefault(d, {})
            if kind == 1:
                on[tid] = per_device
            else:
                on.pop(tid, None)
            most_tasks = max(most_tasks, len(on))
            most_mb = max(most_mb, sum(on.values()))
    return {
        "tasks": len(plan),
        "max_tasks_on_a_device": most_tasks,
        "max_reserved_mb_on_a_device": most_mb,
    }


def busy_utilisation(run_dir: Path) -> dict:
    """Median / mean NVML utilisation of the samples taken while at least one task ran."""
    spans = [(s, e) for s, e, _, _ in intervals(run_dir)]
    samples = [
        r for r in _jsonl(Path(run_dir) / "gpu_monitor.jsonl") if r.get("utilization") is not None
    ]
    busy = [r["utilization"] for r in samples if any(s <= r["ts"] <= e for s, e in spans)]
    used = [r["total_mb"] - r["free_mb"] for r in samples if r.get("free_mb") is not None]
    return {
        "utilisation_samples": len(busy),
        "median_utilisation_pct": statistics.median(busy) if busy else None,
        "mean_utilisation_pct": round(statistics.mean(busy), 1) if busy else None,
        "peak_device_memory_used_mb": max(used) if used else None,
    }


def task_peaks(run_dir: Path) -> dict:
    """The measured peaks tasks recorded in result.json (CUDA only)."""
    peaks = []
    for p in Path(run_dir).glob("tasks/*/result.json"):
        peak = json.loads(p.read_text()).get("peak_gpu_mb")
        if peak:
            peaks.append(peak)
    return {"tasks_with_peak": len(peaks), "max_task_peak_mb": max(peaks) if peaks else None}
