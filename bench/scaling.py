"""Scaling benchmark: the default experiment's DAG on fake:1/2/4/8 with training tasks rigid
(one device each) against sized at dispatch (k chosen by simulating the rest of the plan,
pita/core/elastic.py), side by side in one run, at full scale.

    python bench/scaling.py                       # full scale: 765 task-seconds, ~20 min
    python bench/scaling.py --quick               # 120 task-seconds (start-up not scaled)
    python bench/scaling.py --sigma 0.4 --seeds 1,2,3   # + durations off by lognormal noise
    python bench/scaling.py --dry-run-cost        # sizing cost on the 34,292-task dry run
    python bench/scaling.py --journal outputs/goal_walk/<run>/journal.jsonl   # your run's
    python bench/scaling.py --profile star_graph_paper --total-s 765   # the paper profile

Prints ONE JSON object. Everything runs for real: the planner builds the default
experiment's DAG for `fake:N` (one collect / evaluate shard per device, merges, the shared
pretrain), `DagRunner` drives a warm `WorkerPool` of real worker processes (one task per
device), and every task sleeps its measured duration (`bench/default_task_seconds.json`:
the `task_done` seconds of a real default run; a sharded stage's seconds split evenly over
the plan's N shards). A training task (pretrain, reward_model, train: every training stage,
as issue 31 item 2 makes them run on a gang) is elastic in the `dispatch` mode: the
`Sizer` picks its k and it sleeps (one-rank seconds) / s(k), s(k) = k / (1 + alpha (k-1)),
on each rank of a real gang (`bench.workload:gang_stage` -> pita/runtime/gang.py
`run_stage` -> torch's `elastic_launch`: k rank processes and their rendezvous), so the
gang's real start-up (a fresh worker for the gang's device set, its forkserver, the ranks,
the rendezvous) is inside the makespan. The Sizer knows the measured durations (as the
duration cache would), alpha, and the start-up measured at the start of the run per k.

- `speedup`: makespan on one device / makespan on N; `fake:1` is the sum of its task
  seconds (one device runs them one after another; dispatch costs ~3 ms a task) unless
  `--run-baseline`;
- `rigid_bound`: what no rigid schedule beats, total work / max(critical path, work / N);
- `startup`: per k, seconds from dispatch to the first step of a k-rank gang hosted by an
  idle one-device worker whose forkserver has preloaded torch (its ranks forked from it,
  their rendezvous), twice (`fresh_s`: the first gang of that size, `warm_s`: the next);
  the Sizer is given `fresh_s`. The first gang of a worker whose forkserver is still
  preloading waits for it (~10-15 s here under load): the bench warms every worker's first.
Makespans run from the first dispatch to the last completion.

`--profile star_graph_paper` runs the same modes on the plan of `experiment=star_graph_paper
'experiment.datasets=[star_graph_d2_l5]'` (the planner's DAG for fake:N, 32 tasks on one
device) with the durations of `bench/star_graph_task_seconds.json` (a real run of that
profile scaled down by one factor, its task seconds multiplied back: see the file's `how`).
Its full scale is days of CPU time: pass `--total-s` to compress it.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # bench.workload, here and in the workers

from omegaconf import OmegaConf  # noqa: E402

from bench.scheduler import lower_bound, warm_up  # noqa: E402
from pita.core.dag import Plan  # noqa: E402
from pita.core.elastic import TRAINING_STAGES, GangStartup, rank_choices, resized  # noqa: E402
from pita.core.journal import Journal  # noqa: E402
from pita.core.parallel_executor import DagRunner  # noqa: E402
from pita.core.progress import TaskDurations  # noqa: E402
from pita.core.tasks import TASK_STAGES, TaskSpec  # noqa: E402
from pita.core.worker_pool import WorkerPool  # noqa: E402
from pita.experiment.cli import compose_config  # noqa: E402
from pita.experiment.config import validate  # noqa: E402
from pita.experiment.run import build_plan, make_gpu_manager, make_scheduler  # noqa: E402
from pita.experiment.sizing import make_sizer  # noqa: E402

GUIDE = {1: 1.0, 2: 1.8, 4: 3.5, 8: 6.75}  # docs/guides/gpu_execution.txt (8: "~6.5-7x")
TARGET = {2: 1.9, 4: 3.5, 8: 5.5}  # issue 32, alpha = 0.1, start-up included


@dataclass(frozen=True)
class Profile:
    """An experiment the bench plans (Hydra overrides) and the measured seconds of its tasks."""

    overrides: tuple[str, ...]
    measured: Path


PROFILES = {
    "default": Profile((), ROOT / "bench" / "default_task_seconds.json"),
    "star_graph_paper": Profile(
        ("experiment=star_graph_paper", "experiment.datasets=[star_graph_d2_l5]"),
        ROOT / "bench" / "star_graph_task_seconds.json",
    ),
}
SHARD = re.compile(r"^(?P<base>.+)\.s\d\d$")
WORKLOAD = "bench.workload:gang_stage"


def measured_seconds(journal: Path | None, profile: Profile) -> tuple[dict[str, float], str]:
    """Task id -> seconds of a real run of the profile's experiment, and where they come from."""
    if journal is None:
        data = json.loads(profile.measured.read_text())
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


