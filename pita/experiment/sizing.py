"""The run's and the dry run's `Sizer` (pita/core/elastic.py): ranks of elastic training
tasks chosen by simulating the rest of the plan with the ETA's durations.

Built from what the ETA already knows (`TaskDurations`: this run's finished tasks, then
earlier runs' recorded ones, then work units) and the per-user duration cache's seconds per
rank count (the learned speedup curves). `dry_run_sizing` runs the dry run's simulation with
the same decisions at each elastic task's simulated dispatch, so the dry run prints the k
each task would get and the predicted makespan, next to a rigid schedule's.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig

from pita.core.dag import Plan
from pita.core.elastic import GangStartup, Sizer, SpeedupCurves, set_ranks
from pita.core.parallel_executor import Scheduler, fresh_scheduler, simulate, simulate_window
from pita.core.progress import Eta, TaskDurations
from pita.core.tasks import TaskSpec


def make_sizer(
    cfg: DictConfig,
    tasks: Mapping[str, TaskSpec],
    durations: TaskDurations,
    scheduler: Scheduler,
    history: dict[str, dict[str, Any]] | None = None,
) -> Sizer:
    """A Sizer over the run's devices; `durations` and an `Eta` built on them then count a
    gang's wall time per rank (`one_rank`, `at_ranks`, see `wire_eta`)."""
    from pita.experiment.durations import load_rank_history

    history = load_rank_history() if history is None else history
    curves = SpeedupCurves(history=history, startup=measured_startup(history))
    durations.one_rank = lambda t, s: curves.one_rank(t, s, t.gpus) if t.elastic else s
    rate_at: dict[str, Any] = {}

    def one_rank_s(task: TaskSpec) -> float:
        if rate_at.get("units") != durations.work_units:  # a task finished: new rate
            rate_at.update(units=durations.work_units, rate=durations.rate(list(tasks.values())))
        return durations.estimate(task, rate_at["rate"])[0]

    def sim(trial, seconds, first, resize=None, ends=None):
        return simulate_window(trial, fresh_scheduler(scheduler), seconds, first, resize, ends)

    return Sizer(
        curves,
        one_rank_s,
        sim,
        n_devices=len(scheduler.devices),
        max_ranks=int(cfg.executor.max_ranks_per_task),
        key=durations.key,
        version=lambda: durations.work_units,
    )


def measured_startup(history: Mapping[str, Mapping[str, Any]]) -> GangStartup:
    """Each stage kind's first step (dispatch -> first optimizer step) per rank count, as
    earlier runs recorded it: the sizer's start-up of that kind's gangs (`GangStartup`)."""
    startup = GangStartup()
    for entry in history.values():
        for k, seconds in (entry.get("first_step") or {}).items():
            startup.observe_first_step(str(entry["curve"]), int(k), float(seconds))
    return startup


def wire_eta(eta: Eta, sizer: Sizer) -> Eta:
    """The ETA's simulation counts a sized task at its k (speedup curve and start-up)."""
    eta.at_ranks = lambda t, s: sizer.curves.seconds(t, s, t.gpus) if t.elastic else s
    return eta


def dry_run_sizing(plan: Plan, scheduler: Scheduler, sizer: Sizer) -> dict[str, Any]:
    """Simulate `plan` with each elastic task sized when it becomes ready (as the run
    does); mutates the tasks' `gpus`. Returns placement, makespan, the rigid makespan (every
    task on its planned devices) and the sizing cost."""
    rigid_scheduler = fresh_scheduler(scheduler)
    _, rigid = simulate(plan, rigid_scheduler, lambda t: sizer.seconds(t))
    calls: list[float] = []

    def on_ready(task: TaskSpec, now: float, ends: dict[str, float], unstarted: set[str]) -> None:
        if not task.elastic or not sizer.enabled:
            return
        remaining = Unfinished(plan.tasks, unstarted, ends)
        left = {tid: max(1e-3, end - now) for tid, end in ends.items()}
        sizing = sizer.size(task, remaining, left)
        set_ranks(task, sizing.k)
        calls.append(sizing.cost_s)

    t0 = time.perf_counter()
    sizer.prioritize(plan.tasks)  # as DagRunner does when it has a sizer
    placement, makespan = simulate(
        plan, fresh_scheduler(scheduler), lambda t: sizer.seconds(t), on_ready=on_ready
    )
    return {
        "placement": placement,
        "makespan_s": makespan,
        "rigid_makespan_s": rigid,
        "sized": len(calls),
        "sizing_s": sum(calls),
        "simulation_s": time.perf_counter() - t0,
    }


class Unfinished(Mapping[str, TaskSpec]):
    """The tasks of a simulated plan not finished yet (not started, or running: `ends`), as a
    mapping read from the simulation's own sets: no copy of a 34,292-task plan per decision."""

    def __init__(self, tasks: Mapping[str, TaskSpec], unstarted: set[str], running: Mapping):
        self.tasks, self.unstarted, self.running = tasks, unstarted, running

    def __contains__(self, tid: object) -> bool:
        return tid in self.unstarted or tid in self.running

    def __getitem__(self, tid: str) -> TaskSpec:
        if tid not in self:
            raise KeyError(tid)
        return self.tasks[tid]

    def __iter__(self):
        return (tid for tid in self.tasks if tid in self.unstarted or tid in self.running)

    def __len__(self) -> int:
        return len(self.unstarted) + len(self.running)
