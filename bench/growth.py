"""Growth at a checkpoint (issue 32 item 3, resize): seconds from a resize request to the next
optimizer step on the larger gang, per k, beside the same-run baseline of dispatching the
same task on k ranks from the start.

    python bench/growth.py                 # k = 2 and 4 (fake:k), ~2 min on 2 cores
    python bench/growth.py --ks 2 --steps 300

Prints ONE JSON object. Everything runs for real: `experiment=smoke`'s pretrain task (the
tiny model, `training.parallel_strategy=data_parallel`), a warm `WorkerPool` of real worker
processes on `fake:k` (their forkservers preloaded with torch, as run.py does for elastic
tasks), `DagRunner`, the pita/runtime/gang.py launcher (torch's `elastic_launch`), the
task's own `Checkpointer`. Per k:

- `dispatch_s`: the task dispatched on k ranks: journal `task_running` -> its log's
  first-step line (`pita.training.checkpoint.FIRST_STEP`, logged by rank 0 once per
  attempt): worker hand-over, k rank processes, rendezvous, model and data, first step.
  Measured twice; `dispatch_first_gang_s` is the first (the worker's forkserver may still
  be preloading), `dispatch_s` the second (warm, as a resize's restart finds it).
- `resize_s`: the task dispatched on 1 rank with k - 1 devices idle; once it reported
  progress and the devices were idle 1 s, the `Grower` (a curve that makes growth pay at
  once) asks it to grow: journal `task_grow_requested`
  -> the resumed attempt's first-step line. Split into `stop_s` (request -> `task_stopped`:
  the step in flight, the checkpoint written, the worker's answer), `redispatch_s`
  (`task_stopped` -> `task_running`: the scheduler's round) and `restart_s` (`task_running`
  -> first step on k ranks: as `dispatch_s`, plus reading the checkpoint).
- `stopped_at_step`, `steps`: where the one-rank attempt stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from omegaconf import OmegaConf  # noqa: E402

from bench.scheduler import warm_up  # noqa: E402
from pita.core.dag import Plan  # noqa: E402
from pita.core.elastic import rank_choices, set_ranks  # noqa: E402
from pita.core.growth import Grower, GrowthPolicy  # noqa: E402
from pita.core.journal import Journal, read_events  # noqa: E402
from pita.core.parallel_executor import DagRunner  # noqa: E402
from pita.core.worker_pool import WorkerPool  # noqa: E402
from pita.experiment.cli import compose_config  # noqa: E402
from pita.experiment.config import validate  # noqa: E402
from pita.experiment.run import build_plan, make_gpu_manager, make_scheduler  # noqa: E402

FIRST_STEP_LINE = re.compile(r"^\[([\d-]+ [\d:,]+)\]\[INFO\] step (\d+) done: the first optim")


def config(k: int, steps: int):
    cfg = compose_config(
        [
            "experiment=smoke",
            f"system.devices='fake:{k}'",
            "executor.max_tasks_per_gpu=1",
            "training.parallel_strategy=data_parallel",
            f"executor.max_ranks_per_task={k}",
            f"pretrain.steps={steps}",
        ]
    )
    validate(cfg, project_root=ROOT)
    return cfg


def first_steps(log: Path) -> list[tuple[float, int]]:
    """(unix time, step) of each first-step line of a task log."""
    out = []
    for line in log.read_text().splitlines():
        m = FIRST_STEP_LINE.match(line)
        if m:
            when = datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            out.append((when, int(m[2])))
    return out


def run_once(pool, cfg, task, run_dir: Path, grower) -> list[dict]:
    """The one-task plan through DagRunner; its journal's events."""
    run_dir.mkdir(parents=True)
    journal = Journal(run_dir / "journal.jsonl")
    runner = DagRunner(
        Plan(tasks={task.id: task}),
        pool,
        make_scheduler(cfg, pool.gpu),
        cfg_dict=OmegaConf.to_container(cfg, resolve=True),
        run_dir=str(run_dir),
        journal=journal,
        max_retries=0,
        grower=grower,
    )
    summary = runner.run()
    journal.close()
    if not summary.ok:
        raise RuntimeError(f"benchmark run failed: {summary.failed}")
    return read_events(run_dir / "journal.jsonl")


def ts(events: list[dict], event: str, nth: int = 0) -> float:
    return [e["ts"] for e in events if e["event"] == event][nth]


def measure(k: int, steps: int, tmp: Path) -> dict:
    cfg = config(k, steps)
    gpu = make_gpu_manager(cfg)
    like = next(t for t in build_plan(cfg, gpu).tasks.values() if t.stage == "pretrain")
    like.ranks = rank_choices(k, k)
    pool = WorkerPool.from_config(gpu, cfg.executor)
    pool.extra_env["PITA_WARM_FORKSERVER"] = "1"  # as run.py does for elastic tasks
    short = config(k, 10)  # the baseline needs its first step only
    try:
        warm_up(pool, gpu, tmp / f"warm{k}")
        # baseline: dispatched on k ranks from the start, twice (the first gang of a worker
        # may wait for its forkserver's preload; a resize's restart finds it warm)
        set_ranks(like, k)
        dispatch = []
        for i in range(2):
            folder = tmp / f"dispatch{k}.{i}"
            events = run_once(pool, short, like, folder, None)
            [(first, _)] = first_steps(folder / "tasks" / like.id / "log.txt")
            dispatch.append(first - ts(events, "task_running"))
        # resize: on 1 rank, grown to k once it trains (progress seen) and the others idle 1 s
        set_ranks(like, 1)
        policy = GrowthPolicy(
            seconds=lambda t, r: 1000.0 / r,
            startup=lambda r: 0.0,
            choices=lambda t: [1, k],
            needs_progress=True,  # the request lands mid-training, not in its start-up
        )
        run_dir = tmp / f"resize{k}"

        def progress() -> dict[str, str]:
            return {w["task"]: str(w.get("progress") or "") for w in pool.workers() if w["task"]}

        grower = Grower(policy, run_dir, growable=lambda t: True, progress=progress, idle_s=1.0)
        events = run_once(pool, cfg, like, run_dir, grower)
    finally:
        pool.shutdown()
    [(resumed, _)] = first_steps(run_dir / "tasks" / like.id / "log.txt")
    [stopped_folder] = (run_dir / "tasks").glob(f"{like.id}.attempt1.stopped-at-*")
    asked, stopped = ts(events, "task_grow_requested"), ts(events, "task_stopped")
    redispatched = ts(events, "task_running", 1)
    [resized] = [e for e in events if e["event"] == "task_resized"]
    return {
        "dispatch_s": round(dispatch[1], 3),
        "dispatch_first_gang_s": round(dispatch[0], 3),
        "resize_s": round(resumed - asked, 3),
        "stop_s": round(stopped - asked, 3),
        "redispatch_s": round(redispatched - stopped, 3),
        "restart_s": round(resumed - redispatched, 3),
        "ranks": [resized["previous"], resized["ranks"]],
        "stopped_at_step": int(stopped_folder.name.rsplit("-", 1)[1]),
        "steps": steps,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", default="2,4", help="gang sizes (fake:k devices each)")
    parser.add_argument("--steps", type=int, default=400, help="pretrain steps of the task")
    parser.add_argument("--keep", action="store_true", help="keep the run folders (tmp)")
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="pita-bench-growth-"))
    try:
        out = {"by_k": {k: measure(int(k), args.steps, tmp) for k in args.ks.split(",")}}
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    out["kept"] = str(tmp) if args.keep else None
    out["load_average"] = [round(x, 2) for x in os.getloadavg()]
    out["cpus"] = os.cpu_count()
    out["time"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
