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


def _sleep_on_rank(ctx: StageContext, dist) -> dict:
    first_step = time.time()  # the rank is up and its process group formed
    k = 1 if dist is None else dist.world_size
    seconds = float(ctx.task.inputs.get("_sleep_s", 0.0))
    time.sleep(seconds)
    if dist is not None:
        dist.barrier()  # a gang ends together, as an optimizer step's all-reduce does
    return {"first_step": first_step, "ranks": k}


def gang_stage(ctx: StageContext) -> dict:
    """Sleep this task's seconds at its k ranks: k = 1 in this process, else on a gang."""
    from dataclasses import replace

    from pita.core.elastic import speedup
    from pita.runtime.gang import run_stage

    t0 = time.time()
    table = _durations(str(ctx.run_dir / TABLE))
    k = max(1, int(ctx.task.gpus)) if ctx.task.elastic else 1
    seconds = float(table[ctx.task.id]) / speedup(k, float(table.get("_alpha", 0.0)))
    ctx.task = replace(ctx.task, inputs={**ctx.task.inputs, "_sleep_s": seconds})
    out = run_stage(ctx, _sleep_on_rank, world_size=k)
    write_stand_in_outputs(ctx)
    return {"slept_s": seconds, "ranks": k, "gang_startup_s": round(out["first_step"] - t0, 3)}
