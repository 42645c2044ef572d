"""The worker pool under faults, with real processes, signals and sockets (issue 13):
a stopped worker must not hang the run, a worker that never connects is replaced (the
retry never goes back to it), a pool thread that stops fails the run loudly, and a bad
or silent client on the worker channel cannot block the workers that come after it."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import sys
import time
from multiprocessing.connection import AuthenticationError, Client
from pathlib import Path

import pytest

from pita.core.gpu_manager import GPUManager
from pita.core.tasks import TaskSpec
from pita.core.worker_pool import WorkerPool
from tests.conftest import journal, only, run_dirs, sleep_overrides, slow_env, task_spec
from tests.test_faults import BASE, REF, _start, _wait_for

NOOP = "tests.fault_stages:noop_stage"


def _noop_task(tid: str) -> TaskSpec:
    return task_spec(
        id=tid, algo="reference", dataset="-", family="-", round=0, stage="evaluate", fn=NOOP
    )


def _finish(proc, timeout: float = 120) -> str:
    """The orchestrator's output; a hang fails the test and kills it (its workers die
    with it, PR_SET_PDEATHSIG), so no orphan outlives the test."""
    try:
        return proc.communicate(timeout=timeout)[0]
    except BaseException:
        proc.kill()
        proc.wait()
        raise


def _address_of(pid: int) -> str:
    """The channel address a worker was given (its command line, as `ps` shows it)."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return argv[argv.index(b"--address") + 1].decode()


def _start_slow(args: list[str], cwd, markers, victim: str, seconds: float):
    """The run started with `victim` held for `seconds`; (the process, the victim's
    `.started` marker) once the victim runs."""
    proc = _start(args, cwd, slow_env(markers, victim, seconds))
    started = markers / f"{victim}.started"
    _wait_for(started)
    return proc, started


def test_stopped_worker_is_killed_and_the_run_finishes(tmp_path, markers):
    """kill -STOP the worker of a training task: the heartbeat check kills it, the task is
    retried on a fresh worker, the run exits 0 (it used to hang: the dispatcher thread died
    on `w.job` being None while the killed worker was still being reaped)."""
    victim = "QSharp.goal_walk.tiny.r0.train"
    args = [
        *BASE,
        "executor.heartbeat_timeout_s=2",
        "experiment.name=stopped",
        *only("reference", "QSharp"),
        *sleep_overrides(),
    ]
    proc, started = _start_slow(args, tmp_path, markers, victim, 3)
    pid = json.loads(started.read_text().splitlines()[0])["pid"]
    os.kill(pid, signal.SIGSTOP)
    out = _finish(proc)  # a hang fails here
    assert proc.returncode == 0, out
    [run_dir] = run_dirs(tmp_path, "stopped")
    events = [e for e in journal(run_dir) if e.get("task") == victim]
    failed = [e for e in events if e["event"] == "task_failed"]
    assert failed and failed[0]["failure"] == "killed" and "no heartbeat" in failed[0]["message"]
    assert events[-1]["event"] == "task_done" and events[-1]["worker_pid"] != pid
    assert "Traceback" not in (run_dir / "run.log").read_text()


def test_worker_stopped_before_connecting_is_replaced(tmp_path):
    """A worker frozen before it connects is killed after executor.start_timeout_s and the
    retry starts a fresh worker instead of waiting on the dead one."""
    pool = WorkerPool(
        GPUManager("fake:1"),
        start_timeout_s=3,
        heartbeat_s=0.5,
        heartbeat_timeout_s=5,
        preimport=False,
        log_dir=tmp_path / "workers",
    )
    try:
        pool.warm_up([(0,)])
        [frozen] = pool.worker_pids()
        os.killpg(frozen, signal.SIGSTOP)  # python needs far more than this to start and connect
        first = pool.submit(_noop_task("t1"), [0], {}, tmp_path).result(timeout=60)
        assert not first.ok and first.failure == "killed" and "start_timeout_s=3" in first.message
        second = pool.submit(_noop_task("t1"), [0], {}, tmp_path, attempt=2).result(timeout=60)
        assert second.ok, second.message
        assert second.worker_pid != frozen
        pool.check()  # no pool thread stopped
    finally:
        pool.shutdown(kill=True)


