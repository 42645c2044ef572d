"""executor=ray on a simulated cluster against the local executor with the same slots (issue 41).

Two figures, each against its local baseline in the same run, printed as one JSON object:

- `warm`: an experiment (`--experiment`, default `smoke`; the issue asks for the default
  experiment, which takes minutes more on a 2-core machine) on a one-node simulated Ray
  cluster of `--slots` CPUs against `executor=local` on `system.devices=cpu` with as many
  CPU workers: `ray_over_local_wall` (target <= 1.25).
- `dag`: the default experiment's DAG (every algorithm, goal-walk, the test sleep stage:
  `task.work` x `--sleep` s each, so both runs do the same work) on a simulated 2 x 4 Ray
  cluster against local `fake:8`: each run's speedup = the tasks' summed seconds / the
  run's wall (first start to last end, from the journal); `ray_over_local_speedup`
  (target >= 0.9).

Simulated nodes share this machine's cores (Ray's `cluster_utils.Cluster`, as Ray's own
tests do): the figures say what pita's Ray path costs over its local path, not how a real
cluster scales.

    python bench/ray_cluster.py                 # both
    python bench/ray_cluster.py --only dag
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.conftest import sleep_overrides  # noqa: E402  (the test sleep stage's overrides)


def _run(args: list[str], cwd: Path, env: dict | None = None) -> tuple[float, Path]:
    """One command-line run to its end: (process wall seconds, its run folder)."""
    t0 = time.time()
    done = subprocess.run(
        [sys.executable, str(ROOT / "run_parallel.py"), *args, "executor.progress=false"],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        capture_output=True,
        text=True,
    )
    wall = time.time() - t0
    if done.returncode != 0:
        raise SystemExit(f"run failed ({done.returncode}): {done.stderr[-2000:]}")
    [run_dir] = [p for p in (cwd / "outputs").glob("*/*") if p.is_dir()]
    return wall, run_dir


def _speedup(run_dir: Path) -> dict:
    """Tasks' summed seconds / the span from the first start to the last end."""
    events = [json.loads(ln) for ln in (run_dir / "journal.jsonl").read_text().splitlines()]
    starts = [e["ts"] for e in events if e["event"] == "task_running"]
    ends = [e["ts"] for e in events if e["event"] == "task_done"]
    work = sum(e["wall_s"] for e in events if e["event"] == "task_done")
    span = max(ends) - min(starts)
    return {
        "tasks": len(ends),
        "task_s": round(work, 1),
        "span_s": round(span, 1),
        "speedup": round(work / span, 2),
    }


class _Cluster:
    """A simulated cluster: a head without CPUs and `nodes` nodes of `cpus` CPUs each."""

    def __init__(self, nodes: int, cpus: int):
        from ray.cluster_utils import Cluster

        os.environ["RAY_AUTH_MODE"] = "disabled"  # the CLI runs inherit it (no token)
        self.cluster = Cluster(
            initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False}
        )
        for _ in range(nodes):
            self.cluster.add_node(num_cpus=cpus)
        self.cluster.wait_for_nodes()

    def __enter__(self) -> str:
        return self.cluster.address

    def __exit__(self, *exc: object) -> None:
        self.cluster.shutdown()


def warm(experiment: str, slots: int) -> dict:
    args = [f"experiment={experiment}"]
    with tempfile.TemporaryDirectory() as local_dir:
        local, local_run = _run(
            [*args, "system.devices=cpu", f"executor.cpu_workers={slots}"], Path(local_dir)
        )
        local_tasks = _speedup(local_run)
    ray_dir = tempfile.mkdtemp(prefix="pita-bench-ray-")  # kept: its journal says where time went
    with _Cluster(1, slots) as address:
        ray_wall, ray_run = _run(
            [*args, "executor=ray", f"executor.ray_address={address}"], Path(ray_dir)
        )
        ray_tasks = _speedup(ray_run)
    return {
        "experiment": experiment,
        "slots": slots,
        "local_wall_s": round(local, 1),
        "ray_wall_s": round(ray_wall, 1),
        "local_tasks": local_tasks,  # the tasks' own seconds, and first start to last end
        "ray_tasks": ray_tasks,
        "ray_run": str(ray_run),  # kept for its journal and results/time.md
        "ray_over_local_wall": round(ray_wall / local, 3),
        "target": "<= 1.25",
    }


def dag(sleep: float) -> dict:
    args = [*sleep_overrides(), "training.parallel_strategy=none"]
    env = {"PITA_TEST_SLEEP": str(sleep)}
    os.environ.update(env)  # the simulated nodes' workers inherit it from this process
    with tempfile.TemporaryDirectory() as local_dir:
        _, run_dir = _run([*args, "system.devices=fake:8"], Path(local_dir), env)
        local = _speedup(run_dir)
    with _Cluster(2, 4) as address, tempfile.TemporaryDirectory() as ray_dir:
        _, run_dir = _run(
            [*args, "executor=ray", f"executor.ray_address={address}"], Path(ray_dir), env
        )
        ray = _speedup(run_dir)
    return {
        "sleep_per_work_unit_s": sleep,
        "local_fake8": local,
        "ray_2x4": ray,
        "ray_over_local_speedup": round(ray["speedup"] / local["speedup"], 3),
        "target": ">= 0.9",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("warm", "dag"))
    parser.add_argument("--experiment", default="smoke")
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--sleep", type=float, default=0.5)
    args = parser.parse_args()
    out: dict = {"cores": os.cpu_count(), "load_at_start": os.getloadavg()[0]}
    if args.only in (None, "dag"):
        out["dag"] = dag(args.sleep)
    if args.only in (None, "warm"):
        out["warm"] = warm(args.experiment, args.slots)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
