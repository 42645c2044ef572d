"""What the user sees while a run goes: one line per task event in run.log, and on a
terminal a live table of tasks running and done per device (rich), with each running
task's latest progress line (a training stage's step, loss, reward and KL) as its
worker last reported it in a heartbeat.

The ETA (in the table's title and a run.log line every few tasks) simulates what is left of
the plan on the run's devices (`simulate_remaining`, the dry run's event simulation) with
each task's expected duration from `TaskDurations`: this run's finished tasks of the same
kind first, then earlier runs' recorded durations, then the planner's work units.

A running task's time left comes from its own progress where it reports some (training
steps, prompts generated: `progress_line` in its heartbeat, parsed by `parse_progress`),
so a task slower than its estimate raises the ETA (`task_left`), and so does every task of
its kind still waiting. A task past its estimate that reports no progress makes the ETA
say "unknown" (with the rest of the plan's time as a lower bound), never "2 s".
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pita.core.host_share import ShareClock, felt_outside, outside_load
from pita.core.parallel_executor import Scheduler, fresh_scheduler, simulate_remaining
from pita.core.tasks import TaskSpec

log = logging.getLogger("pita.progress")

# Seconds per planner work unit before anything was measured (neither in this run nor in an
# earlier one): the default experiment took 765 task seconds for 90.4 units on a 2-core CPU.
NOMINAL_S_PER_WORK = 8.0
THIS_RUN, PACE, EARLIER, SCALED, WORK_UNITS = (
    "from this run's durations",
    "from the running tasks' progress",
    "from earlier runs' durations",
    "from earlier runs' durations scaled by task size",
    "from work units: no earlier run",
)


def format_duration(seconds: float) -> str:
    """`4 min 10 s`, `1 h 05 min`, `12 s`: what a person reads in an ETA."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def task_kind(task: TaskSpec) -> tuple[str, str, str, str, int]:
    """Tasks expected to last about as long: same algo, dataset, family, stage and sharding."""
    return (task.algo, task.dataset, task.family, task.stage, task.num_shards)


class TaskDurations:
    """Expected seconds of a task and where the figure comes from.

    1. this run: the mean wall time of finished tasks of the same kind (`task_kind`);
    2. earlier runs: `earlier[key(task)]`, recorded durations of the same task in earlier
       runs of the same experiment (pita/experiment/durations.py keeps them);
    3. earlier runs of the same kind with another size (more steps, examples, a larger
       model): `scaled(task)`, their seconds scaled by the task's size (durations.py);
    4. work units: `task.work` x seconds per unit, measured on this run's finished tasks,
       else on the earlier runs' ones, else NOMINAL_S_PER_WORK: no history of its own.
    """

    def __init__(
        self,
        earlier: dict[str, float] | None = None,
        key: Callable[[TaskSpec], str] = lambda t: t.id,
        scaled: Callable[[TaskSpec], float | None] = lambda t: None,
    ):
        self.earlier = dict(earlier or {})
        self.key = key
        self.scaled = scaled
        self.by_kind: dict[tuple, list[float]] = {}
        self.work_s = self.work_units = 0.0
        # (task, wall) -> the seconds it stands for on one rank: a task that ran on a gang
        # (pita/core/elastic.py) is estimated per rank count from its one-rank figure
        self.one_rank: Callable[[TaskSpec, float], float] = lambda t, s: s

    def observe(self, task: TaskSpec, wall_s: float) -> None:
        wall_s = self.one_rank(task, float(wall_s))
        self.by_kind.setdefault(task_kind(task), []).append(float(wall_s))
        self.work_s += float(wall_s)
        self.work_units += task.work

    def rate(self, tasks: Sequence[TaskSpec] = ()) -> tuple[float, str]:
        """Seconds per work unit: this run's, else the earlier runs' (of `tasks`), else nominal."""
        if self.work_units > 0:
            return self.work_s / self.work_units, THIS_RUN
        known = [(self.earlier[self.key(t)], t.work) for t in tasks if self.key(t) in self.earlier]
        units = sum(w for _, w in known)
        if units > 0:
            return sum(s for s, _ in known) / units, EARLIER
        return NOMINAL_S_PER_WORK, WORK_UNITS

    def history(self, task: TaskSpec) -> tuple[float, str] | None:
        """(seconds, source) from a measured duration of this task or its kind, else None."""
        seen = self.by_kind.get(task_kind(task))
        if seen:
            return sum(seen) / len(seen), THIS_RUN
        key = self.key(task)
        if key in self.earlier:
            return self.earlier[key], EARLIER
        scaled = self.scaled(task)
        return None if scaled is None else (scaled, SCALED)

    def estimate(self, task: TaskSpec, rate: tuple[float, str] | None = None) -> tuple[float, str]:
        known = self.history(task)
        if known is not None:
            return known
        per_unit, source = rate or self.rate()
        return task.work * per_unit, source


