"""Tasks that compute on the host's CPU share its cores: the forecast's model of it.

On `fake:` devices and CPU slots every worker computes on the same cores. Eight `fake:`
devices on a 2-core machine run eight one-thread tasks at once, each at a quarter of the
speed it has alone; a simulation that gives each device its own speed predicts a makespan
that the cores cannot deliver, and durations measured under that crowding (each task 4x
its own time) make the next forecast of a smaller run too long. Both sides use the same
model here (processor sharing, as the kernel's scheduler does for busy threads):

- a running task asks for `demand(task)` cores (its ranks x torch threads per rank);
- while the running tasks ask for D cores in all on a host of C, each progresses at
  `rate(D)` = min(1, C / D) seconds of its own work per second of wall time;
- a task's *work* is what it would take with the cores to itself: the integral of its
  rate over its life (`ShareClock`). Durations are recorded and estimated as work; the
  simulation (pita/core/parallel_executor.py `simulate`) turns work back into wall time.

Since every running task progresses at the same rate, one virtual clock serves them all
(V(t) = integral of rate): a task that starts at V0 with w seconds of work ends when V
reaches V0 + w, so the simulation keeps its heap of end times and stays O(log n) an event.
Other users' processes take their share too: `HostShare.external`, their runnable threads
(the host's runnable threads less the run's own, `outside_load`), read when the dry run or the live ETA
forecasts. A finished task is learned from its CPU seconds where it computed (they do not
depend on who else ran), else from its wall time x the modelled rate. Not modelled: memory
bandwidth, and load that comes or goes after the forecast.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

# A task whose CPU seconds say it computed at least this long is learned from them (below:
# from its wall time and the modelled rate: a sleeping or waiting task has no CPU to count)
CPU_BOUND_S = 1.0


@dataclass(frozen=True)
class HostShare:
    """`cores` the run's tasks share; each rank of a task runs `threads` torch threads;
    `external`: runnable threads of other processes (other users' work) that take their
    share of the cores too."""

    cores: float
    threads: int = 1
    external: float = 0.0

    def demand(self, task: Any) -> float:
        """Cores a task asks for: k ranks, each with threads / k of the worker's (at least 1)."""
        k = max(1, int(getattr(task, "gpus", 1) or 1))
        return float(k * max(1, self.threads // k))

    def rate(self, demand: float) -> float:
        """Seconds of its own work each running task does per second while `demand` cores are asked."""
        asked = demand + self.external
        return 1.0 if asked <= self.cores else self.cores / asked

    def work(self, wall: float, rate: float, cpu: float | None, ranks: int = 1) -> float:
        """A finished task's work: its CPU seconds per thread when it ran on one rank and
        computed (whatever else shared the cores: other users' load included), else its wall
        time x `rate`, the host's mean modelled rate while it ran (a gang's ranks are not
        the worker's children: their CPU is not counted)."""
        if cpu is not None and ranks <= 1 and cpu / max(1, self.threads) >= CPU_BOUND_S:
            return min(wall, cpu / max(1, self.threads))
        return wall * rate


@dataclass
class ShareClock:
    """Each task's work (seconds alone on the cores) while tasks start and stop on a host."""

    share: HostShare
    virtual: float = 0.0  # integral of the rate since the clock started
    at: float | None = None  # wall time of the last change
    demand: float = 0.0
    running: dict[str, tuple[float, float]] = field(default_factory=dict)  # id -> (V0, demand)
    began: dict[str, float] = field(default_factory=dict)  # id -> wall time it started
    asked: float = 0.0  # integral of the run's demand over wall time
    asked_at: dict[str, float] = field(default_factory=dict)  # id -> `asked` when it started

    def advance(self, now: float) -> float:
        """Bring the virtual clock to `now`; returns it."""
        if self.at is not None and now > self.at:
            self.virtual += (now - self.at) * self.share.rate(self.demand)
            self.asked += (now - self.at) * self.demand
        self.at = now if self.at is None else max(self.at, now)
        return self.virtual

    def mean_demand(self, task_id: str, now: float) -> float:
        """The run's mean demand (cores asked) while the running task ran."""
        ran = self.running_for(task_id, now)
        self.advance(now)
        if ran <= 0 or task_id not in self.asked_at:
            return self.demand
        return (self.asked - self.asked_at[task_id]) / ran

    def start(self, task_id: str, demand: float, now: float) -> None:
        self.advance(now)
        self.stop(task_id, now)  # a retry's new attempt: the old one ended
        self.running[task_id] = (self.virtual, demand)
        self.began[task_id] = now
        self.asked_at[task_id] = self.asked
        self.demand += demand

    def worked(self, task_id: str, now: float) -> float | None:
        """Work seconds the running task has done by `now` (None: not running)."""
        if task_id not in self.running:
            return None
        return self.advance(now) - self.running[task_id][0]

    def running_for(self, task_id: str, now: float) -> float:
        """Wall seconds since the task started (0 when it is not running)."""
        began = self.began.get(task_id)
        return 0.0 if began is None else max(0.0, now - began)

    def stop(self, task_id: str, now: float) -> float | None:
        """The task ended: its work seconds (None: it was not running)."""
        if task_id not in self.running:
            return None
        done = self.advance(now) - self.running[task_id][0]
        self.demand = max(0.0, self.demand - self.running.pop(task_id)[1])
        self.began.pop(task_id, None)
        self.asked_at.pop(task_id, None)
        return done


def mean_rates(
    events: Iterable[Mapping[str, Any]], share: HostShare, gpus: Mapping[str, int] | None = None
) -> dict[str, float]:
    """task id -> the mean rate (work / wall) of its last finished attempt, replaying a
    run's journal (`task_running` with its devices; `task_done`, `task_failed`,
    `task_retry`, `task_resized`, `task_stopped` end an attempt) through a `ShareClock`.
    A task's work is its measured wall time x this rate. `gpus`: ranks per task where an
    event does not list its devices."""
    clock = ShareClock(share)
    began: dict[str, float] = {}
    out: dict[str, float] = {}
    for e in events:
        kind, tid, ts = e.get("event"), e.get("task"), e.get("ts")
        if not isinstance(tid, str) or not isinstance(ts, (int, float)):
            continue
        if kind == "task_running":
            k = len(e.get("devices") or []) or (gpus or {}).get(tid, 1)
            clock.start(tid, share.demand(_Ranks(k)), float(ts))
            began[tid] = float(ts)
        elif kind in ENDS:
            done = clock.stop(tid, float(ts))
            wall = float(ts) - began.pop(tid, float(ts))
            if kind == "task_done" and done is not None:
                out[tid] = done / wall if wall > 0 else share.rate(clock.demand)
    return out


ENDS = ("task_done", "task_failed", "task_retry", "task_resized", "task_stopped")


@dataclass(frozen=True)
class _Ranks:
    gpus: int


OUTSIDE_LOAD_ENV = "PITA_OUTSIDE_LOAD"


def outside_load(ours: float) -> float:
    """Runnable threads on the host that are not the run's: the runnable threads now
    (`runnable_threads`; the 1-minute load average where the OS has no /proc/stat) less the
    run's own demand and the orchestrator's thread. $PITA_OUTSIDE_LOAD, where set, is the
    figure instead: a run whose sizing must not depend on what else the machine runs at that
    minute (the test suite's runs, a benchmark's baseline) states it."""
    pinned = os.environ.get(OUTSIDE_LOAD_ENV)
    if pinned:
        try:
            return max(0.0, float(pinned))
        except ValueError:
            pass  # not a number: read the host as usual
    load = runnable_threads()
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):
            return 0.0
    return max(0.0, load - ours - 1.0)


def runnable_threads(samples: int = 10, gap_s: float = 0.02) -> float | None:
    """The host's runnable threads now (this one included): the median of /proc/stat's
    `procs_running` over `samples` reads `gap_s` apart; None without /proc/stat.

    Not the load average: it is a one-minute moving average, so right after a run ends it
    still counts that run's threads. A dry run typed after a run (bench/forecast.py does)
    read them as other users' load and forecast 1.4x too long (bench/README.md)."""
    seen: list[int] = []
    for i in range(samples):
        try:
            with open("/proc/stat") as f:
                seen += [int(ln.split()[1]) for ln in f if ln.startswith("procs_running")]
        except (OSError, ValueError, IndexError):
            return None
        if i + 1 < samples:
            time.sleep(gap_s)
    return float(statistics.median(seen)) if seen else None


def felt_outside(share: HostShare, cpu: float, wall: float, demand: float) -> float | None:
    """Other users' load as a finished task felt it: a task that computed `cpu` seconds in
    `wall` while the run asked `demand` cores progressed at cpu / threads / wall, which the
    model reads as cores / (demand + outside). None: the task did not compute (a sleep)."""
    work = cpu / max(1, share.threads)
    if work < CPU_BOUND_S or wall <= 0:
        return None
    rate = min(1.0, work / wall)
    return max(0.0, share.cores / max(rate, 1e-3) - max(demand, 1.0))