def config(n: int, max_ranks: int, profile: Profile = PROFILES["default"]):
    cfg = compose_config(
        [
            *profile.overrides,
            f"system.devices='fake:{n}'",
            "executor.max_tasks_per_gpu=1",
            "training.parallel_strategy=data_parallel",
            f"executor.max_ranks_per_task={max_ranks}",
        ]
    )
    cfg.executor.stage_overrides = {"any": {stage: WORKLOAD for stage in TASK_STAGES}}
    validate(cfg, project_root=ROOT)
    return cfg


def elastic_plan(cfg, gpu, elastic: bool) -> Plan:
    """The default DAG; every training task elastic (dispatch mode) or on one device."""
    plan = build_plan(cfg, gpu)
    n = len(gpu.devices)
    for t in plan.tasks.values():
        t.gpus, t.strategy = 1, "none"
        t.ranks = rank_choices(n, n) if elastic and t.stage in TRAINING_STAGES else []
    return plan


def gang_task(like: TaskSpec, k: int, i: int) -> TaskSpec:
    """A 0-second copy of a training task on k ranks (its own id and task folder)."""
    return replace(resized(like, k), id=f"startup.k{k}.{i}", deps=[], inputs={})


def measure_startup(
    pool, cfg, like: TaskSpec, ks: list[int], run_dir: Path
) -> dict[str, dict[str, float]]:
    """Per k: dispatch -> first step of a fresh k-rank gang, and of a second one on the same
    devices right after (warm worker and forkserver); 0-second tasks."""
    run_dir.mkdir(parents=True, exist_ok=True)
    table = {gang_task(like, k, i).id: 0.0 for k in ks for i in (0, 1)}
    (run_dir / "bench_durations.json").write_text(json.dumps(table))
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    n = len(pool.gpu.devices)
    table.update({f"startup.host{d}": 0.0 for d in range(n)})
    (run_dir / "bench_durations.json").write_text(json.dumps(table))
    for d in range(n):  # each worker's forkserver has preloaded torch (as during a real run)
        host = replace(resized(like, 2), id=f"startup.host{d}", deps=[], inputs={})
        pool.submit(host, [d, (d + 1) % n], cfg_dict, str(run_dir), 1).result(600)
    out: dict[str, dict[str, float]] = {}
    for k in ks:
        row = {}
        for i, name in ((0, "fresh_s"), (1, "warm_s")):
            task = gang_task(like, k, i)
            t0 = time.time()
            outcome = pool.submit(task, list(range(k)), cfg_dict, str(run_dir), 1).result(600)
            if not outcome.ok:
                raise RuntimeError(f"gang of {k} failed: {outcome.failure}: {outcome.message}")
            # the stage measured its own start to rank 0's first step; the rest is dispatch
            in_task = float(outcome.result["gang_startup_s"])
            row[name] = round(in_task + max(0.0, time.time() - t0 - outcome.wall_s), 3)
            row[name.replace("_s", "_in_task_s")] = round(in_task, 3)
        out[str(k)] = row
    return out


