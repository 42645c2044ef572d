"""Per-device worker processes behind a `concurrent.futures` interface.

`WorkerPool.submit(task, devices, ...)` returns a `Future[TaskOutcome]`. Workers are
processes with an explicit environment that pins their devices, in their own process
group: on CUDA fresh Python processes (`subprocess`, not `multiprocessing` spawn, which
would re-import the main script), on CPU and fake devices children of a forkserver that
imported torch once (pita/core/forked_worker.py). They talk over a `multiprocessing.connection` channel: a Unix socket in
a private (0700) folder, so other local users cannot even connect, and an HMAC challenge
per connection, run on its own thread with a timeout, so a same-user client with a wrong
key or a silent socket is dropped without blocking the next worker's connection.

A background dispatcher thread reads answers and heartbeats and watches liveness: a
worker that exits or is killed mid-task, stops sending heartbeats, does not connect
within `executor.start_timeout_s`, or overruns the task timeout completes its future with
a classified failure (`killed`, `timeout`) and is never given another task; the parent
never waits forever. The background threads catch and report every error; if one stops
anyway, `broken` says why and the run fails loudly instead of waiting. A healthy worker
is reused for the next task on the same devices (keeping its model LRU) and recycled after `max_tasks_per_worker` tasks or any OOM /
CUDA fault. It implements the `Executor` protocol (pita/core/executor.py), like the
in-process and Ray executors.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import (
    Connection,
    Listener,
    answer_challenge,
    deliver_challenge,
    wait,
)
from pathlib import Path
from typing import Any

from pita.core.errors import RECYCLE_WORKER, ExecutorBroken
from pita.core.executor import Devices, StrPath, TaskOutcome
from pita.core.forked_worker import (
    WORKER_MODULE,
    WorkerProcess,
    forks_workers,
    kill_at_exit,
    start_forked_worker,
    start_forkserver,
)
from pita.core.paths import pythonpath_with, writable_log
from pita.core.tasks import TaskSpec

log = logging.getLogger(__name__)

ROOT = str(Path(__file__).resolve().parents[2])  # the checkout: a worker's cwd and PYTHONPATH
AUTH_TIMEOUT_S = 10.0  # a connecting client must authenticate and say hello within this
STOP_GRACE_S = 30.0  # a worker told to stop (or killed) that is still alive after this is SIGKILLed
MAX_LOOP_ERRORS = 20  # consecutive errors after which a background thread gives up (run fails)


@dataclass
class _Job:
    task: TaskSpec
    future: Future
    message: tuple
    started: float | None = None
    devices: tuple[int, ...] = ()  # what the task was given (a gang hosted by a one-device worker)


class WorkerHandle:
    """One worker process and what the pool knows about it."""

    def __init__(self, worker_id: int, devices: tuple[int, ...], proc: WorkerProcess):
        self.worker_id = worker_id
        self.devices = devices
        self.proc = proc
        self.pid = proc.pid
        self.conn: Connection | None = None
        self.state = (
            "starting"  # starting | idle | busy | stopping | dead (never reused once stopping)
        )
        self.stopping_since = 0.0
        self.job: _Job | None = None
        self.tasks_run = 0
        self.started_at = time.time()
        self.last_seen = time.time()
        self.stats: dict[str, Any] = {}
        self.env_devices = ""

    def info(self) -> dict[str, Any]:
        return {
            "worker_id": self.worker_id,
            "pid": self.pid,
            "devices": list(self.devices),
            "state": self.state,
            "task": self.job.task.id if self.job else None,
            "tasks_run": self.tasks_run,
            **self.stats,
        }


class WorkerPool:
    def __init__(
        self,
        gpu_manager,
        *,
        max_tasks_per_device: int = 1,
        max_tasks_per_worker: int = 200,
        task_timeout_s: float = 7200.0,
        heartbeat_s: float = 2.0,
        heartbeat_timeout_s: float = 120.0,
        start_timeout_s: float = 60.0,
        model_cache_size: int = 2,
        preimport: bool = True,
        extra_env: dict[str, str] | None = None,
        log_dir: Path | None = None,
        auth_timeout_s: float = AUTH_TIMEOUT_S,
        fork_workers: bool | None = None,
        pending: int = 1,
    ):
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
        self.auth_timeout_s = auth_timeout_s
        self.broken: str | None = None  # why a background thread stopped (the run must fail)
        self.rejected_connections = 0
        self._authkey = secrets.token_bytes(32)
        # A Unix socket in a folder only this user can enter (mkdtemp: 0700). No authkey on
        # the Listener itself: its accept() runs the challenge inline, so one silent client
        # would block every later worker; each connection is authenticated on its own thread.
        # backlog: 8 workers connecting at once overflow the default backlog of 1.
        remove_dead_socket_dirs()  # a SIGKILLed orchestrator could not remove its own
        # CPU and fake-device workers fork from a forkserver that imported torch once
        # (pita/core/forked_worker.py); a worker that imports nothing up front (preimport
        # off) or must see its GPUs from its first instruction (CUDA) starts fresh.
        # `fork_workers` overrides the choice (bench/worker_start.py compares both); with no
        # task `pending` (a finished run's resume writes its report) there is nothing to fork.
        if fork_workers is None:
            fork_workers = forks_workers(getattr(gpu_manager, "kind", "cpu"), preimport, pending)
        self.fork_workers = fork_workers
        if self.fork_workers:
            start_forkserver(self._worker_env(()))
            kill_at_exit(self.worker_pids)
        self._sock_dir = tempfile.mkdtemp(prefix=f"{SOCKET_DIR_PREFIX}{os.getpid()}-")
        self._listener = Listener(os.path.join(self._sock_dir, "c"), family="AF_UNIX", backlog=64)
        self._lock = threading.RLock()
        self._workers: dict[int, WorkerHandle] = {}
        self._next_id = 0
        self._closed = False
        self._start_thread("pita-accept", self._accept_loop)
        self._start_thread("pita-dispatch", self._dispatch_loop)

    @classmethod
    def from_config(
        cls,
        gpu_manager,
        executor_cfg,
        extra_env: dict[str, str] | None = None,
        log_dir: Path | None = None,
        pending: int = 1,
    ) -> WorkerPool:
        from pita.core.resources import max_tasks_per_device

        cap = max_tasks_per_device(
            executor_cfg.max_tasks_per_gpu, gpu_manager.kind, len(gpu_manager.devices)
        )
        return cls(
            gpu_manager,
            max_tasks_per_device=cap,
            max_tasks_per_worker=executor_cfg.max_tasks_per_worker,
            task_timeout_s=executor_cfg.task_timeout_s,
            heartbeat_s=executor_cfg.heartbeat_s,
            heartbeat_timeout_s=executor_cfg.heartbeat_timeout_s,
            start_timeout_s=executor_cfg.start_timeout_s,
            model_cache_size=executor_cfg.model_cache_size,
            preimport=executor_cfg.preimport,
            extra_env=extra_env,
            log_dir=log_dir,
            pending=pending,
        )

    # ---- public interface ----------------------------------------------------------------
    def submit(
        self, task: TaskSpec, devices: Devices, cfg_dict: dict, run_dir: StrPath, attempt: int = 1
    ) -> Future[TaskOutcome]:
        """Run `task` on a worker pinned to exactly `devices`; the future never raises."""
        devices = tuple(devices)
        future: Future = Future()
        job = _Job(
            task, future, ("run", task.to_dict(), cfg_dict, str(run_dir), attempt), devices=devices
        )
        with self._lock:
            if self._closed:
                raise RuntimeError("pool is shut down")
            if self.broken:
                raise ExecutorBroken(self.broken)  # the run fails loudly (run.py)
            worker = (
                self._idle_worker(devices) or self._gang_host(task, devices) or self._spawn(devices)
            )
            worker.job = job
            if worker.state == "idle":
                self._send_job(worker)
            # a starting worker gets its job when it says hello
        return future

    def warm_up(self, device_sets: Sequence[tuple[int, ...]]) -> None:
        """Start workers ahead of time so their slow imports overlap other work."""
        with self._lock:
            for devices in device_sets:
                if not any(
                    w.devices == tuple(devices) and w.state != "dead"
                    for w in self._workers.values()
                ):
                    self._spawn(tuple(devices))

    def check(self) -> None:
        """Raise `ExecutorBroken` when a pool thread has stopped: nothing would ever complete."""
        if self.broken:
            raise ExecutorBroken(self.broken)

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
                    w.job.future.set_result(
                        TaskOutcome(
                            w.job.task.id,
                            False,
                            "killed",
                            "run interrupted",
                            worker_pid=w.pid,
                            devices=w.devices,
                        )
                    )
                w.state = "dead"
        with self._lock:
            for w in self._workers.values():
                if w.conn is not None:
                    w.conn.close()
                    w.conn = None
        self._wake_accept_loop()
        shutil.rmtree(self._sock_dir, ignore_errors=True)

    def _wake_accept_loop(self) -> None:
        """Closing a listening socket does not wake a thread blocked in accept() on Linux:
        shut the socket down, which does, then close it (no port left in LISTEN)."""
        try:
            self._listener._listener._socket.shutdown(socket.SHUT_RDWR)  # type: ignore[attr-defined]
        except (AttributeError, OSError):
            pass
        try:
            self._listener.close()
        except OSError:
            pass

    # ---- workers ---------------------------------------------------------------------------
    def _idle_worker(self, devices: tuple[int, ...]) -> WorkerHandle | None:
        for w in self._workers.values():
            if (
                w.devices == devices
                and w.job is None
                and w.state in ("idle", "starting")
                and w.proc.poll() is None
            ):
                return w
        return None

    def _gang_host(self, task: TaskSpec, devices: tuple[int, ...]) -> WorkerHandle | None:
        """Off CUDA, a training gang (k ranks) runs on a one-device worker of its devices:
        an idle one, else one still starting (a gang dispatched as the run begins), which
        gets the job when it says hello. Its ranks fork from that worker's forkserver (warm
        when the plan has elastic tasks) and off CUDA nothing pins a process to a device, so
        a fresh worker would only import torch again and evict the idle ones it overlaps,
        which later one-device tasks would start again (bench/README.md: most of a gang's
        start-up). Spawned instead: on CUDA (a gang's worker must see its k GPUs, and
        CUDA_VISIBLE_DEVICES is fixed at process start), and a task whose model is sharded
        over k devices in one process (`model.gpus_per_task`: it reads the devices it got)."""
        ranks = task.elastic or task.gang.ranked  # not one process on k devices
        if len(devices) < 2 or not ranks or self.gpu.kind == "cuda":
            return None
        hosts = [h for d in devices if (h := self._idle_worker((d,))) is not None]
        return next((h for h in hosts if h.state == "idle"), hosts[0] if hosts else None)

    def _worker_env(self, devices: tuple[int, ...]) -> dict[str, str]:
        """The explicit environment of a worker on `devices` (none: the forkserver's)."""
        env = self.gpu.worker_env(list(devices))
        env.update(self._thread_env())
        env.update(self.extra_env)
        env["PYTHONPATH"] = pythonpath_with(ROOT, env.get("PYTHONPATH"))
        return env

    def _spawn(self, devices: tuple[int, ...]) -> WorkerHandle:
        self._evict_idle_overlapping(devices)
        env = self._worker_env(devices)
        worker_id = self._next_id
        self._next_id += 1
        args = [
            "--address",
            self._listener.address,
            "--worker-id",
            str(worker_id),
            "--heartbeat-s",
            str(self.heartbeat_s),
            "--cache-size",
            str(self.model_cache_size),
        ]
        if self.preimport:
            args.append("--preimport")
        log_path = None
        if self.log_dir is not None:  # a worker's own stdout/stderr (library noise, crashes)
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log_path = writable_log(self.log_dir / f"worker-{worker_id}.log")
        proc: WorkerProcess
        if self.fork_workers:
            log_file = None if log_path is None else str(log_path)
            proc = start_forked_worker(args, env, ROOT, log_file, self._authkey)
        else:
            proc = self._start_fresh(args, env, log_path)
        handle = WorkerHandle(worker_id, devices, proc)
        handle.env_devices = env.get("CUDA_VISIBLE_DEVICES", "")
        self._workers[worker_id] = handle
        log.debug(
            "started worker %d (pid %d) on devices %s, CUDA_VISIBLE_DEVICES=%r",
            worker_id,
            proc.pid,
            devices,
            handle.env_devices,
        )
        return handle

    def _start_fresh(
        self, args: list[str], env: dict[str, str], log_path: Path | None
    ) -> subprocess.Popen:
        """A new Python process running the worker, its authkey written to its stdin."""
        out = None if log_path is None else open(log_path, "ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", WORKER_MODULE, *args],
            env=env,
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=out,
            start_new_session=True,
            cwd=ROOT,
        )
        if out is not None:
            out.close()  # the child holds its own descriptor
        assert proc.stdin is not None  # stdin=PIPE
        proc.stdin.write((self._authkey.hex() + "\n").encode())
        proc.stdin.close()
        return proc

    def _thread_env(self) -> dict[str, str]:
        """CPU threads are a budget: packed workers on a GPU host share the cores (issue 11)."""
        from pita.core.resources import thread_budget, thread_env

        kind = getattr(self.gpu, "kind", "cpu")
        n = thread_budget(
            kind,
            len(self.gpu.devices),
            self.max_tasks_per_device,
            getattr(self.gpu, "threads_per_worker", 1),
        )
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
        w.state, w.stopping_since = "stopping", time.time()
        try:
            if w.conn is not None:
                w.conn.send(("stop",))
            else:
                self._signal_group(w, signal.SIGTERM)
        except (OSError, EOFError):
            self._signal_group(w, signal.SIGTERM)

    def _kill(self, w: WorkerHandle, outcome: TaskOutcome | None = None) -> None:
        """SIGKILL a worker's group, fail its task, and never hand it another task."""
        self._signal_group(w, signal.SIGKILL)
        if outcome is not None and w.job is not None:
            self._finish(w, outcome)
        w.job = None
        if w.state != "dead":
            w.state, w.stopping_since = "stopping", time.time()

    @staticmethod
    def _signal_group(w: WorkerHandle, sig: int) -> None:
        try:
            os.killpg(w.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _send_job(self, w: WorkerHandle) -> None:
        assert w.conn is not None and w.job is not None  # a connected worker given a job
        try:
            w.conn.send(w.job.message)
            w.state = "busy"
            w.job.started = time.time()
        except (OSError, EOFError) as exc:
            self._kill(
                w, TaskOutcome(w.job.task.id, False, "killed", f"could not reach worker: {exc}")
            )

    def _finish(self, w: WorkerHandle, outcome: TaskOutcome) -> None:
        job = w.job
        w.job = None
        if job is None or job.future.done():
            return
        outcome.worker_pid = w.pid
        outcome.devices = w.devices if job.task.gpus <= len(w.devices) else job.devices
        if not outcome.wall_s and job.started:
            outcome.wall_s = round(time.time() - job.started, 3)
        job.future.set_result(outcome)

    # ---- background threads ----------------------------------------------------------------
    def _start_thread(self, name: str, loop: Callable[[], None]) -> None:
        threading.Thread(target=self._guarded, args=(name, loop), name=name, daemon=True).start()

    def _guarded(self, name: str, loop: Callable[[], None]) -> None:
        """Run a background loop; if it ends while the pool is open, say why in `broken`
        (the DAG runner polls `check()` and fails the run) instead of dying silently."""
        try:
            loop()
            why = "returned"
        except BaseException as exc:  # noqa: BLE001 - reported, then the run fails loudly
            log.exception("pool thread %s crashed", name)
            why = f"crashed ({type(exc).__name__}: {exc})"
        if not self._closed:
            self.broken = f"worker pool thread {name} stopped: {why}"
            log.error("%s; the run cannot continue", self.broken)

    def _accept_loop(self) -> None:
        errors = 0
        while not self._closed:
            try:
                conn = self._listener._listener.accept()  # type: ignore[attr-defined]  # raw: authenticated below
            except (OSError, EOFError):
                if self._closed:
                    return
                errors += 1
                if errors > MAX_LOOP_ERRORS:
                    raise
                time.sleep(0.05)
                continue
            errors = 0
            threading.Thread(
                target=self._admit, args=(conn,), name="pita-auth", daemon=True
            ).start()

    def _admit(self, conn: Connection) -> None:
        """Authenticate one connection and attach it to its worker, within auth_timeout_s.

        A watchdog shuts the socket down at the deadline, which wakes the blocked read: a
        silent client costs one short-lived thread, never the accept loop.
        """
        timer = threading.Timer(self.auth_timeout_s, _shutdown_socket, (conn,))
        timer.daemon = True
        timer.start()
        try:
            deliver_challenge(conn, self._authkey)
            answer_challenge(conn, self._authkey)
            if not conn.poll(self.auth_timeout_s):
                raise TimeoutError("no hello")
            msg = conn.recv()
            if not (isinstance(msg, tuple) and len(msg) == 3 and msg[0] == "hello"):
                raise ValueError(f"unexpected first message {str(msg)[:80]!r}")
            _, worker_id, pid = msg
        except Exception as exc:  # noqa: BLE001 - any bad client is dropped and reported
            timer.cancel()
            self.rejected_connections += 1
            log.warning("worker channel: rejected a connection (%s: %s)", type(exc).__name__, exc)
            conn.close()
            return
        timer.cancel()
        with self._lock:
            w = self._workers.get(worker_id)
            if w is None or w.pid != pid or w.state != "starting" or self._closed:
                conn.close()
                return
            w.conn = conn
            w.last_seen = time.time()
            w.state = "idle"
            if w.job is not None:
                self._send_job(w)

    def _dispatch_loop(self) -> None:
        errors = 0
        while True:
            with self._lock:
                if self._closed:
                    return
                conns = {
                    w.conn: w
                    for w in self._workers.values()
                    if w.conn is not None and w.state != "dead"
                }
            try:
                ready: list[Any] = wait(list(conns), timeout=0.1) if conns else []
                if not conns:
                    time.sleep(0.05)
                with self._lock:
                    for conn in ready:
                        self._drain(conns[conn])
                    self._check_liveness()
                errors = 0
            except Exception:  # noqa: BLE001 - reported; a persistent error stops the run
                errors += 1
                log.exception("worker pool dispatcher error (%d in a row)", errors)
                if errors >= MAX_LOOP_ERRORS:
                    raise
                time.sleep(0.1)

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
        elif w.state == "stopping":
            return  # a late answer from a worker already killed or retired: its task was settled
        elif kind == "done":
            _, task_id, result, stats = msg
            w.stats = stats
            w.tasks_run += 1
            job, w.job, w.state = w.job, None, "idle"  # idle before the future completes:
            if w.tasks_run >= self.max_tasks_per_worker:  # a callback may submit again at once
                self._retire(w)
            w.job = job
            self._finish(
                w, TaskOutcome(task_id, True, result=result, wall_s=result.get("wall_s", 0.0))
            )
        elif kind == "failed":
            _, task_id, failure, message, stats = msg
            w.stats = stats
            w.tasks_run += 1
            # the worker exits by itself after an OOM / CUDA fault: never reuse it
            if failure in RECYCLE_WORKER:
                w.state, w.stopping_since = "stopping", time.time()
            else:
                w.state = "idle"
            self._finish(w, TaskOutcome(task_id, False, failure, message))

    def _check_liveness(self) -> None:
        now = time.time()
        for w in list(self._workers.values()):
            if w.state == "dead":
                continue
            code = w.proc.poll()
            if code is not None:
                remove_dead_socket_dirs()  # its gang's rank-log folder, if it ran one
                if w.conn is not None:
                    self._drain(w)
                if w.job is not None:
                    how = (
                        f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
                    )
                    self._finish(
                        w,
                        TaskOutcome(
                            w.job.task.id,
                            False,
                            "killed",
                            f"worker pid {w.pid} died ({how}) during the task",
                        ),
                    )
                w.state = "dead"
                if w.conn is not None:
                    w.conn.close()
                    w.conn = None
                continue
            job = w.job
            if w.state == "stopping":
                if now - w.stopping_since > STOP_GRACE_S:
                    self._signal_group(w, signal.SIGKILL)
            elif job is not None and job.started and now - job.started > self.task_timeout_s:
                self._kill(
                    w,
                    TaskOutcome(
                        job.task.id,
                        False,
                        "timeout",
                        f"exceeded executor.task_timeout_s={self.task_timeout_s:g}s; killed",
                    ),
                )
            elif w.state == "starting" and now - w.started_at > self.start_timeout_s:
                self._kill(
                    w,
                    TaskOutcome(
                        job.task.id,
                        False,
                        "killed",
                        f"worker pid {w.pid} did not connect within "
                        f"executor.start_timeout_s={self.start_timeout_s:g}s; killed",
                    )
                    if job is not None
                    else None,
                )
            elif w.state == "busy" and now - w.last_seen > self.heartbeat_timeout_s:
                self._kill(
                    w,
                    TaskOutcome(
                        job.task.id,
                        False,
                        "killed",
                        f"no heartbeat for {self.heartbeat_timeout_s:g}s; worker pid {w.pid} "
                        f"killed",
                    )
                    if job is not None
                    else None,
                )


SOCKET_DIR_PREFIX = "pita-chan-"  # an orchestrator's worker channels: pita-chan-<pid>-*
RANKS_DIR_PREFIX = "pita-ranks-"  # a gang launcher's rank logs: pita-ranks-<worker pid>-*


def remove_dead_socket_dirs(tmp: str | None = None) -> list[str]:
    """Delete this user's `pita-chan-<pid>-*` socket folders whose orchestrator is dead and
    `pita-ranks-<pid>-*` rank-log folders whose worker is dead (a gang's worker killed for
    its task's timeout, or by the kernel, cannot remove its own). Called when a pool starts
    and when it finds a worker dead."""
    removed = []
    root = Path(tmp or tempfile.gettempdir())
    found = [(p, f) for p in (SOCKET_DIR_PREFIX, RANKS_DIR_PREFIX) for f in root.glob(f"{p}*-*")]
    for prefix, folder in found:
        pid = folder.name[len(prefix) :].split("-", 1)[0]
        try:
            st = folder.lstat()
            if not pid.isdigit() or st.st_uid != os.geteuid() or not stat.S_ISDIR(st.st_mode):
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder.name)
        except OSError:
            continue
    return removed


def _shutdown_socket(conn: Connection) -> None:
    """Wake a thread blocked reading `conn` (closing the descriptor alone does not)."""
    try:
        s = socket.socket(fileno=os.dup(conn.fileno()))
    except OSError:
        return
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        s.close()
