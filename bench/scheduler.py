"""Scheduler benchmark: DAG makespan against its lower bound and a round barrier; dispatch overhead.

    python bench/scheduler.py                  # fake:8, about two minutes on 2 cores
    python bench/scheduler.py --quick          # fewer rounds and submits (CI smoke)
    python bench/scheduler.py --devices fake:8

Prints ONE JSON object. Everything runs for real: the planner builds the DAG of an
experiment (algos x datasets x rounds, sharded collect/evaluate, merges, shared pretrain),
`DagRunner` drives a warm `WorkerPool` of real worker processes on simulated GPUs (one
task per device, `executor.max_tasks_per_gpu=1`, so the lower bound below holds), and each
task sleeps for a duration drawn for it (bench/workload.py). The default workload is the
default experiment's seven algorithms on goal-walk and star graph, with the unevenness of
real runs: star graph stages take 3x goal-walk's, GRPO / GRPO-HF training 6x DPO's (it
generates and scores its own roll-outs), the value algorithms' training 1.5x; chains that
aggregate data (DAgger: every round's records are reused, so Q#, PITA, Q#-HF and DPO)
train (1 + r)x longer in round r while GRPO does not; a guided collect (rounds > 0 of the
value algorithms) takes 2x (bench/generation.py: guided decoding runs at ~0.5x the
unguided tokens/s); each task has +-40% noise that the planner's estimate (`task.work`,
the critical-path priority) does not know. On 8 devices the DAG is bound by its critical
path, which is where a round barrier costs: each round waits for its slowest chain.

- `dag_makespan_ratio`: makespan / max(critical path, total work / devices), both computed from
  the durations the workers measured for this run (`wall_s` of each task); makespan runs from
  the first dispatch to the last completion, worker start-up excluded (the pool is warm).
- `barrier_makespan_ratio`: the same workload and pool with `DagRunner(round_barrier=True)`,
  the original runner's policy (a round starts when every chain finished the previous one).
  Note: `DagRunner._ready` only counts tasks not yet dispatched, so its barrier lets a round
  start while tasks of the previous round still run; this baseline is slightly optimistic.
- `barrier_over_dag_makespan`: how much longer the barrier takes: what the DAG buys.
- `dispatch_overhead_ms_*`: the round trip of a no-op task on a warm worker
  (`tests.fault_stages:noop_stage`): submit -> future done, everything a task costs beyond
  its own work (pool, channel, config, task-folder commit, journal-free). The part outside
  the task's own measured wall time is `dispatch_outside_task_ms_median`.
Targets: ratio <= 1.05, overhead median <= 50 ms.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # bench.workload and tests.fault_stages, here and in the workers

from omegaconf import OmegaConf  # noqa: E402

from pita.core.dag import Plan, critical_path_priorities  # noqa: E402
from pita.core.errors import ConfigError  # noqa: E402
from pita.core.journal import Journal  # noqa: E402
from pita.core.parallel_executor import DagRunner  # noqa: E402
from pita.core.tasks import TASK_STAGES, TaskSpec  # noqa: E402
from pita.core.worker_pool import WorkerPool  # noqa: E402
from pita.experiment.cli import compose_config  # noqa: E402
from pita.experiment.config import validate  # noqa: E402
from pita.experiment.run import build_plan, make_gpu_manager, make_scheduler  # noqa: E402

WORKLOAD = "bench.workload:timed_stage"
STAGES = TASK_STAGES  # every stage a task can have
STAGE_S = {
    "pretrain": 0.8,
    "collect": 0.3,
    "collect_merge": 0.1,
    "reward_model": 0.4,
    "train": 0.3,
    "evaluate": 0.25,
    "evaluate_merge": 0.1,
}  # goal-walk seconds, before the algorithm's factor
DATASET_SCALE = {"star_graph": 3.0, "goal_walk": 1.0}  # star graph >> goal-walk
TRAIN_SCALE = {
    "GRPO": 6.0,
    "GRPO-HF": 6.0,
    "DPO": 1.0,
    "QSharp": 1.5,
    "PITA": 1.5,
    "QSharp-HF": 1.5,
}  # GRPO >> DPO
DAGGER = ("QSharp", "PITA", "QSharp-HF", "DPO")  # round r trains on rounds 0..r: (1 + r)x
GUIDED_COLLECT = 2.0  # guided decoding ~0.5x the unguided tokens/s (bench/generation.py)
NOISE = 0.4  # actual = estimate x U(0.6, 1.4)
MIN_S, MAX_S = 0.1, 10.0


def workload(args) -> tuple[object, object, Plan, dict[str, float]]:
    """Config, devices, the planned DAG (priorities from the estimates) and each task's actual seconds."""
    rounds = args.rounds or (2 if args.quick else 3)
    devices = (
        args.devices if args.devices.startswith("[") else f"'{args.devices}'"
    )  # [0,1] stays a list
    cfg = compose_config(
        [
            "experiment.datasets=[goal_walk,star_graph]",
            f"rounds_of_training={rounds}",
            "executor.max_shards=2",
            "executor.max_tasks_per_gpu=1",
            f"system.devices={devices}",
        ]
    )
    cfg.executor.stage_overrides = {"any": {stage: WORKLOAD for stage in STAGES}}
    validate(cfg, project_root=ROOT)
    gpu = make_gpu_manager(cfg)
    plan = build_plan(cfg, gpu)
    rng = random.Random(args.seed)
    actual = {}
    for t in plan.tasks.values():
        estimate = STAGE_S[t.stage] * DATASET_SCALE.get(t.dataset, 1.0)
        if t.stage == "train":
            estimate *= TRAIN_SCALE.get(t.algo, 1.0) * ((1 + t.round) if t.algo in DAGGER else 1)
        if t.stage == "collect" and t.round > 0 and t.algo in ("QSharp", "PITA", "QSharp-HF"):
            estimate *= GUIDED_COLLECT
        t.work = round(estimate, 3)
        actual[t.id] = round(
            min(MAX_S, max(MIN_S, estimate * rng.uniform(1 - NOISE, 1 + NOISE))), 3
        )
    critical_path_priorities(plan)
    return cfg, gpu, plan, actual


