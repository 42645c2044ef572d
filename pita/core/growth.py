"""Growing a running training task at a checkpoint when devices stay idle (issue 32 item 2).

Sizing at dispatch (pita/core/elastic.py) chooses a training task's ranks from the duration
estimates; when those were wrong, or other chains finished sooner than predicted, devices
sit idle while the task that holds the run back trains on fewer ranks than it could use.
Growth corrects that while it runs:

1. **When.** Devices have been idle for `idle_s` seconds (no running task, not held for a
   waiting gang: no ready task wants them), and a running training task that can change
   its ranks (`growable`: data-parallel, its checkpoints resume on any k) would end sooner
   on more: its time left on k ranks (`pita.core.progress.task_left`: its own pace from its
   progress line, else what is left of its estimate) against the resize's cost (stopping at
   the next step and writing the checkpoint, `stop_s`, measured on each resize; the gang's
   start-up on k', `startup(task, k')`) plus the same work on k' ranks. It must gain `margin` of
   its time left and at least `min_gain_s`. Highest-priority tasks first; never shrinks.
2. **How.** The run writes `tasks/<id>.stop-request` (`TaskPaths.stop_request`); the task's
   `Checkpointer` (a TRL stage: its Trainer's `stop_callback`) sees it after its next
   optimizer step (rank 0, broadcast to the gang), writes its checkpoint and stops: outcome
   `stopped` (pita/core/errors.py), not a failure.
3. **Then.** The task is dispatched again at once on k' ranks and resumes from that
   checkpoint (a full-state checkpoint resumes on any k, pita/training/ddp.py `FullState`;
   the Trainer checkpoint of the TRL stages the algorithm table marks growable too);
   the attempt is not counted as a retry. Journal: `task_grow_requested` when asked;
   `task_stopped` (the attempt's end) and `task_resized` (why=grow, previous, ranks) when
   it stopped.
4. **Fallback.** If the larger gang fails (any failure class), or cannot gather its devices
   within `wait_s`, the task goes back to its old k (journal `task_resized` why=fallback),
   still from the checkpoint.

Torch-free (orchestrator side): the speedup curve, the gang start-up and the rank choices
come in as callables (the `Sizer`'s, pita/core/elastic.py: `Grower.for_sizer`). On by
default where elastic tasks are (`executor.grow_idle_s`, 0 = off).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pita.core.elastic import curve_key, set_ranks
from pita.core.errors import STOPPED
from pita.core.progress import parse_progress, task_left
from pita.core.tasks import TaskSpec

log = logging.getLogger(__name__)

DEFAULT_STOP_S = 2.0  # request -> stopped outcome until one was measured (a step + a save)
# Which stages grow is a column of the algorithm table (pita/algos/registry.py
# `Algorithm.growable_stages`, with the reasons there); the planner sets `task.growable`.


def growable(task: TaskSpec) -> bool:
    """An elastic task (ranks chosen at dispatch) whose checkpoint resumes on any k with
    the numbers of an uninterrupted run (`TaskSpec.growable`, from its registry row)."""
    return task.elastic and task.growable


@dataclass
class RunningTask:
    """What the decision knows of one running task."""

    task: TaskSpec
    elapsed_s: float  # since this attempt was dispatched
    fraction: float | None = None  # share of its steps done (its progress line), if known
    first: tuple[float, float] = (0.0, 0.0)  # (elapsed, fraction) when progress was first seen


@dataclass
class Grow:
    """One decision: ask `task` to stop at a checkpoint and restart on `ranks`."""

    task: str
    previous: int
    ranks: int
    left_s: float  # predicted seconds left on `previous` ranks
    grown_left_s: float  # predicted seconds left after the resize, its cost included

    def journal_fields(self) -> dict[str, Any]:
        return {
            "task": self.task,
            "previous": self.previous,
            "ranks": self.ranks,
            "left_s": round(self.left_s, 2),
            "grown_left_s": round(self.grown_left_s, 2),
        }


@dataclass
class GrowthPolicy:
    """The decision (see the module docstring): pure, no clock, no files."""

    seconds: Callable[[TaskSpec, int], float]  # expected seconds on k ranks, start-up included
    startup: Callable[[TaskSpec, int], float]  # the task's k-rank start-up beyond one rank
    choices: Callable[[TaskSpec], list[int]]  # the ranks a task may have (1, 2, 4, ...)
    margin: float = 0.1  # share of its time left a resize must save
    min_gain_s: float = 1.0
    stop_s: list[float] = field(default_factory=list)  # measured request -> stopped
    # ask only once the task reported progress: its pace is known and a request does not
    # land in its start-up (a stop there would waste the start-up it paid)
    needs_progress: bool = False

    def stop_cost(self) -> float:
        return sum(self.stop_s) / len(self.stop_s) if self.stop_s else DEFAULT_STOP_S

    def left(self, r: RunningTask) -> float | None:
        """Seconds `r` has left on its current ranks (None: nothing can say)."""
        if self.needs_progress and not r.fraction:
            return None
        return task_left(self.seconds(r.task, r.task.gpus), r.elapsed_s, r.fraction, r.first)

    def grown_left(self, task: TaskSpec, left: float, k: int) -> float:
        """Seconds left after a resize to k ranks now: the stop and checkpoint, the gang's
        start-up on k, and what is left of the work at k ranks' pace."""
        now = max(1e-9, self.seconds(task, task.gpus) - self.startup(task, task.gpus))
        then = max(1e-9, self.seconds(task, k) - self.startup(task, k))
        return self.stop_cost() + self.startup(task, k) + left * then / now

    def decide(self, running: Iterable[RunningTask], idle: int) -> list[Grow]:
        """Resizes worth asking for with `idle` devices free, highest priority first."""
        out: list[Grow] = []
        for r in sorted(running, key=lambda r: -r.task.priority):
            k = r.task.gpus
            left = self.left(r)
            if left is None or idle <= 0:
                continue
            options = [c for c in self.choices(r.task) if k < c <= k + idle]
            if not options:
                continue
            best = min(options, key=lambda c: (self.grown_left(r.task, left, c), c))
            after = self.grown_left(r.task, left, best)
            if left - after >= max(self.min_gain_s, self.margin * left):
                out.append(Grow(r.task.id, k, best, left, after))
                idle -= best - k
        return out