def run_mode(
    n: int,
    mode: str,
    measured: dict[str, float],
    scale: float,
    alpha: float,
    tmp: Path,
    noise: tuple[float, int] | None = None,
    profile: Profile = PROFILES["default"],
) -> dict:
    """One (devices, mode) run: the plan, its durations (maybe drawn around the measured
    ones), a warm pool, start-up measured, DagRunner with or without the Sizer."""
    elastic = mode in ("dispatch", "grow")
    cfg = config(n, n if elastic else 1, profile)
    gpu = make_gpu_manager(cfg)
    plan = elastic_plan(cfg, gpu, elastic)
    estimate, unmatched = durations_for(plan, measured, scale)
    actual = dict(estimate)
    if noise is not None:
        sigma, seed = noise
        rng = random.Random(seed)
        actual = {tid: round(s * math.exp(rng.gauss(0.0, sigma)), 3) for tid, s in estimate.items()}
    run_dir = tmp / f"{mode}{n}" / (f"seed{noise[1]}" if noise else "")
    pool = WorkerPool.from_config(gpu, cfg.executor)
    if elastic:
        pool.extra_env["PITA_WARM_FORKSERVER"] = "1"  # as run.py does for elastic tasks
    scheduler = make_scheduler(cfg, gpu)
    scheduler.host = None  # the stand-in tasks sleep: they share no cores (host_share.py)
    startup: dict[str, dict[str, float]] = {}
    sizer = None
    try:
        warm_up(pool, gpu, run_dir / "warmup")
        ks = [k for k in (2, 4, 8) if k <= n] if elastic else []
        if ks:
            like = next(t for t in plan.tasks.values() if t.elastic)
            startup = measure_startup(pool, cfg, like, ks, run_dir / "startup")
            warm_up(pool, gpu, run_dir / "warmup2")  # one-device workers back for the run
            durations = TaskDurations(estimate, key=lambda t: t.id)  # the "duration cache"
            sizer = make_sizer(cfg, plan.tasks, durations, scheduler, history={})
            sizer.curves.default_alpha = alpha
            sizer.curves.startup = GangStartup(
                {1: 0.0, **{int(k): v["fresh_s"] for k, v in startup.items()}}
            )
        grow = mode == "grow" and sizer is not None
        result = run_dag(plan, pool, scheduler, cfg, actual, alpha, run_dir / "run", sizer, grow)
    finally:
        pool.shutdown()
    _, critical, total = lower_bound(plan, actual, n)
    ranks = {
        tid: t.gpus for tid, t in plan.tasks.items() if t.elastic and t.gpus > 1
    }  # what the Sizer chose
    return {
        "tasks": len(plan.tasks),
        "unmeasured_tasks": unmatched,
        "total_work_s": round(total, 3),
        "critical_path_s": round(critical, 3),
        "rigid_bound": round(total / max(critical, total / n), 2),
        "startup": startup,
        "ranks_chosen": ranks,
        **result,
    }