# Below this share of its work done, a task's projection (elapsed / share) is mostly its
# start-up (model load, tokenizing): the estimate still counts when it says more is left.
EARLY_FRACTION = 0.05
# A task with no progress is "unknown" only this long past its estimate: estimates of
# short tasks are noisy, and a stage's first progress line takes a heartbeat to arrive.
OVERDUE_GRACE_S = 10.0
PROGRESS_RE = re.compile(r"^(?P<unit>[A-Za-z][\w-]*) (?P<done>\d+)/(?P<total>\d+)(?:\s|$)")


def progress_line(done: int, total: int, unit: str = "step", detail: str = "") -> str:
    """`step 412/1000 loss 0.31`: the one form a stage's progress takes in its heartbeat
    (`StageContext.report_progress` writes it, `parse_progress` reads it back here)."""
    return f"{unit} {int(done)}/{int(total)} {detail}".strip()


def parse_progress(line: str) -> float | None:
    """The share of its work a task has done (0..1) from its last heartbeat line, or None
    when the line is not a `progress_line` (a stage that reports no totals)."""
    m = PROGRESS_RE.match(line or "")
    if m is None or int(m["total"]) <= 0:
        return None
    return min(1.0, int(m["done"]) / int(m["total"]))


def task_left(
    estimate: float,
    elapsed: float,
    fraction: float | None,
    first: tuple[float, float] = (0.0, 0.0),
) -> float | None:
    """Seconds a running task has left, or None when nothing can say (past its estimate and
    no progress reported).

    With progress f > 0: the task's own pace. Measured from `first` (seconds into the task
    and share done when its progress was first seen) once EARLY_FRACTION more is done, so
    its start-up (model load, a trainer's set-up) or a resumed checkpoint's steps do not
    count as pace; before that, elapsed x (1 - f) / f, and while f is below
    EARLY_FRACTION the estimate's `estimate - elapsed` wins when larger. Without progress:
    what is left of the estimate while there is some, then (OVERDUE_GRACE_S past it)
    unknown: a task well past its estimate is never counted as about to end.
    """
    if fraction is not None and fraction > 0:
        e0, f0 = first
        if fraction - f0 >= EARLY_FRACTION and elapsed > e0:
            return (elapsed - e0) * (1.0 - fraction) / (fraction - f0)
        projected = elapsed * (1.0 - fraction) / fraction
        if fraction < EARLY_FRACTION:
            return max(projected, estimate - elapsed)
        return projected
    if elapsed < estimate + OVERDUE_GRACE_S:
        return max(0.0, estimate - elapsed)
    return None


@dataclass
class Remaining:
    """What an `Eta` says at one moment."""

    seconds: float  # the unfinished plan simulated on the devices (unknown tasks: 0 s left)
    source: str  # where most of the expected seconds come from
    left: dict[str, float | None] = field(default_factory=dict)  # running task -> s left
    fraction: dict[str, float] = field(default_factory=dict)  # running task -> share done
    elapsed: dict[str, float] = field(default_factory=dict)  # running task -> s run
    expected: dict[str, float] = field(default_factory=dict)  # running task -> its estimate

    @property
    def unknown(self) -> list[str]:
        """Running tasks past their estimate that report no progress."""
        return [tid for tid, left in self.left.items() if left is None]


