"""What the user sees while a run goes: one line per task event in run.log, and on a
terminal a live table of tasks running and done per device (rich), with each running
task's latest progress line (a training stage's step, loss, reward and KL) as its
worker last reported it in a heartbeat."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from pita.core.tasks import TaskSpec

log = logging.getLogger("pita.progress")


class Progress:
    def __init__(
        self,
        n_tasks: int,
        device_labels: list[str],
        already_done: int = 0,
        live: bool | None = None,
        worker_info: Callable[[], list[dict[str, Any]]] = list,
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

    # ---- rendering -----------------------------------------------------------------------
    def _table(self):
        from rich.table import Table

        table = Table(
            title=f"pita: {self.done}/{self.n_tasks} tasks done, {len(self.running)} running, "
            f"{self.failed} failed, {time.time() - self.t0:.0f}s",
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
                "\n".join(tasks) or "-",
                "\n".join(latest.get(t, "") for t in tasks),
            )
        return table

    def latest_progress(self) -> dict[str, str]:
        """Task id -> the last progress line its worker sent (empty before the first)."""
        try:
            return {
                w["task"]: str(w.get("progress") or "") for w in self.worker_info() if w.get("task")
            }
        except Exception:  # the table must never take the run down
            return {}

    def __enter__(self) -> Progress:
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
        for h, stream in self._handlers:
            h.setStream(stream)
        if self._live is not None:
            self._live.__exit__(*exc)

    # ---- events from the DagRunner ---------------------------------------------------------
    def event(self, kind: str, task: TaskSpec, info: Any) -> None:
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