def run_dag(plan, pool, scheduler, cfg, actual, alpha, run_dir: Path, sizer, grow=False) -> dict:
    run_dir.mkdir(parents=True)
    table = {**actual, "_alpha": alpha, **({"_grow": 1} if grow else {})}
    (run_dir / "bench_durations.json").write_text(json.dumps(table))
    dispatched: dict[str, float] = {}
    ends: list[float] = []

    def on_event(kind: str, task: TaskSpec, info) -> None:
        if kind == "running":
            dispatched.setdefault(task.id, time.perf_counter())
        elif kind == "done":
            ends.append(time.perf_counter())

    journal = Journal(run_dir / "journal.jsonl")
    runner = DagRunner(
        plan,
        pool,
        scheduler,
        cfg_dict=OmegaConf.to_container(cfg, resolve=True),
        run_dir=str(run_dir),
        journal=journal,
        max_retries=0,
        on_event=on_event,
        sizer=sizer,
        grower=grower(sizer, run_dir) if grow else None,
    )
    summary = runner.run()
    journal.close()
    if not summary.ok:
        raise RuntimeError(f"benchmark run failed: {dict(list(summary.failed.items())[:3])}")
    decisions = list(sizer.decisions.values()) if sizer else []
    grown = [e for e in journal_events(run_dir) if e.get("why") == "grow"]
    first = next((d for d in decisions if d.predicted), None)  # at the run's start
    return {
        "makespan_s": round(max(ends) - min(dispatched.values()), 3),
        "sizing_decisions": len(decisions),
        "sizing_ms_max": round(1000 * max(d.cost_s for d in decisions), 1) if decisions else 0.0,
        "predicted_makespan_s": round(min(first.predicted.values()), 1) if first else None,
        "grown": {e["task"]: [e["previous"], e["ranks"]] for e in grown},
    }


def grower(sizer, run_dir: Path):
    """pita/core/growth.py's Grower as a run builds it (`Grower.for_sizer`), for the bench's
    elastic stand-in tasks (their stage is bench.workload:gang_stage, not pita's loops)."""
    from pita.core.growth import Grower, GrowthPolicy

    policy = GrowthPolicy(
        seconds=lambda t, k: sizer.seconds(t, k),
        startup=sizer.curves.startup,
        choices=sizer.ranks_of,
    )
    return Grower(policy, run_dir, growable=lambda t: t.elastic, idle_s=2.0, wait_s=10.0)


def journal_events(run_dir: Path) -> list[dict]:
    from pita.core.journal import read_events

    return read_events(run_dir / "journal.jsonl")