def test_channel_is_a_private_unix_socket(tmp_path):
    pool = WorkerPool(GPUManager("fake:1"), preimport=False)
    try:
        folder = Path(pool._listener.address).parent
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        assert stat.S_ISSOCK(Path(pool._listener.address).stat().st_mode)
    finally:
        pool.shutdown()
    assert not folder.exists()


def test_wrong_key_and_silent_socket_do_not_block_later_workers(tmp_path):
    """Unit level: a wrong-key client and a silent socket, then a worker still connects."""
    pool = WorkerPool(GPUManager("fake:1"), preimport=False, auth_timeout_s=2, log_dir=tmp_path)
    silent = socket.socket(socket.AF_UNIX)
    try:
        silent.connect(pool._listener.address)  # says nothing, stays open
        with pytest.raises((AuthenticationError, EOFError, ConnectionError)):
            Client(pool._listener.address, family="AF_UNIX", authkey=b"wrong key")
        outcome = pool.submit(_noop_task("t"), [0], {}, tmp_path).result(timeout=60)
        assert outcome.ok, outcome.message
        deadline = time.time() + 10
        while pool.rejected_connections < 2 and time.time() < deadline:
            time.sleep(0.05)
        assert pool.rejected_connections == 2  # the silent one timed out, on its own thread
        pool.check()
    finally:
        silent.close()
        pool.shutdown()


def test_bad_clients_mid_run_the_run_still_finishes(tmp_path, markers):
    """End to end: mid-run, connect with a wrong key and leave a silent socket open; every
    later task needs a fresh worker (max_tasks_per_worker=1) and the run still exits 0."""
    victim = "pretrain.goal_walk.tiny"
    args = [
        *BASE,
        *REF,
        "executor.max_tasks_per_worker=1",
        "experiment.name=intruder",
        *sleep_overrides(),
    ]
    proc, started = _start_slow(args, tmp_path, markers, victim, 2)
    address = _address_of(json.loads(started.read_text())["pid"])
    silent = socket.socket(socket.AF_UNIX)
    try:
        silent.connect(address)
        with pytest.raises((AuthenticationError, EOFError, ConnectionError)):
            Client(address, family="AF_UNIX", authkey=b"guessed")
        out = _finish(proc)
    finally:
        silent.close()
    assert proc.returncode == 0, out
    [run_dir] = run_dirs(tmp_path, "intruder")
    assert "rejected a connection" in (run_dir / "run.log").read_text()
    assert journal(run_dir)[-1]["event"] == "run_finished"


def test_a_stopped_pool_thread_fails_the_run_loudly(tmp_path, monkeypatch, capsys):
    """If a pool thread dies anyway, the run exits 1 with the journal written, not a hang."""
    from pita.experiment import cli
    from pita.experiment import run as runner

    def broken_liveness(self):
        raise RuntimeError("injected liveness bug")

    monkeypatch.setattr(WorkerPool, "_check_liveness", broken_liveness)
    monkeypatch.setattr("pita.core.worker_pool.MAX_LOOP_ERRORS", 3)
    cfg = cli.compose_config(
        ["system.devices=fake:1", "executor.progress=false", *REF, *sleep_overrides()]
    )
    code = runner.run(cfg, tmp_path / "run")
    assert code == 1
    last = journal(tmp_path / "run")[-1]
    assert last["event"] == "run_failed" and "pita-dispatch" in last["reason"]
    assert "injected liveness bug" in last["reason"]


if sys.platform != "linux":  # /proc and SIGSTOP semantics
    pytestmark = pytest.mark.skip("Linux only")
