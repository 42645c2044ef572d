"""What the user sees while a run goes: one line per task event in run.log, and on a
terminal a live table of tasks running and done per device (rich), with each running
task's latest progress line (a training stage's step, loss, reward and KL) as its
worker last reported it in a heartbeat.

The ETA (in the table's title and a run.log line every few tasks) simulates what is left of
the plan on the run's devices (`simulate_remaining`, the dry run's event simulation) with
each task's expected duration from `TaskDurations`: this run's finished tasks of the same
kind first, then earlier runs' recorded durations, then the planner's work units.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from pita.core.parallel_executor import Scheduler, fresh_scheduler, simulate_remaining
from pita.core.tasks import TaskSpec

log = logging.getLogger("pita.progress")

# Seconds per planner work unit before anything was measured (neither in this run nor in an
# earlier one): the default experiment took 765 task seconds for 90.4 units on a 2-core CPU.
NOMINAL_S_PER_WORK = 8.0
THIS_RUN, EARLIER, WORK_UNITS = (
    "from this run's durations",
    "from earlier runs' durations",
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
       runs of the same experiment (pita/experiment/timeline.py keeps them);
    3. work units: `task.work` x seconds per unit, measured on this run's finished tasks,
       else on the earlier runs' ones, else NOMINAL_S_PER_WORK.
    """

    def __init__(
        self,
        earlier: dict[str, float] | None = None,
        key: Callable[[TaskSpec], str] = lambda t: t.id,
    ):
        self.earlier = dict(earlier or {})
        self.key = key
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

    def estimate(self, task: TaskSpec, rate: tuple[float, str] | None = None) -> tuple[float, str]:
        seen = self.by_kind.get(task_kind(task))
        if seen:
            return sum(seen) / len(seen), THIS_RUN
        key = self.key(task)
        if key in self.earlier:
            return self.earlier[key], EARLIER
        per_unit, source = rate or self.rate()
        return task.work * per_unit, source


class Eta:
    """Seconds left for a plan: simulate the unfinished tasks with their expected durations."""

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

    def remaining(self, started: dict[str, float], now: float) -> tuple[float, str]:
        """(seconds left, source of most of them) given the running tasks' start times."""
        left = {tid: t for tid, t in self.tasks.items() if tid not in self.finished}
        if not left:
            return 0.0, THIS_RUN
        rate = self.durations.rate(list(self.tasks.values()))
        seconds: dict[str, float] = {}
        weight: dict[str, float] = {}
        for tid, t in left.items():
            s, source = self.durations.estimate(t, rate)
            s = self.at_ranks(t, s)
            if tid in started:  # what is left of it (at least a little: it has not ended)
                s = max(0.05 * s, s - (now - started[tid]))
            seconds[tid] = s
            weight[source] = weight.get(source, 0.0) + s
        total = simulate_remaining(left, fresh_scheduler(self.scheduler), seconds, set(started))
        return total, max(weight, key=lambda k: weight[k])


ETA_REFRESH_S = 2.0  # the live table's ETA is recomputed at most this often


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
        self._eta: tuple[float, str, float] | None = None  # (seconds left, source, computed at)
        self._eta_stale = False  # a task ended since the last estimate
        self._eta_lock = threading.RLock()
        self._eta_logged = (already_done, time.time())  # (done count, time) of the last line
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    # ---- rendering -----------------------------------------------------------------------
    def _table(self):
        from rich.table import Table

        left = self.eta_left()
        eta = "" if left is None else f", ETA {format_duration(left[0])}"
        table = Table(
            title=f"pita: {self.done}/{self.n_tasks} tasks done, {len(self.running)} running, "
            f"{self.failed} failed, {time.time() - self.t0:.0f}s{eta}",
            expand=False,
        )
        table.add_column("device")
        table.add_column("done", justify="right")
        table.add_column("running")
        table.add_column("latest (step, loss, reward, kl)")
        latest = self.latest_progress()
        for i, label in enumerate(self.labels):
            tasks = [tid for tid, devs in self.running.items() if i in devs]
            table.add_row(
                label,
                str(self.done_per_device[i]),
                "\n".join(self._rank_label(tid, i) for tid in tasks) or "-",
                "\n".join(latest.get(t, "") for t in tasks),
            )
        return table

    def _rank_label(self, task_id: str, device: int) -> str:
        """`id` on one device; `id [rank r/k]` on each device of a k-rank gang."""
        devs = self.running.get(task_id, [])
        if len(devs) < 2:
            return task_id
        return f"{task_id} [rank {devs.index(device)}/{len(devs)}]"

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
                seconds, source = self.eta.remaining(dict(self.started), now)
            except Exception:  # an estimate, not worth a failed run
                log.debug("ETA estimate failed", exc_info=True)
                return
            self._eta = (seconds, source, now)

    def eta_left(self) -> tuple[float, str] | None:
        """(seconds left now, source) from the last estimate, counted down since."""
        if (
            self._eta_stale
            and self._eta is not None
            and time.time() - self._eta[2] >= ETA_REFRESH_S
        ):
            self.update_eta()
        if self._eta is None:
            return None
        seconds, source, at = self._eta
        return max(0.0, seconds - (time.time() - at)), source

    def eta_line(self) -> str | None:
        """`12/52 tasks, ETA 4 min 10 s (from this run's durations)`, or None before one."""
        left = self.eta_left()
        if left is None:
            return None
        return f"{self.done}/{self.n_tasks} tasks, ETA {format_duration(left[0])} ({left[1]})"

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
            if kind == "running":
                self.started[task.id] = time.time()
                return
            self.started.pop(task.id, None)
            if self.eta is None:
                return
            if kind == "done":
                self.eta.durations.observe(task, info.wall_s)
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