def lower_bound(
    plan: Plan, seconds: dict[str, float], n_devices: int
) -> tuple[float, float, float]:
    """(max(critical path, total / devices), critical path, total work) for these durations."""
    finish: dict[str, float] = {}
    for tid, t in plan.tasks.items():  # insertion order is topological
        finish[tid] = seconds[tid] + max((finish[d] for d in t.deps), default=0.0)
    critical, total = max(finish.values()), sum(seconds.values())
    return max(critical, total / n_devices), critical, total


def run_dag(
    plan: Plan, pool, gpu, cfg, actual: dict[str, float], *, barrier: bool, run_dir: Path
) -> dict:
    run_dir.mkdir(parents=True)
    (run_dir / "bench_durations.json").write_text(json.dumps(actual))
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    wall: dict[str, float] = {}
    dispatched: dict[str, float] = {}
    overhead_ms: list[
        float
    ] = []  # dispatch -> the runner sees it done, minus the task's own wall time

    def on_event(kind: str, task: TaskSpec, info) -> None:
        now = time.perf_counter()
        if kind == "running":
            dispatched[task.id] = now
        elif kind == "done":
            wall[task.id] = info.wall_s
            overhead_ms.append((now - dispatched[task.id] - info.wall_s) * 1000)

    journal = Journal(run_dir / "journal.jsonl")  # fsync'd per event, as in a real run
    runner = DagRunner(
        plan,
        pool,
        make_scheduler(cfg, gpu),
        cfg_dict=cfg_dict,
        run_dir=str(run_dir),
        journal=journal,
        max_retries=0,
        round_barrier=barrier,
        on_event=on_event,
    )
    summary = runner.run()
    makespan = time.perf_counter() - min(dispatched.values())
    journal.close()
    if not summary.ok:
        raise RuntimeError(f"benchmark run failed: {dict(list(summary.failed.items())[:3])}")
    bound, critical, total = lower_bound(plan, wall, len(gpu.devices))
    return {
        "makespan_s": round(makespan, 3),
        "lower_bound_s": round(bound, 3),
        "critical_path_s": round(critical, 3),
        "total_work_s": round(total, 3),
        "ratio": round(makespan / bound, 4),
        "task_overhead_ms_median": round(statistics.median(overhead_ms), 1),
    }


def warm_up(pool, gpu, run_dir: Path) -> None:
    """Start one worker per device and wait until each has imported torch and answered a no-op.

    Workers are started one after the other, each once the previous one has connected:
    `WorkerPool`'s listener has a backlog of 1 and can lose a connection when many workers
    connect at once (seen with 8), leaving that worker hung until start_timeout_s (300 s).
    """
    for d in gpu.devices:
        pool.warm_up([(d.index,)])
        deadline = time.time() + 60
        while any(w["state"] == "starting" for w in pool.workers()):
            if time.time() > deadline:
                raise RuntimeError(f"worker for device {d.index} did not connect within 60s")
            time.sleep(0.02)
    futures = [pool.submit(noop(900 + d.index), [d.index], {}, run_dir) for d in gpu.devices]
    for fut in futures:
        outcome = fut.result(timeout=300)
        if not outcome.ok:
            raise RuntimeError(
                f"warm-up failed on devices {outcome.devices}: {outcome.failure}: {outcome.message}"
            )


