"""Per-device worker processes behind a `concurrent.futures` interface.

`WorkerPool.submit(task, devices, ...)` returns a `Future[TaskOutcome]`. Workers are
fresh Python processes (`subprocess`, not `multiprocessing` spawn, which would re-import
the main script) started with an explicit environment that pins their devices, in their
own process group, talking over an authenticated `multiprocessing.connection` channel.

A background dispatcher thread reads answers and heartbeats and watches liveness: a
worker that exits or is killed mid-task, stops sending heartbeats, or overruns the task
timeout completes its future with a classified failure (`killed`, `timeout`); the parent
never waits forever. A healthy worker is reused for the next task on the same devices
(keeping its model LRU) and recycled after `max_tasks_per_worker` tasks or any OOM /
CUDA fault. It implements the `Executor` protocol (pita/core/executor.py), like the
in-process and Ray executors.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Listener, wait
from pathlib import Path
from typing import Any

from pita.core.errors import RECYCLE_WORKER
from pita.core.executor import TaskOutcome
from pita.core.tasks import TaskSpec

log = logging.getLogger(__name__)

@dataclass
class _Job:
    task: TaskSpec
    future: Future
    message: tuple
    submitted: float
    started: float | None = None


class WorkerHandle:
    """One worker process and what the pool knows about it."""

    def __init__(self, worker_id: int, devices: tuple[int, ...], proc: subprocess.Popen):
        self.worker_id = worker_id
        self.devices = devices
        self.proc = proc
        self.pid = proc.pid
        self.conn = None
        self.state = "starting"  # starting | idle | busy | stopping | dead
        self.job: _Job | None = None
        self.tasks_run = 0
        self.started_at = time.time()
        self.last_seen = time.time()
        self.stats: dict[str, Any] = {}
        self.env_devices = ""

    def info(self) -> dict[str, Any]:
        return {
            "worker_id": self.worker_id, "pid": self.pid, "devices": list(self.devices), "state": self.state,
            "task": self.job.task.id if self.job else None, "tasks_run": self.tasks_run, **self.stats,
        }


class WorkerPool:
    def __init__(self, gpu_manager, *, max_tasks_per_device: int = 1, max_tasks_per_worker: int = 200,
                 task_timeout_s: float = 7200.0, heartbeat_s: float = 2.0, heartbeat_timeout_s: float = 120.0,
                 start_timeout_s: float = 300.0, model_cache_size: int = 2, preimport: bool = True,
                 extra_env: dict[str, str] | None = None, log_dir: Path | None = None):
        self.gpu = gpu_manager
        self.log_dir = Path(log_dir) if log_dir else None
        self.max_tasks_per_device = max_tasks_per_device
        self.max_tasks_per_worker = max_tasks_per_worker
        self.task_timeout_s = task_timeout_s
        self.heartbeat_s = heartbeat_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.start_timeout_s = start_timeout_s
        self.model_cache_size = model_cache_size
        self.preimport = preimport
        self.extra_env = extra_env or {}
        self._authkey = secrets.token_bytes(32)
        # backlog: 8 workers connecting at once overflow the default backlog of 1 and a
        # dropped connection leaves a worker blocked in Client() until start_timeout_s.
        self._listener = Listener(("127.0.0.1", 0), authkey=self._authkey, backlog=64)
        self._lock = threading.RLock()
        self._workers: dict[int, WorkerHandle] = {}
        self._next_id = 0
        self._closed = False
        threading.Thread(target=self._accept_loop, name="pita-accept", daemon=True).start()
        self._dispatcher = threading.Thread(target=self._dispatch_loop, name="pita-dispatch", daemon=True)
        self._dispatcher.start()

    @classmethod
    def from_config(cls, gpu_manager, executor_cfg, extra_env: dict[str, str] | None = None,
                    log_dir: Path | None = None) -> WorkerPool:
        from pita.core.resources import max_tasks_per_device

        cap = max_tasks_per_device(executor_cfg.max_tasks_per_gpu, gpu_manager.kind, len(gpu_manager.devices))
        return cls(
            gpu_manager, max_tasks_per_device=cap,
            max_tasks_per_worker=executor_cfg.max_tasks_per_worker, task_timeout_s=executor_cfg.task_timeout_s,
            heartbeat_s=executor_cfg.heartbeat_s, heartbeat_timeout_s=executor_cfg.heartbeat_timeout_s,
            model_cache_size=executor_cfg.model_cache_size, preimport=executor_cfg.preimport, extra_env=extra_env,
            log_dir=log_dir,
        )

    # ---- public interface ----------------------------------------------------------------
    def submit(self, task: TaskSpec, devices: list[int] | tuple[int, ...], cfg_dict: dict, run_dir: str | Path,
               attempt: int = 1) -> Future[TaskOutcome]:
        """Run `task` on a worker pinned to exactly `devices`; the future never raises."""
        devices = tuple(devices)
        future: Future = Future()
        job = _Job(task, future, ("run", task.to_dict(), cfg_dict, str(run_dir), attempt), time.time())
        with self._lock:
            if self._closed:
                raise RuntimeError("pool is shut down")
            worker = self._idle_worker(devices) or self._spawn(devices)
            worker.job = job
            if worker.state == "idle":
                self._send_job(worker)
            # a starting worker gets its job when it says hello
        return future

    def warm_up(self, device_sets: list[tuple[int, ...]]) -> None:
        """Start workers ahead of time so their slow imports overlap other work."""
        with self._lock:
            for devices in device_sets:
                if not any(w.devices == tuple(devices) and w.state != "dead" for w in self._workers.values()):
                    self._spawn(tuple(devices))

    def workers(self) -> list[dict[str, Any]]:
        with self._lock:
            return [w.info() for w in self._workers.values() if w.state != "dead"]

    def worker_pids(self) -> list[int]:
        with self._lock:
            return [w.pid for w in self._workers.values() if w.state != "dead"]

    def shutdown(self, kill: bool = False, grace_s: float = 5.0) -> None:
        """Stop every worker (kill=True: signal their process groups at once)."""
        with self._lock:
            self._closed = True
            workers = [w for w in self._workers.values() if w.state != "dead"]
        for w in workers:
            if kill or w.conn is None:
                self._signal_group(w, signal.SIGTERM)
            else:
                try:
                    w.conn.send(("stop",))
                except (OSError, EOFError):
                    self._signal_group(w, signal.SIGTERM)
        deadline = time.time() + grace_s
        for w in workers:
            try:
                w.proc.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                self._signal_group(w, signal.SIGKILL)
                w.proc.wait(timeout=5)
            with self._lock:
                if w.job and not w.job.future.done():
                    w.job.future.set_result(TaskOutcome(w.job.task.id, False, "killed", "run interrupted",
                                                        worker_pid=w.pid, devices=w.devices))
                w.state = "dead"
        with self._lock:
            for w in self._workers.values():
                if w.conn is not None:
                    w.conn.close()
                    w.conn = None
        self._wake_accept_loop()

    def _wake_accept_loop(self) -> None:
        """Closing a listening socket does not wake a thread blocked in accept() on Linux:
        shut the socket down, which does, then close it (no port left in LISTEN)."""
        import socket

        try:
            self._listener._listener._socket.shutdown(socket.SHUT_RDWR)
        except (AttributeError, OSError):
            pass
        try:
            self._listener.close()
        except OSError:
            pass

    # ---- workers ---------------------------------------------------------------------------
    def _idle_worker(self, devices: tuple[int, ...]) -> WorkerHandle | None:
        for w in self._workers.values():
            if w.devices == devices and w.job is None and w.state in ("idle", "starting"):
                return w
        return None

    def _spawn(self, devices: tuple[int, ...]) -> WorkerHandle:
        self._evict_idle_overlapping(devices)
        env = self.gpu.worker_env(list(devices))
        env.update(self._thread_env())
        env.update(self.extra_env)
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        worker_id = self._next_id
        self._next_id += 1
        host, port = self._listener.address
        cmd = [sys.executable, "-m", "pita.runtime.worker", "--address", f"{host}:{port}",
               "--worker-id", str(worker_id), "--heartbeat-s", str(self.heartbeat_s),
               "--cache-size", str(self.model_cache_size)]
        if self.preimport:
            cmd.append("--preimport")
        out = None
        if self.log_dir is not None:  # a worker's own stdout/stderr (library noise, crashes)
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"worker-{worker_id}.log", "ab")
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=out, stderr=out,
                                start_new_session=True, cwd=root)
        if out is not None:
            out.close()  # the child holds its own descriptor
        proc.stdin.write((self._authkey.hex() + "\n").encode())
        proc.stdin.close()
        handle = WorkerHandle(worker_id, devices, proc)
        handle.env_devices = env.get("CUDA_VISIBLE_DEVICES", "")
        self._workers[worker_id] = handle
        log.debug("started worker %d (pid %d) on devices %s, CUDA_VISIBLE_DEVICES=%r", worker_id, proc.pid,
                  devices, handle.env_devices)
        return handle

    def _thread_env(self) -> dict[str, str]:
        """CPU threads are a budget: packed workers on a GPU host share the cores (issue 11)."""
        from pita.core.resources import thread_budget, thread_env

        kind = getattr(self.gpu, "kind", "cpu")
        n = thread_budget(kind, len(self.gpu.devices), self.max_tasks_per_device,
                          getattr(self.gpu, "threads_per_worker", 1))
        return thread_env(n) if kind != "cpu" else {}

    def _evict_idle_overlapping(self, devices: tuple[int, ...]) -> None:
        """Keep at most max_tasks_per_device live workers on each device."""
        for d in devices:
            on_device = [w for w in self._workers.values() if d in w.devices and w.state != "dead"]
            excess = len(on_device) + 1 - self.max_tasks_per_device
            for w in on_device:
                if excess <= 0:
                    break
                if w.job is None and w.state in ("idle", "starting"):
                    self._retire(w)
                    excess -= 1

    def _retire(self, w: WorkerHandle) -> None:
        w.state = "stopping"
        try:
            if w.conn is not None:
                w.conn.send(("stop",))
            else:
                self._signal_group(w, signal.SIGTERM)
        except (OSError, EOFError):
            self._signal_group(w, signal.SIGTERM)

    @staticmethod
    def _signal_group(w: WorkerHandle, sig: int) -> None:
        try:
            os.killpg(w.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _send_job(self, w: WorkerHandle) -> None:
        try:
            w.conn.send(w.job.message)
            w.state = "busy"
            w.job.started = time.time()
        except (OSError, EOFError) as exc:
            self._finish(w, TaskOutcome(w.job.task.id, False, "killed", f"could not reach worker: {exc}"))
            self._signal_group(w, signal.SIGKILL)
            w.state = "dead"

    def _finish(self, w: WorkerHandle, outcome: TaskOutcome) -> None:
        job = w.job
        w.job = None
        if job is None or job.future.done():
            return
        outcome.worker_pid = w.pid
        outcome.devices = w.devices
        if not outcome.wall_s and job.started:
            outcome.wall_s = round(time.time() - job.started, 3)
        job.future.set_result(outcome)

    # ---- background threads ----------------------------------------------------------------
    def _accept_loop(self) -> None:
        while True:
            try:
                conn = self._listener.accept()
            except (OSError, EOFError):
                if self._closed:
                    return
                continue  # a bad authkey or a dropped connection: ignore that client
            try:
                if not conn.poll(30):
                    conn.close()
                    continue
                kind, worker_id, pid = conn.recv()
            except (OSError, EOFError, ValueError):
                continue
            with self._lock:
                w = self._workers.get(worker_id)
                if kind != "hello" or w is None or w.pid != pid:
                    conn.close()
                    continue
                w.conn = conn
                w.last_seen = time.time()
                if w.state == "starting":
                    w.state = "idle"
                    if w.job is not None:
                        self._send_job(w)

    def _dispatch_loop(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                conns = {w.conn: w for w in self._workers.values() if w.conn is not None and w.state != "dead"}
            ready = wait(list(conns), timeout=0.1) if conns else (time.sleep(0.05) or [])
            with self._lock:
                for conn in ready:
                    self._drain(conns[conn])
                self._check_liveness()

    def _drain(self, w: WorkerHandle) -> None:
        try:
            while w.conn is not None and w.conn.poll():
                self._handle(w, w.conn.recv())
        except (EOFError, OSError):
            w.conn = None  # the process check below classifies the exit

    def _handle(self, w: WorkerHandle, msg: tuple) -> None:
        w.last_seen = time.time()
        kind = msg[0]
        if kind == "heartbeat":
            w.stats = msg[2]
        elif kind == "started":
            if w.job:
                w.job.started = time.time()
        elif kind == "done":
            _, task_id, result, stats = msg
            w.stats = stats
            w.tasks_run += 1
            job, w.job, w.state = w.job, None, "idle"  # idle before the future completes:
            if w.tasks_run >= self.max_tasks_per_worker:  # a callback may submit again at once
                self._retire(w)
            w.job = job
            self._finish(w, TaskOutcome(task_id, True, result=result, wall_s=result.get("wall_s", 0.0)))
        elif kind == "failed":
            _, task_id, failure, message, stats = msg
            w.stats = stats
            w.tasks_run += 1
            # the worker exits by itself after an OOM / CUDA fault: never reuse it
            w.state = "stopping" if failure in RECYCLE_WORKER else "idle"
            self._finish(w, TaskOutcome(task_id, False, failure, message))

    def _check_liveness(self) -> None:
        now = time.time()
        for w in list(self._workers.values()):
            if w.state == "dead":
                continue
            code = w.proc.poll()
            if code is not None:
                if w.conn is not None:
                    self._drain(w)
                if w.job is not None:
                    how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
                    self._finish(w, TaskOutcome(w.job.task.id, False, "killed",
                                                f"worker pid {w.pid} died ({how}) during the task"))
                w.state = "dead"
                if w.conn is not None:
                    w.conn.close()
                continue
            if w.job is not None and w.job.started and now - w.job.started > self.task_timeout_s:
                self._signal_group(w, signal.SIGKILL)
                self._finish(w, TaskOutcome(w.job.task.id, False, "timeout",
                                            f"exceeded executor.task_timeout_s={self.task_timeout_s:g}s; killed"))
            elif w.state == "starting" and now - w.started_at > self.start_timeout_s:
                self._signal_group(w, signal.SIGKILL)
                if w.job is not None:
                    self._finish(w, TaskOutcome(w.job.task.id, False, "killed",
                                                f"worker did not start within {self.start_timeout_s:g}s"))
            elif w.state == "busy" and now - w.last_seen > self.heartbeat_timeout_s:
                self._signal_group(w, signal.SIGKILL)
                self._finish(w, TaskOutcome(w.job.task.id, False, "killed",
                                            f"no heartbeat for {self.heartbeat_timeout_s:g}s; worker killed"))