def dry_run_cost() -> dict:
    """The sizing cost on the 34,292-task dry run (20 rounds of every algorithm on goal-walk
    and star graph, fake:64), every training task elastic."""
    from pita.experiment.run import task_durations
    from pita.experiment.sizing import dry_run_sizing

    cfg = compose_config(
        [
            "rounds_of_training=20",
            "system.devices=fake:64",
            "experiment.datasets=[goal_walk,star_graph]",
            "training.parallel_strategy=data_parallel",
            "executor.max_ranks_per_task=8",
        ]
    )
    validate(cfg, project_root=ROOT)
    gpu = make_gpu_manager(cfg)
    t0 = time.perf_counter()
    plan = build_plan(cfg, gpu)
    plan_s = time.perf_counter() - t0
    for t in plan.tasks.values():
        t.ranks = rank_choices(8, 64) if t.stage in TRAINING_STAGES else []
    scheduler = make_scheduler(cfg, gpu)
    sizer = make_sizer(cfg, plan.tasks, task_durations(cfg, gpu), scheduler, history={})
    out = dry_run_sizing(plan, scheduler, sizer)
    simulated = [s for s in sizer.decisions.values() if s.simulated]
    return {
        "tasks": len(plan.tasks),
        "elastic_tasks": sum(t.elastic for t in plan.tasks.values()),
        "planning_s": round(plan_s, 2),
        "simulated_decisions": len(simulated),
        "sizing_s": round(out["sizing_s"], 2),
        "dry_run_simulation_s": round(out["simulation_s"], 2),
        "sizing_ms_median": round(1000 * statistics.median(s.cost_s for s in simulated), 1)
        if simulated
        else 0.0,
        "makespan_s": round(out["makespan_s"], 1),
        "rigid_makespan_s": round(out["rigid_makespan_s"], 1),
        "ranks": {
            str(k): sum(1 for t in plan.tasks.values() if t.elastic and t.gpus == k)
            for k in (1, 2, 4, 8)
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="rigid vs sized at dispatch (prints one JSON)")
    parser.add_argument("--devices", default="2,4,8", help="device counts, e.g. 2,4,8 (none)")
    parser.add_argument("--modes", default="rigid,dispatch,grow", help="rigid,dispatch,grow")
    parser.add_argument("--profile", choices=sorted(PROFILES), default="default")
    parser.add_argument("--journal", type=Path, help="a run of the profile: its journal.jsonl")
    parser.add_argument("--alpha", type=float, default=0.1, help="s(k) = k / (1 + alpha (k-1))")
    parser.add_argument("--quick", action="store_true", help="120 task-seconds, not full scale")
    parser.add_argument("--total-s", type=float, default=0.0, help="scale the DAG to this")
    parser.add_argument("--sigma", type=float, default=0.0, help="lognormal noise on fake:8")
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--run-baseline", action="store_true", help="run fake:1 for real")
    parser.add_argument("--dry-run-cost", action="store_true")
    args = parser.parse_args(argv)
    if args.dry_run_cost:
        print(json.dumps({"dry_run_cost": dry_run_cost()}, indent=2))
        return 0
    profile = PROFILES[args.profile]
    measured, source = measured_seconds(args.journal, profile)
    total_s = args.total_s or (120.0 if args.quick else sum(measured.values()))
    scale = total_s / sum(measured.values())
    counts = sorted(int(x) for x in args.devices.split(",") if x.strip() not in ("", "none"))
    modes = args.modes.split(",")
    t_start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="pita-scaling-"))
    runs: dict[str, dict] = {}
    try:
        cfg1 = config(1, 1, profile)
        plan1 = elastic_plan(cfg1, make_gpu_manager(cfg1), False)
        base_seconds, _ = durations_for(plan1, measured, scale)
        if args.run_baseline:
            base = run_mode(1, "rigid", measured, scale, args.alpha, tmp, profile=profile)
            base = base["makespan_s"]
        else:
            base = round(sum(base_seconds.values()), 3)
        for n in counts:
            for mode in modes:
                r = run_mode(n, mode, measured, scale, args.alpha, tmp, profile=profile)
                r["speedup"] = round(base / r["makespan_s"], 2)
                runs[f"{mode}/fake:{n}"] = r
        noisy = {}
        if args.sigma > 0:
            for seed in (int(s) for s in args.seeds.split(",")):
                for mode in modes:
                    noise = (args.sigma, seed)
                    r = run_mode(8, mode, measured, scale, args.alpha, tmp, noise, profile)
                    # the baseline with the same draws: one device runs their sum
                    r["speedup"] = round(r["total_work_s"] / r["makespan_s"], 2)
                    noisy[f"{mode}/fake:8/seed{seed}"] = r
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report = {
        "profile": args.profile,
        "measured": source,
        "task_seconds_one_device": base,
        "scale": round(scale, 4),
        "alpha": args.alpha,
        "speedups": {k: v["speedup"] for k, v in runs.items()},
        "targets": {f"dispatch/fake:{n}": TARGET[n] for n in counts if n in TARGET},
        "guide": {f"fake:{n}": GUIDE[n] for n in counts if n in GUIDE},
        "rigid_bounds": {f"fake:{n}": runs[f"{modes[0]}/fake:{n}"]["rigid_bound"] for n in counts},
        "runs": runs,
        "total_wall_s": 0.0,
    }
    if noisy:
        report["lognormal"] = {
            "sigma": args.sigma,
            "speedups": {k: v["speedup"] for k, v in noisy.items()},
            "mean": {
                m: round(
                    statistics.mean(v["speedup"] for k, v in noisy.items() if k.startswith(m)), 2
                )
                for m in modes
            },
            "runs": noisy,
        }
    report["total_wall_s"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