@dataclass
class _Asked:
    grow: Grow
    at: float  # when the request was written


class Grower:
    """The run's side of growth: watches idle devices, writes stop requests, turns a
    `stopped` outcome into a dispatch on the larger gang, falls back when that fails.

    `DagRunner` calls `dispatched(task)` before it submits a task, `tick(runner)` once per
    scheduling round, and `handle(runner, task, outcome, pending)` for every outcome (True:
    handled here, the task is pending again)."""

    def __init__(
        self,
        policy: GrowthPolicy,
        run_dir: Any,
        *,
        growable: Callable[[TaskSpec], bool],
        progress: Callable[[], Mapping[str, str]] = dict,
        idle_s: float = 2.0,
        wait_s: float = 10.0,
        clock: Callable[[], float] = time.time,
    ):
        self.policy = policy
        self.run_dir = run_dir
        self.growable = growable
        self.progress = progress  # running task id -> its last progress line
        self.idle_s = idle_s
        self.wait_s = wait_s  # a grown gang that cannot gather its devices this long: fallback
        self.clock = clock
        self.asked: dict[str, _Asked] = {}
        self.grown: dict[str, int] = {}  # task re-dispatched on a larger gang -> its old k
        self.waiting: dict[str, float] = {}  # grown task not started yet -> since when
        self.idle_since: dict[int, float] = {}  # device -> idle since
        self.first: dict[str, tuple[float, float]] = {}  # task -> first progress seen
        self.started: dict[str, float] = {}  # task -> when this attempt was dispatched

    @classmethod
    def for_sizer(
        cls, sizer: Any, run_dir: Any, progress: Callable[[], Mapping[str, str]], idle_s: float
    ) -> Grower:
        """The run's grower: the `Sizer`'s curves, start-up and rank choices; grows the
        elastic tasks whose checkpoints resume on any k (`growable`)."""
        policy = GrowthPolicy(
            seconds=lambda t, k: sizer.seconds(t, k),
            startup=lambda t, k: sizer.curves.startup(k, curve_key(t)),  # its kind's, measured
            choices=sizer.ranks_of,
            needs_progress=True,
        )
        return cls(
            policy,
            run_dir,
            growable=growable,
            progress=progress,
            idle_s=idle_s,
            wait_s=max(10.0, 5 * idle_s),
        )

    # -- the files -----------------------------------------------------------------------
    def _request(self, task_id: str):
        from pita.core.paths import TaskPaths

        return TaskPaths(self.run_dir, task_id).stop_request

    def _clear(self, task_id: str) -> None:
        with contextlib.suppress(OSError):
            self._request(task_id).unlink(missing_ok=True)

    # -- hooks -----------------------------------------------------------------------------
    def dispatched(self, task: TaskSpec) -> None:
        """A request left from an earlier attempt (or run) must not stop this one."""
        self._clear(task.id)
        self.waiting.pop(task.id, None)
        self.first.pop(task.id, None)
        self.started[task.id] = self.clock()

    def tick(self, runner: Any) -> list[Grow]:
        """Ask for the resizes worth making now (devices idle for `idle_s`); fall back a
        grown task that waited too long for its devices."""
        now = self.clock()
        self._fall_back_waiting(runner, now)
        held = set(getattr(runner.scheduler, "held", {}) or {})
        for d in runner.scheduler.devices:
            if d.running or d.index in held:
                self.idle_since.pop(d.index, None)
            else:
                self.idle_since.setdefault(d.index, now)
        idle = sum(1 for t in self.idle_since.values() if now - t >= self.idle_s)
        if idle == 0:
            return []
        lines = self.progress()
        candidates = []
        for tid, task in {t.id: t for t in runner.running.values()}.items():
            if tid in self.asked or not self.growable(task):
                continue
            elapsed = now - self.started.get(tid, now)
            fraction = parse_progress(lines.get(tid, ""))
            if fraction is not None and tid not in self.first:
                self.first[tid] = (elapsed, fraction)
            first = self.first.get(tid, (0.0, 0.0))
            candidates.append(RunningTask(task, elapsed, fraction, first))
        grows = self.policy.decide(candidates, idle)
        for g in grows:
            from pita.core.paths import atomic_write_json

            atomic_write_json(self._request(g.task), {"ranks": g.ranks, "requested_at": now})
            self.asked[g.task] = _Asked(g, now)
            runner._journal("task_grow_requested", **g.journal_fields())
            log.info(
                "%s: asked to stop at a checkpoint and grow %d -> %d ranks "
                "(predicted %.1fs left, %.1fs after the resize)",
                g.task,
                g.previous,
                g.ranks,
                g.left_s,
                g.grown_left_s,
            )
            for idx in sorted(self.idle_since)[: g.ranks - g.previous]:
                self.idle_since.pop(idx)  # promised to that task
        return grows

    def handle(self, runner: Any, task: TaskSpec, outcome: Any, pending: dict) -> bool:
        """True when the outcome was a resize's (the task is pending again, on its new k
        or back on its old one); False: the runner's usual handling applies."""
        asked = self.asked.pop(task.id, None)
        self._clear(task.id)
        if outcome.failure == STOPPED:
            runner._journal(
                "task_stopped", task=task.id, wall_s=outcome.wall_s, message=outcome.message
            )
            if asked is None:  # a request nobody here wrote (a stale or planted file)
                pending[task.id] = task  # runs again on its ranks, as an attempt
                return True
            self.policy.stop_s.append(max(0.0, self.clock() - asked.at))
            runner.attempts[task.id] -= 1  # a resize is not a retry
            self.grown[task.id] = task.gpus
            self.waiting[task.id] = self.clock()
            runner._journal(
                "task_resized",
                task=task.id,
                why="grow",
                previous=task.gpus,
                ranks=asked.grow.ranks,
                stop_s=round(self.policy.stop_s[-1], 2),
            )
            set_ranks(task, asked.grow.ranks)
            pending[task.id] = task
            return True
        old = self.grown.pop(task.id, None)
        if old is not None and not outcome.ok and outcome.failure != "interrupted":
            runner._journal(
                "task_failed",
                task=task.id,
                failure=outcome.failure,
                message=outcome.message,
                attempt=runner.attempts[task.id],
                worker_pid=outcome.worker_pid,
            )
            self._back(runner, task, old, outcome.message or str(outcome.failure))
            runner.attempts[task.id] -= 1  # the old gang ran this task fine
            pending[task.id] = task
            return True
        return False

    def _back(self, runner: Any, task: TaskSpec, old: int, why: str) -> None:
        runner._journal(
            "task_resized", task=task.id, why="fallback", previous=task.gpus, ranks=old, message=why
        )
        log.warning("%s: the %d-rank gang failed (%s): back to %d", task.id, task.gpus, why, old)
        set_ranks(task, old)

    def _fall_back_waiting(self, runner: Any, now: float) -> None:
        """A grown task still not placed after `wait_s`: its devices were taken; back to the
        ranks it had (still from its checkpoint)."""
        running = {t.id for t in runner.running.values()}
        for tid, since in list(self.waiting.items()):
            if tid in running:
                self.waiting.pop(tid)
            elif now - since > self.wait_s and tid in self.grown:
                task = runner.plan.tasks[tid]
                self._back(runner, task, self.grown.pop(tid), "its devices were taken")
                self.waiting.pop(tid)