def noop(i: int) -> TaskSpec:
    return TaskSpec.standalone(
        f"bench.noop.{i:03d}", "bench", "noop", "tests.fault_stages:noop_stage"
    )


def dispatch_overhead(pool, cfg, run_dir: Path, n: int) -> dict:
    """Sequential no-op submits to one warm worker: round trip minus the task's own wall time."""
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    overhead, round_trip, task_wall = [], [], []
    for i in range(n):
        done_at: list[float] = []
        t0 = time.perf_counter()
        fut = pool.submit(noop(i), [0], cfg_dict, run_dir)
        fut.add_done_callback(
            lambda f, out=done_at: out.append(time.perf_counter())
        )  # when the answer lands
        outcome = fut.result(timeout=60)
        if not outcome.ok:
            raise RuntimeError(f"noop task failed: {outcome.failure}: {outcome.message}")
        rt = ((done_at[0] if done_at else time.perf_counter()) - t0) * 1000
        round_trip.append(rt)
        task_wall.append(outcome.wall_s * 1000)
        overhead.append(rt - outcome.wall_s * 1000)

    def p90(xs: list[float]) -> float:
        return sorted(xs)[min(len(xs) - 1, int(0.9 * len(xs)))]

    return {
        "dispatch_overhead_ms_median": round(statistics.median(round_trip), 2),
        "dispatch_overhead_ms_p90": round(p90(round_trip), 2),
        "dispatch_outside_task_ms_median": round(statistics.median(overhead), 2),
        "noop_task_wall_ms_median": round(statistics.median(task_wall), 2),
        "dispatch_submits": n,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="DAG scheduler benchmark (prints one JSON object)")
    parser.add_argument("--devices", default="fake:8", help="simulated GPUs, e.g. fake:4")
    parser.add_argument("--quick", action="store_true", help="2 rounds and 20 no-op submits")
    parser.add_argument(
        "--rounds", type=int, default=0, help="rounds of training (default 3, 2 with --quick)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the task-duration noise")
    args = parser.parse_args(argv)
    t_start = time.perf_counter()
    try:
        cfg, gpu, plan, actual = workload(args)
    except ConfigError as exc:
        print(f"error: --devices {args.devices}: {exc.messages[0]}", file=sys.stderr)
        return 2
    nominal_bound, nominal_cp, nominal_total = lower_bound(plan, actual, len(gpu.devices))

    tmp = Path(tempfile.mkdtemp(prefix="pita-bench-"))
    pool = WorkerPool.from_config(gpu, cfg.executor)
    try:
        t0 = time.perf_counter()
        warm_up(pool, gpu, tmp / "warmup")  # excluded from every figure below
        startup_s = time.perf_counter() - t0
        dag = run_dag(plan, pool, gpu, cfg, actual, barrier=False, run_dir=tmp / "dag")
        barrier = run_dag(plan, pool, gpu, cfg, actual, barrier=True, run_dir=tmp / "barrier")
        overhead = dispatch_overhead(pool, cfg, tmp / "noop", 20 if args.quick else 50)
    finally:
        pool.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)

    report = {
        "devices": args.devices,
        "n_devices": len(gpu.devices),
        "quick": args.quick,
        "seed": args.seed,
        "tasks": len(plan.tasks),
        "chains": len({t.chain for t in plan.tasks.values() if t.algo != "*"}),
        "rounds": int(cfg.rounds_of_training),
        "task_s": {
            "min": min(actual.values()),
            "max": max(actual.values()),
            "mean": round(statistics.mean(actual.values()), 3),
        },
        "nominal": {
            "lower_bound_s": round(nominal_bound, 3),
            "critical_path_s": round(nominal_cp, 3),
            "total_work_s": round(nominal_total, 3),
        },
        "dag_makespan_ratio": dag["ratio"],
        "barrier_makespan_ratio": barrier["ratio"],
        "barrier_over_dag_makespan": round(barrier["makespan_s"] / dag["makespan_s"], 4),
        "dag": dag,
        "barrier": barrier,
        **overhead,
        "worker_startup_s": round(startup_s, 2),
        "targets": {"dag_makespan_ratio": 1.05, "dispatch_overhead_ms_median": 50.0},
        "meets_targets": dag["ratio"] <= 1.05 and overhead["dispatch_overhead_ms_median"] <= 50.0,
        "total_wall_s": round(time.perf_counter() - t_start, 2),
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
