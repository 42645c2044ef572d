"""Stage functions for orchestrator tests (plugged in with executor.stage_overrides).

They do real things in real worker processes — sleep, write files, raise, hang — and
leave markers so a test can watch them and kill their worker mid-task. Behaviour is
chosen through environment variables that the worker inherits from the test process.
"""

from __future__ import annotations

import json
import os
import time

from pita.runtime.context import StageContext, write_stand_in_outputs


def _marker(ctx: StageContext, what: str) -> None:
    folder = os.environ.get("PITA_TEST_MARKERS")
    if folder:
        path = os.path.join(folder, f"{ctx.task.id}.{what}")
        line = json.dumps(
            {
                "pid": os.getpid(),
                "ppid": os.getppid(),  # the orchestrator, or its forkserver for a forked worker
                "t": time.time(),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            }
        )
        # A test polls for this file and reads it at once: write the whole content
        # beside it and rename, so a reader never sees a half-written (empty) marker.
        earlier = ""
        if os.path.exists(path):
            with open(path) as f:
                earlier = f.read()
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(earlier + line + "\n")
        os.replace(tmp, path)


def sleep_stage(ctx: StageContext) -> dict:
    """Sleep `PITA_TEST_SLEEP` × task.work seconds (per-algo scale: PITA_TEST_SCALE_<ALGO>)."""
    _marker(ctx, "started")
    scale = float(os.environ.get(f"PITA_TEST_SCALE_{ctx.task.algo.replace('-', '_')}", "1"))
    duration = float(os.environ.get("PITA_TEST_SLEEP", "0.05")) * ctx.task.work * scale
    kill_on = os.environ.get("PITA_TEST_SLOW_TASK")
    if kill_on and kill_on == ctx.task.id:
        duration = max(duration, float(os.environ.get("PITA_TEST_SLOW_S", "30")))
    time.sleep(duration)
    (ctx.out_dir / "artifact.txt").write_text(f"{ctx.task.id} by {os.getpid()}\n")
    _marker(ctx, "finished")
    write_stand_in_outputs(ctx)
    return {"slept_s": duration, "pid": os.getpid(), "inputs": ctx.task.inputs}


def failing_stage(ctx: StageContext) -> dict:
    """Raise for the algorithm named in PITA_TEST_FAIL_ALGO, sleep otherwise."""
    if ctx.task.algo == os.environ.get("PITA_TEST_FAIL_ALGO"):
        _marker(ctx, "raised")
        raise ValueError(f"deliberate failure in {ctx.task.id}")
    return sleep_stage(ctx)


def hang_stage(ctx: StageContext) -> dict:
    _marker(ctx, "started")
    while True:
        time.sleep(1)


def noop_stage(ctx: StageContext) -> dict:
    write_stand_in_outputs(ctx)
    return {}


def nan_stage(ctx: StageContext) -> dict:
    """A stage whose metric came out NaN (e.g. a diverged loss): the task must fail."""
    return {"rows": [{"eta": 0.0, "pass@1": float("nan")}]}


def infinite_kl_stage(ctx: StageContext) -> dict:
    """A row whose policy sampled outside π_ref's top-k: its `kl` is +inf, by definition."""
    return {"rows": [{"eta": None, "pass@1": 0.5, "kl": float("inf"), "off_support": 0.25}]}


def forgetful_stage(ctx: StageContext) -> dict:
    """Writes nothing although its task declares an output."""
    return {}


def progress_stage(ctx: StageContext) -> dict:
    """A stage slower than any estimate that says how far it is: `PITA_TEST_LOAD_S` seconds
    without progress (a model load), then `PITA_TEST_STEPS` steps of `PITA_TEST_STEP_S`
    seconds, each reported through `ctx.report_progress` like a training stage's."""
    time.sleep(float(os.environ.get("PITA_TEST_LOAD_S", "0")))
    steps = int(os.environ.get("PITA_TEST_STEPS", "20"))
    for i in range(steps):
        time.sleep(float(os.environ.get("PITA_TEST_STEP_S", "0.1")))
        ctx.report_progress(i + 1, steps, "step", f"loss {1.0 / (i + 1):.3f}")
    write_stand_in_outputs(ctx)
    return {"steps": steps}


def scored_merge_stage(ctx: StageContext) -> dict:
    """An `evaluate_merge` stand-in that writes one summary row (metrics.json, as the real
    stage does), so a run of sleep stages still has a report: results/summary.csv and the
    plots (the tests that break or plant files in a finished run's report)."""
    row = {
        "algo": ctx.task.algo,
        "dataset": ctx.task.dataset,
        "family": ctx.task.family,
        "round": ctx.task.round,
        "eta": None,
        "n_prompts": 2,
        "samples": 4,
        "pass@1": 0.5,
        "avg_reward": 0.5,
        "kl": 0.0,  # the reference's KL to itself
    }
    (ctx.out_dir / "metrics.json").write_text(json.dumps([row]) + "\n")
    return {"rows": [row]}


def gang_fault_stage(ctx: StageContext) -> dict:
    """Ten steps on a gang of two gloo ranks, each step "checkpointed" (its number, in the
    task's checkpoints folder) and a retry starting after the last one; rank 1 sends itself
    the signal named by PITA_TEST_RANK_FAULT (SIGKILL, SIGSTOP) at step 3 of a first attempt.
    What a rank's death or stall does to a real task (tests/test_gang_faults.py)."""
    from pita.core.paths import TaskPaths
    from pita.runtime.gang import run_stage

    folder = TaskPaths(ctx.run_dir, ctx.task.id).checkpoints
    result = run_stage(ctx, _gang_fault_rank, str(folder), world_size=2)
    write_stand_in_outputs(ctx)
    return result


def _gang_fault_rank(ctx: StageContext, dist, folder: str) -> dict:
    import signal
    from pathlib import Path

    import torch

    mark = Path(folder) / "step"
    start = int(mark.read_text()) if mark.exists() else 0
    fault = os.environ.get("PITA_TEST_RANK_FAULT") if start == 0 else None
    t = torch.ones(1)
    for step in range(start + 1, 11):
        torch.distributed.all_reduce(t)
        ctx.report_progress(step, 10)
        if dist.rank == 0:
            mark.parent.mkdir(parents=True, exist_ok=True)
            mark.with_suffix(".tmp").write_text(str(step))
            os.replace(mark.with_suffix(".tmp"), mark)
        if fault and dist.rank == 1 and step == 3:
            os.kill(os.getpid(), getattr(signal, fault))
        time.sleep(0.6)  # above PROGRESS_EVERY_S: every step is reported
    return {"resumed_after_step": start}
