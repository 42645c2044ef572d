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
