"""Scaling benchmark: the default experiment's DAG on 1, 2, 4 and 8 devices, against the seed
guide's claim (~1.8x on 2 GPUs, ~3.5x on 4, ~6.5-7x on 8: docs/guides/gpu_execution.txt).

    python bench/scaling.py                          # measured durations in bench/, ~2-3 min
    python bench/scaling.py --journal outputs/goal_walk/<run>/journal.jsonl   # your run's
    python bench/scaling.py --devices 1,2,4 --total-s 20

Prints ONE JSON object. Everything runs for real, as in bench/scheduler.py: the planner
builds the default experiment's DAG for `fake:N` (one shard of collect / evaluate per
device, merges, the shared pretrain), `DagRunner` drives a warm `WorkerPool` of real worker
processes (one task per device, `executor.max_tasks_per_gpu=1`), and each task sleeps for
its measured duration (bench/workload.py), scaled down so that the whole DAG's task time is
`--total-s` seconds on one device. Measured durations: the `task_done` events of a real run
of the default experiment (`bench/default_task_seconds.json` holds one, with where and when
it was measured). A sharded stage's measured time (all its shards) is split evenly over the
N shards of the plan for `fake:N`: a shard's fixed cost (loading the models) is not counted
again, so the sharded stages scale a little better here than on real devices.

- `speedup`: makespan on one device / makespan on N, next to `guide` (the seed guide's claim);
- `bound_speedup`: the most the DAG allows, total work / max(critical path, total work / N),
  both from the durations the workers measured in that run; `critical_path_s` is the DAG's
  longest chain of dependent tasks (pretrain -> collect -> train -> evaluate ... per round);
- `efficiency`: speedup / bound_speedup (how close the scheduler gets to what the DAG allows).
Makespans run from the first dispatch to the last completion (worker start-up excluded).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # bench.workload, bench.scheduler, here and in the workers

from bench.scheduler import STAGES, WORKLOAD, lower_bound, run_dag, warm_up  # noqa: E402
from pita.core.dag import Plan  # noqa: E402
from pita.core.worker_pool import WorkerPool  # noqa: E402
from pita.experiment.cli import compose_config  # noqa: E402
from pita.experiment.config import validate  # noqa: E402
from pita.experiment.run import build_plan, make_gpu_manager  # noqa: E402

GUIDE = {1: 1.0, 2: 1.8, 4: 3.5, 8: 6.75}  # docs/guides/gpu_execution.txt (8: "~6.5-7x")
MEASURED = ROOT / "bench" / "default_task_seconds.json"
SHARD = re.compile(r"^(?P<base>.+)\.s\d\d$")


def measured_seconds(journal: Path | None) -> tuple[dict[str, float], str]:
    """Task id -> seconds of a real run of the default experiment, and where they come from."""
    if journal is None:
        data = json.loads(MEASURED.read_text())
        return {k: float(v) for k, v in data["task_seconds"].items()}, data["measured"]
    seconds = {}
    for line in Path(journal).read_text().splitlines():
        event = json.loads(line) if line.strip() else {}
        if event.get("event") == "task_done":
            seconds[event["task"]] = float(event.get("wall_s") or 0.0)
    return seconds, str(journal)


def durations_for(plan: Plan, measured: dict[str, float], scale: float) -> tuple[dict, int]:
    """Seconds of each task of `plan`: its measured time, a shard's share of its stage's
    measured shards; (durations, how many tasks had no measurement: mean time per unit)."""
    stage_total: dict[str, float] = {}
    for tid, s in measured.items():
        m = SHARD.match(tid)
        if m:
            stage_total[m["base"]] = stage_total.get(m["base"], 0.0) + s
    per_unit = sum(measured.values()) / max(1e-9, sum(t.work for t in plan.tasks.values()))
    out, unmatched = {}, 0
    for tid, t in plan.tasks.items():
        m = SHARD.match(tid)
        if tid in measured and not m:
            s = measured[tid]
        elif m and m["base"] in stage_total:
            s = stage_total[m["base"]] / t.num_shards
        else:
            s, unmatched = t.work * per_unit, unmatched + 1
        out[tid] = round(max(0.01, s * scale), 3)
    return out, unmatched


def config(n: int):
    cfg = compose_config([f"system.devices='fake:{n}'", "executor.max_tasks_per_gpu=1"])
    cfg.executor.stage_overrides = {"any": {stage: WORKLOAD for stage in STAGES}}
    validate(cfg, project_root=ROOT)
    return cfg


def run_on(n: int, measured: dict[str, float], scale: float, tmp: Path) -> dict:
    """The DAG planned for fake:n, run on n warm workers; its makespan and bounds."""
    cfg = config(n)
    gpu = make_gpu_manager(cfg)
    plan = build_plan(cfg, gpu)
    seconds, unmatched = durations_for(plan, measured, scale)
    pool = WorkerPool.from_config(gpu, cfg.executor)
    try:
        warm_up(pool, gpu, tmp / f"warmup{n}")
        dag = run_dag(plan, pool, gpu, cfg, seconds, barrier=False, run_dir=tmp / f"fake{n}")
    finally:
        pool.shutdown()
    _, critical, total = lower_bound(plan, seconds, n)
    return {
        "tasks": len(plan.tasks),
        "unmeasured_tasks": unmatched,
        "nominal_total_s": round(total, 3),
        "nominal_critical_path_s": round(critical, 3),
        **dag,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="scaling on fake:1,2,4,8 (prints one JSON)")
    parser.add_argument("--devices", default="1,2,4,8", help="device counts, e.g. 1,2,4")
    parser.add_argument("--journal", type=Path, help="a default-experiment run's journal.jsonl")
    parser.add_argument(
        "--total-s", type=float, default=40.0, help="the DAG's task seconds on one device"
    )
    args = parser.parse_args(argv)
    counts = sorted({1, *(int(x) for x in args.devices.split(","))})  # 1: the baseline
    measured, source = measured_seconds(args.journal)
    scale = args.total_s / sum(measured.values())
    t_start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="pita-scaling-"))
    try:
        runs = {n: run_on(n, measured, scale, tmp) for n in counts}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    base = runs[1]["makespan_s"]
    table = {}
    for n, r in runs.items():
        bound = r["total_work_s"] / max(r["critical_path_s"], r["total_work_s"] / n)
        speedup = base / r["makespan_s"]
        table[f"fake:{n}"] = {
            "speedup": round(speedup, 2),
            "guide": GUIDE.get(n),
            "bound_speedup": round(bound, 2),
            "efficiency": round(speedup / bound, 3),
            **r,
        }
    report = {
        "measured": source,
        "measured_task_seconds": round(sum(measured.values()), 1),
        "scale": round(scale, 5),
        "guide": "docs/guides/gpu_execution.txt: ~1.8x (2 GPUs), ~3.5x (4), ~6.5-7x (8)",
        "speedups": {k: v["speedup"] for k, v in table.items()},
        "bound_speedups": {k: v["bound_speedup"] for k, v in table.items()},
        "runs": table,
        "total_wall_s": round(time.perf_counter() - t_start, 1),
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
