"""Benchmark workload for bench/scheduler.py: a stage that only sleeps. Not a product stage.

bench/scheduler.py writes `bench_durations.json` ({task id: seconds}) into the run folder
and plugs `timed_stage` in for every stage with `executor.stage_overrides.any.<stage>`.
Each task then sleeps exactly the duration the benchmark drew for it, in a real worker
process, so the makespan measures scheduling and dispatch, not the computation.
"""

from __future__ import annotations

import json
import time
from functools import lru_cache

from pita.runtime.context import StageContext, write_stand_in_outputs

TABLE = "bench_durations.json"


@lru_cache(maxsize=4)
def _durations(path: str) -> dict[str, float]:
    with open(path) as f:
        return json.load(f)


def timed_stage(ctx: StageContext) -> dict:
    seconds = float(_durations(str(ctx.run_dir / TABLE))[ctx.task.id])
    time.sleep(seconds)
    write_stand_in_outputs(ctx)
    return {"slept_s": seconds}


# --- elastic training tasks (bench/scaling.py) ------------------------------------------------
# bench_durations.json also holds "_alpha": a task on k ranks sleeps its one-rank seconds
# / s(k), s(k) = k / (1 + alpha (k - 1)), on every rank of a real gang (pita/runtime/gang.py
# run_stage: k rank processes and their gloo rendezvous), so its wall time includes the
# gang's real start-up.


# With "_grow" in the table (bench/scaling.py's `grow` mode) a task sleeps in ticks and, after
# each, stops if the run asked it to (`TaskPaths.stop_request`, pita/core/growth.py): rank 0
# looks, the gang agrees (a broadcast), rank 0 records the one-rank seconds done so far
# (`bench_progress/<task>.json`, the stand-in for its checkpoint) and every rank raises
# StoppedAtCheckpoint; the next attempt, on its new k, sleeps only what is left.
TICK_S = 0.5
PROGRESS = "bench_progress"


def _stop_agreed(path: str, dist) -> bool:
    """Rank 0's answer to "was a stop requested?", the same on every rank of the gang."""
    import os

    asked = os.path.exists(path)
    if dist is None:
        return asked
    import torch.distributed as tdist

    box = [asked]
    tdist.broadcast_object_list(box, src=0)
    return bool(box[0])


def _done_s(ctx: StageContext) -> float:
    path = ctx.run_dir / PROGRESS / f"{ctx.task.id}.json"
    try:
        return float(json.loads(path.read_text())["one_rank_s_done"])
    except (OSError, ValueError, KeyError):
        return 0.0


def _sleep_on_rank(ctx: StageContext, dist) -> dict:
    import math

    first_step = time.time()  # the rank is up and its process group formed
    k = 1 if dist is None else dist.world_size
    seconds = float(ctx.task.inputs.get("_sleep_s", 0.0))
    stop = str(ctx.task.inputs.get("_stop", ""))
    if not stop:
        time.sleep(seconds)
    else:  # the same number of ticks on every rank: the broadcasts pair up
        ticks = max(1, math.ceil(seconds / TICK_S))
        for i in range(ticks):
            time.sleep(min(TICK_S, seconds - i * TICK_S))
            if i + 1 < ticks and _stop_agreed(stop, dist):
                if dist is None or dist.rank == 0:
                    from pita.core.paths import atomic_write_json

                    done = _done_s(ctx) + (i + 1) * TICK_S * float(ctx.task.inputs["_rate"])
                    folder = ctx.run_dir / PROGRESS
                    folder.mkdir(exist_ok=True)
                    atomic_write_json(folder / f"{ctx.task.id}.json", {"one_rank_s_done": done})
                if dist is not None:
                    dist.barrier()  # written before any rank reports the stop
                from pita.core.errors import StoppedAtCheckpoint

                raise StoppedAtCheckpoint(i + 1)
    if dist is not None:
        dist.barrier()  # a gang ends together, as an optimizer step's all-reduce does
    return {"first_step": first_step, "ranks": k}


def gang_stage(ctx: StageContext) -> dict:
    """Sleep this task's seconds at its k ranks (k = 1 in this process, else on a gang);
    what an earlier, stopped attempt did is not slept again."""
    from dataclasses import replace

    from pita.core.elastic import speedup
    from pita.core.paths import TaskPaths
    from pita.runtime.gang import run_stage

    t0 = time.time()
    table = _durations(str(ctx.run_dir / TABLE))
    k = max(1, int(ctx.task.gpus)) if ctx.task.elastic else 1
    rate = speedup(k, float(table.get("_alpha", 0.0)))
    seconds = max(0.0, float(table[ctx.task.id]) - _done_s(ctx)) / rate
    stop = str(TaskPaths(ctx.run_dir, ctx.task.id).stop_request) if table.get("_grow") else ""
    inputs = {**ctx.task.inputs, "_sleep_s": seconds, "_stop": stop, "_rate": rate}
    ctx.task = replace(ctx.task, inputs=inputs)
    out = run_stage(ctx, _sleep_on_rank, world_size=k)
    write_stand_in_outputs(ctx)
    return {"slept_s": seconds, "ranks": k, "gang_startup_s": round(out["first_step"] - t0, 3)}