class Eta:
    """Seconds left for a plan: simulate the unfinished tasks with their expected durations,
    the running ones with what their progress says is left (`task_left`)."""

    def __init__(
        self,
        tasks: dict[str, TaskSpec],
        finished: set[str],
        durations: TaskDurations,
        scheduler: Scheduler,
    ):
        self.tasks = tasks
        self.finished = set(finished)  # done, failed or skipped: nothing left to wait for
        self.durations = durations
        self.scheduler = scheduler
        # (task, one-rank seconds) -> seconds on the task's `gpus` ranks (elastic tasks)
        self.at_ranks: Callable[[TaskSpec, float], float] = lambda t, s: s
        # tasks sharing the host's cores (fake / CPU devices): durations count as work, the
        # seconds each would take alone (pita/core/host_share.py)
        host = getattr(scheduler, "host", None)
        self.clock = ShareClock(host) if host is not None else None
        self.outside: Callable[[float], float] = outside_load  # other users' runnable threads
        self.felt: list[float] = []  # ... as this run's last finished tasks felt them

    def task_started(self, task: TaskSpec, now: float) -> None:
        if self.clock is not None:
            self.clock.start(task.id, self.clock.share.demand(task), now)

    def task_ended(
        self, task: TaskSpec, now: float, wall_s: float | None = None, cpu_s: float | None = None
    ) -> None:
        """A task ended; `wall_s`: it finished in that time, and its work is learned
        (`HostShare.work`: its CPU seconds `cpu_s`, or its wall time x the host's mean rate
        while it ran)."""
        if wall_s is None:
            if self.clock is not None:
                self.clock.stop(task.id, now)
            return
        work = float(wall_s)
        if self.clock is not None and task.id in self.clock.running:
            ran = self.clock.running_for(task.id, now)
            asked = self.clock.mean_demand(task.id, now)
            done = self.clock.stop(task.id, now) or 0.0
            work = self.clock.share.work(work, done / ran if ran > 0 else 1.0, cpu_s, task.gpus)
            felt = None
            if cpu_s is not None and task.gpus <= 1:
                felt = felt_outside(self.clock.share, cpu_s, float(wall_s), asked)
            if felt is not None:  # what other users' load really took, not the load average
                self.felt = [*self.felt[-7:], felt]
        self.durations.observe(task, work)

    def _scheduler(self) -> Scheduler:
        """A fresh copy of the run's scheduler; its host share counts other users' load now."""
        out = fresh_scheduler(self.scheduler)
        if out.host is not None:
            ours = self.clock.demand if self.clock is not None else 0.0
            felt = sorted(self.felt)[len(self.felt) // 2] if self.felt else None
            out.host = replace(out.host, external=self.outside(ours) if felt is None else felt)
        return out

    def worked(self, task_id: str, started: float, now: float) -> float:
        """Seconds of its own work a running task has done (its wall time on its own cores)."""
        done = self.clock.worked(task_id, now) if self.clock is not None else None
        return max(0.0, now - started) if done is None else done

    def estimate(
        self,
        started: dict[str, float],
        now: float,
        fractions: Mapping[str, float | None] | None = None,
        first: Mapping[str, tuple[float, float]] | None = None,
    ) -> Remaining:
        """The plan's time left given the running tasks' start times, progress shares and
        (`first`) when their progress was first seen (see `task_left`)."""
        fractions, first = fractions or {}, first or {}
        left = {tid: t for tid, t in self.tasks.items() if tid not in self.finished}
        out = Remaining(0.0, THIS_RUN)
        if not left:
            return out
        rate = self.durations.rate(list(self.tasks.values()))
        expected = {}
        for tid, t in left.items():
            s, source = self.durations.estimate(t, rate)
            expected[tid] = (self.at_ranks(t, s), source)
        pace: dict[tuple, float] = {}  # kind -> longest projected total of a running task
        for tid in started:
            if tid not in left:
                continue
            elapsed, f = self.worked(tid, started[tid], now), fractions.get(tid)
            out.elapsed[tid], out.expected[tid] = elapsed, expected[tid][0]
            remaining = task_left(expected[tid][0], elapsed, f, first.get(tid, (0.0, 0.0)))
            out.left[tid] = remaining
            if f is not None:
                out.fraction[tid] = f
            if f is not None and f >= EARLY_FRACTION and remaining is not None:
                kind = task_kind(left[tid])
                pace[kind] = max(pace.get(kind, 0.0), elapsed + remaining)
        seconds: dict[str, float] = {}
        weight: dict[str, float] = {}
        for tid, t in left.items():
            s, source = expected[tid]
            if tid in started:
                s = out.left[tid] or 0.0
                if out.fraction.get(tid, 0.0) >= EARLY_FRACTION:
                    source = PACE
            elif pace.get(task_kind(t), 0.0) > s:  # a running task of its kind is slower
                s, source = pace[task_kind(t)], PACE
            seconds[tid] = s
            weight[source] = weight.get(source, 0.0) + s
        out.seconds = simulate_remaining(left, self._scheduler(), seconds, set(started) & set(left))
        out.source = max(weight, key=lambda k: weight[k])
        return out

    def source(self) -> str:
        """Where most of the unfinished tasks' expected seconds come from (no simulation)."""
        rate = self.durations.rate(list(self.tasks.values()))
        weight: dict[str, float] = {}
        for tid, t in self.tasks.items():
            if tid not in self.finished:
                s, source = self.durations.estimate(t, rate)
                weight[source] = weight.get(source, 0.0) + self.at_ranks(t, s)
        return max(weight, key=lambda k: weight[k]) if weight else THIS_RUN

    def remaining(
        self,
        started: dict[str, float],
        now: float,
        fractions: Mapping[str, float | None] | None = None,
    ) -> tuple[float, str]:
        """(seconds left, source of most of them): `estimate` in short."""
        r = self.estimate(started, now, fractions)
        return r.seconds, r.source


ETA_REFRESH_S = 2.0  # the live table's ETA is recomputed at most this often
# The live ETA while most of what is left has no measured duration (no earlier run, no
# finished task of this run): a figure from work units alone was 40x too small (issue 45).
NO_MEASURE_YET = "ETA unknown until a task finishes (no earlier run of these tasks)"


class Progress:
    def __init__(
        self,
        n_tasks: int,
        device_labels: list[str],
        already_done: int = 0,
        live: bool | None = None,
        worker_info: Callable[[], list[dict[str, Any]]] = list,
        eta: Eta | None = None,
        eta_every: int = 0,
        eta_interval_s: float = 60.0,
    ):
        self.n_tasks = n_tasks
        self.labels = device_labels
        self.done = already_done
        self.failed = 0
        self.running: dict[str, list[int]] = {}
        self.done_per_device = [0] * len(device_labels)
        self.live_enabled = sys.stdout.isatty() if live is None else live
        self._live: Any = None  # rich.live.Live while the display runs
        self._handlers: list[tuple[logging.StreamHandler, Any]] = []
        self.t0 = time.time()
        self.worker_info = worker_info  # the executor's workers(): {"task", "progress", ...} each
        self.eta = eta
        # an ETA line in run.log every `eta_every` finished tasks or `eta_interval_s` seconds
        self.eta_every = eta_every or max(1, round(n_tasks / 10))
        self.eta_interval_s = eta_interval_s
        self.started: dict[str, float] = {}  # running task -> when it started
        self._first: dict[str, tuple[float, float]] = {}  # its first progress: (s in, share)
        self._eta: tuple[Remaining, float] | None = None  # (the last estimate, computed at)
        self._eta_stale = False  # a task ended since the last estimate
        self._eta_lock = threading.RLock()
        self._eta_logged = (already_done, time.time())  # (done count, time) of the last line
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    # ---- rendering -----------------------------------------------------------------------
    def _table(self):
        from rich.table import Table

        text = self.eta_text()
        eta = "" if text is None else f", {text}"
        table = Table(
            title=f"pita: {self.done}/{self.n_tasks} tasks done, {len(self.running)} running, "
            f"{self.failed} failed, {time.time() - self.t0:.0f}s{eta}",
            expand=False,
        )
        table.add_column("device")
        table.add_column("done", justify="right")
        table.add_column("running")
        table.add_column("progress")
        table.add_column("latest (step, loss, reward, kl)")
        latest = self.latest_progress()
        for i, label in enumerate(self.labels):
            tasks = [tid for tid, devs in self.running.items() if i in devs]
            table.add_row(
                label,
                str(self.done_per_device[i]),
                "\n".join(self._rank_label(tid, i) for tid in tasks) or "-",
                "\n".join(self.task_progress(t) for t in tasks),
                "\n".join(latest.get(t, "") for t in tasks),
            )
        return table

    def _rank_label(self, task_id: str, device: int) -> str:
        """`id` on one device; `id [rank r/k]` on each device of a k-rank gang."""
        devs = self.running.get(task_id, [])
        if len(devs) < 2:
            return task_id
        return f"{task_id} [rank {devs.index(device)}/{len(devs)}]"

    def task_progress(self, tid: str) -> str:
        """`41 %, 3 min 10 s left` / `past its 2 s estimate, no progress reported` / ``."""
        if self._eta is None or tid not in self._eta[0].elapsed:
            return ""
        r = self._eta[0]
        share = f"{100 * r.fraction[tid]:.0f} %, " if tid in r.fraction else ""
        left = r.left[tid]
        if left is None:
            return f"past its {format_duration(r.expected[tid])} estimate, no progress reported"
        since = time.time() - self._eta[1]
        return f"{share}{format_duration(max(0.0, left - since))} left"

    # ---- ETA -----------------------------------------------------------------------------
    def update_eta(self) -> None:
        """Recompute the ETA (a simulation of every unfinished task); it never takes the
        run down. Task events only mark it stale: it is recomputed when a line is logged,
        or at most every `ETA_REFRESH_S` for the live table, not once per event."""
        if self.eta is None:
            return
        with self._eta_lock:
            now = time.time()
            self._eta_stale = False
            try:
                fractions = {t: parse_progress(line) for t, line in self.latest_progress().items()}
                for tid, f in fractions.items():
                    if f and tid in self.started and tid not in self._first:
                        self._first[tid] = (self.eta.worked(tid, self.started[tid], now), f)
                estimate = self.eta.estimate(dict(self.started), now, fractions, self._first)
            except Exception:  # an estimate, not worth a failed run
                log.debug("ETA estimate failed", exc_info=True)
                return
            self._eta = (estimate, now)

    def eta_left(self) -> tuple[float, str] | None:
        """(seconds left now, source) from the last estimate, counted down since."""
        if (
            (self._eta_stale or self.started)  # running tasks report progress: re-read it
            and self._eta is not None
            and time.time() - self._eta[1] >= ETA_REFRESH_S
        ):
            self.update_eta()
        if self._eta is None:
            return None
        estimate, at = self._eta
        return max(0.0, estimate.seconds - (time.time() - at)), estimate.source

    def eta_text(self) -> str | None:
        """`ETA 4 min 10 s (from this run's durations)`, or, while a running task is past
        its estimate and reports no progress, `ETA unknown: <task> has run 40 min 00 s, past
        its estimate of 2 s, and reports no progress; the rest at least 2 s (...)`."""
        left = self.eta_left()
        if left is None or self._eta is None:
            return None
        estimate, at = self._eta
        if left[1] == WORK_UNITS:  # nothing measured: a work-unit figure can be 40x off
            return NO_MEASURE_YET
        unknown = estimate.unknown
        if not unknown:
            return f"ETA {format_duration(left[0])} ({left[1]})"
        tid = unknown[0]
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        ran = estimate.elapsed[tid] + time.time() - at
        return (
            f"ETA unknown: {tid}{more} has run {format_duration(ran)}, past its estimate of "
            f"{format_duration(estimate.expected[tid])}, and reports no progress; "
            f"the rest at least {format_duration(left[0])} ({left[1]})"
        )

    def eta_line(self) -> str | None:
        """`12/52 tasks, ETA 4 min 10 s (from this run's durations)`, or None before one."""
        text = self.eta_text()
        return None if text is None else f"{self.done}/{self.n_tasks} tasks, {text}"

    def _tick(self) -> None:
        """A line every eta_interval_s even while no task ends (a long training task)."""
        while not self._stop.wait(min(self.eta_interval_s, 30.0)):
            if time.time() - self._eta_logged[1] >= self.eta_interval_s:
                self.update_eta()
                self._maybe_log_eta()

    def _maybe_log_eta(self) -> None:
        count, at = self._eta_logged
        finished = self.done + self.failed
        if finished >= self.n_tasks:
            return  # the end says how long it took
        if finished - count < self.eta_every and time.time() - at < self.eta_interval_s:
            return
        if self._eta_stale:
            self.update_eta()
        line = self.eta_line()
        if line is not None:
            log.info("%s", line)
            self._eta_logged = (finished, time.time())

    def latest_progress(self) -> dict[str, str]:
        """Task id -> the last progress line its worker sent (empty before the first)."""
        try:
            return {
                w["task"]: str(w.get("progress") or "") for w in self.worker_info() if w.get("task")
            }
        except Exception:  # the table must never take the run down
            return {}

    def __enter__(self) -> Progress:
        self.update_eta()
        if self.eta is not None and self.done < self.n_tasks and self.eta_line():
            log.info("%s", self.eta_line())
            self._ticker = threading.Thread(target=self._tick, name="pita-eta", daemon=True)
            self._ticker.start()
        if self.live_enabled:
            from rich.live import Live

            self._live = Live(
                self._table(),
                refresh_per_second=2,
                redirect_stdout=True,
                redirect_stderr=True,
                get_renderable=self._table,
            )
            self._live.__enter__()
            # Route console log handlers through Live's stdout proxy so lines print above it.
            for h in logging.getLogger().handlers:
                if type(h) is logging.StreamHandler and h.stream in (
                    sys.__stdout__,
                    sys.__stderr__,
                ):
                    self._handlers.append((h, h.stream))
                    h.setStream(sys.stdout)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        for h, stream in self._handlers:
            h.setStream(stream)
        if self._live is not None:
            self._live.__exit__(*exc)

    # ---- events from the DagRunner ---------------------------------------------------------
    def event(self, kind: str, task: TaskSpec, info: Any) -> None:
        self._log_event(kind, task, info)
        with self._eta_lock:  # the ticker thread reads these while it recomputes
            now = time.time()
            if kind == "running":
                self.started[task.id] = now
                if self.eta is not None:
                    self.eta.task_started(task, now)
                return
            self.started.pop(task.id, None)
            self._first.pop(task.id, None)
            if self.eta is None:
                return
            if kind == "done":
                cpu = (info.result or {}).get("cpu_s")
                self.eta.task_ended(task, now, info.wall_s, cpu if isinstance(cpu, float) else None)
            elif kind != "skipped":
                self.eta.task_ended(task, now)
            if kind in ("done", "failed", "skipped"):
                self.eta.finished.add(task.id)
            self._eta_stale = True
        if self.eta is not None:
            if kind != "skipped":  # the skips of a failure's dependants follow it at once
                self._maybe_log_eta()

    def _log_event(self, kind: str, task: TaskSpec, info: Any) -> None:
        where = lambda devs: "+".join(self.labels[d] for d in devs)  # noqa: E731
        if kind == "running":
            self.running[task.id] = list(info)
            log.info("[%d/%d] start %s on %s", self.done, self.n_tasks, task.id, where(info))
        elif kind == "done":
            devs = self.running.pop(task.id, [])
            self.done += 1
            for d in devs:
                self.done_per_device[d] += 1
            log.info(
                "[%d/%d] done  %s on %s in %.1fs",
                self.done,
                self.n_tasks,
                task.id,
                where(devs),
                info.wall_s,
            )
            for line in info.result.get(
                "run_log_lines", []
            ):  # e.g. a sharded model's layer distribution
                log.info("  %s: %s", task.id, line)
        elif kind == "retry":
            self.running.pop(task.id, None)
            log.warning("retry %s after %s: %s", task.id, info.failure, info.message)
        elif kind == "failed":
            self.running.pop(task.id, None)
            self.failed += 1
            log.error("FAILED %s (%s): %s", task.id, info.failure, info.message)
        elif kind == "skipped":
            self.failed += 1
            log.warning("skip %s: its dependency %s failed", task.id, info)
