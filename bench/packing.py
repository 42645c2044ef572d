"""Packing on fake GPUs (CPU): `auto` packs tasks, admission never exceeds the memory.

    python bench/packing.py [--device-gb 2] [--sleep 0.15]

Runs the default experiment's DAG three times through the real command line on one
simulated GPU (`system.devices="fake:[<N>GB]"`), every stage replaced by a sleep in a real
worker (`tests.fault_stages:sleep_stage`; the orchestrator is what is measured), with
`executor.max_tasks_per_gpu` = 1, auto and 8. For each: wall time, the most tasks that
ran at once on the device and the most memory their estimates reserved there (from
journal.jsonl and plan.json). Prints one JSON object; `ok` is true when auto packed (more
than one task at once, when the host has the cores for it) and no configuration ever
reserved more than the device has.
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
sys.path.append(str(ROOT))

from bench.run_analysis import packing  # noqa: E402
from pita.core.paths import pythonpath_with  # noqa: E402
from pita.core.tasks import TASK_STAGES  # noqa: E402

STAGES = TASK_STAGES  # every stage a task can have


def run_once(max_tasks: str, device_gb: float, sleep: float, cwd: Path) -> dict:
    name = f"packing_{max_tasks}"
    args = [
        sys.executable,
        str(ROOT / "run_parallel.py"),
        f'system.devices="fake:[{device_gb}GB]"',
        f"executor.max_tasks_per_gpu={max_tasks}",
        f"experiment.name={name}",
        "executor.progress=false",
        *[f"+executor.stage_overrides.any.{s}=tests.fault_stages:sleep_stage" for s in STAGES],
    ]
    env = {
        **os.environ,
        "PYTHONPATH": pythonpath_with(ROOT, os.environ.get("PYTHONPATH")),
        "PITA_TEST_SLEEP": str(sleep),
    }
    t0 = time.perf_counter()
    r = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(
            f"max_tasks_per_gpu={max_tasks} failed ({r.returncode}): {r.stderr[-2000:]}"
        )
    [run_dir] = sorted((cwd / "outputs" / name).glob("*"))
    return {"wall_s": round(wall, 2), **packing(run_dir)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device-gb", type=float, default=2)
    ap.add_argument(
        "--sleep", type=float, default=0.15, help="seconds x task.work each task sleeps"
    )
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from pita.core.resources import host_cores, max_tasks_per_device

    device_mb = int(args.device_gb * 1024)
    with tempfile.TemporaryDirectory() as tmp:
        runs = {m: run_once(m, args.device_gb, args.sleep, Path(tmp)) for m in ("1", "auto", "8")}
    auto_cap = max_tasks_per_device("auto", "fake", 1)
    within = all(r["max_reserved_mb_on_a_device"] <= device_mb for r in runs.values())
    packed = runs["auto"]["max_tasks_on_a_device"] > 1 or auto_cap == 1
    print(
        json.dumps(
            {
                "device_mb": device_mb,
                "host_cores": host_cores(),
                "auto_cap": auto_cap,
                "runs": runs,
                "auto_over_one_wall": round(runs["auto"]["wall_s"] / runs["1"]["wall_s"], 3),
                "never_over_memory": within,
                "auto_packs": packed,
                "ok": within and packed,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
