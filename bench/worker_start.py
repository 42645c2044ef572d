"""Worker start-up on CPU: fresh processes against workers forked from a warm forkserver.

    python bench/worker_start.py [--workers 2]

For each way of starting workers (`WorkerPool(fork_workers=...)`, pita/core/forked_worker.py),
in a process of its own: a pool on `--workers` CPU slots with `preimport` on (as in a real
run) runs a first task on every worker (a tiny Llama built and run: torch, transformers and
the model class imported), then SIGKILLs one worker and runs a task on the worker that
replaces it (what a retry after a killed worker waits for). Reported per mode: seconds until
every first task was done, seconds for the replacement's task, the workers' torch threads
(the pool's budget either way) and the busy CPU seconds of the whole machine while the mode ran (/proc/stat: a forkserver's children are not
the pool's children, so rusage would miss them). Prints one JSON object; `ok` is true when
forking used less CPU than fresh processes. Run it on a quiet machine: the CPU figure is
machine-wide.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))

from pita.core.paths import pythonpath_with  # noqa: E402


def busy_cpu_s() -> float:
    """Busy CPU seconds of the whole machine so far (user, nice, system, irq, softirq, steal)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def tiny_model_stage(ctx) -> dict:
    """A first task that needs what a real one needs: torch, transformers' Llama, a forward."""
    import torch

    from pita.models.tiny import build_tiny_llama
    from pita.runtime.context import write_stand_in_outputs

    model = build_tiny_llama(16, n_layer=1, d_model=32, n_head=2, pad_token_id=0, eos_token_id=1)
    with torch.no_grad():
        model(input_ids=torch.ones(2, 8, dtype=torch.long))
    write_stand_in_outputs(ctx)
    return {"pid": os.getpid(), "torch_threads": torch.get_num_threads()}


def _task(i: int):
    from pita.core.tasks import TaskSpec

    return TaskSpec.standalone(
        f"t{i}", "reference", "evaluate", "bench.worker_start:tiny_model_stage"
    )


def one_mode(fork: bool, workers: int, run_dir: Path) -> dict:
    """In this process: a first task on every worker, then one on the worker that replaces
    a SIGKILLed one."""
    from pita.core.gpu_manager import GPUManager
    from pita.core.worker_pool import WorkerPool

    gpu = GPUManager("cpu", cpu_workers=workers)
    t0 = time.perf_counter()
    pool = WorkerPool(gpu, preimport=True, fork_workers=fork, log_dir=run_dir / "workers")
    pool.warm_up([(d.index,) for d in gpu.devices])
    futures = [pool.submit(_task(i), [i], {}, run_dir) for i in range(workers)]
    outcomes = [f.result(timeout=300) for f in futures]
    assert all(o.ok for o in outcomes), [o.message for o in outcomes]
    out = {"first_tasks_done_s": round(time.perf_counter() - t0, 2)}
    out["torch_threads"] = sorted({o.result["torch_threads"] for o in outcomes})
    victim = outcomes[0].result["pid"]
    os.kill(victim, signal.SIGKILL)
    while victim in pool.worker_pids():
        time.sleep(0.01)  # the pool saw it die
    t1 = time.perf_counter()
    again = pool.submit(_task(workers), [0], {}, run_dir, attempt=2).result(timeout=300)
    assert again.ok and again.result["pid"] != victim, again.message
    out["replacement_task_done_s"] = round(time.perf_counter() - t1, 2)
    pool.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--mode", choices=["fresh", "forked"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:  # a child: one mode, its figures as one JSON line
        with tempfile.TemporaryDirectory() as run_dir:
            print(json.dumps(one_mode(args.mode == "forked", args.workers, Path(run_dir))))
        return
    env = {**os.environ, "PYTHONPATH": pythonpath_with(ROOT, os.environ.get("PYTHONPATH"))}
    result: dict = {"workers": args.workers, "cores": os.cpu_count()}
    for mode in ("fresh", "forked"):
        cpu0 = busy_cpu_s()
        proc = subprocess.run(
            [sys.executable, __file__, "--mode", mode, "--workers", str(args.workers)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        figures = json.loads(proc.stdout.strip().splitlines()[-1])
        figures["machine_busy_cpu_s"] = round(busy_cpu_s() - cpu0, 2)
        result[mode] = figures
    result["cpu_saved_s"] = round(
        result["fresh"]["machine_busy_cpu_s"] - result["forked"]["machine_busy_cpu_s"], 2
    )
    same_threads = result["fresh"]["torch_threads"] == result["forked"]["torch_threads"]
    result["ok"] = result["cpu_saved_s"] > 0 and same_threads
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
