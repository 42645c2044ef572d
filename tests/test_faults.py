"""Faults with real processes and real signals: killed workers, raising stages, hung
workers, a killed orchestrator and Ctrl-C, each followed by what the user expects."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import (
    journal,
    only,
    run_cli,
    run_dirs,
    sleep_overrides,
    slow_env,
    start_cli,
)

BASE = ["system.devices=fake:2", "executor.progress=false", "executor.heartbeat_s=0.5"]
REF = only("reference")


def _wait_for(path: Path, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        assert time.time() < deadline, f"{path.name} never appeared"
        time.sleep(0.05)


def _start(args, cwd, env):
    return start_cli(args, cwd, env)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigkill_worker_mid_task_is_retried_and_run_succeeds(tmp_path, markers):
    victim = "reference.goal_walk.tiny.r0.evaluate.s00"
    env = slow_env(markers, victim, 2)
    proc = _start([*BASE, *REF, "experiment.name=killworker", *sleep_overrides()], tmp_path, env)
    started = markers / f"{victim}.started"
    _wait_for(started)
    pid = json.loads(started.read_text().splitlines()[0])["pid"]
    os.kill(pid, signal.SIGKILL)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    attempts = [json.loads(line)["pid"] for line in started.read_text().splitlines()]
    assert len(attempts) == 2 and attempts[0] != attempts[1]
    [run_dir] = run_dirs(tmp_path, "killworker")
    events = [(e["event"], e.get("failure")) for e in journal(run_dir) if e.get("task") == victim]
    assert ("task_failed", "killed") in events and events[-1] == ("task_done", None)
    assert (run_dir / "tasks" / victim / "manifest.json").is_file()


def test_raising_stage_fails_its_chain_others_finish_exit_1(tmp_path, markers):
    args = [
        *BASE,
        "experiment.name=raise",
        *only("reference", "QSharp", "PITA"),
        *sleep_overrides("tests.fault_stages:failing_stage"),
    ]
    proc = run_cli(
        args, tmp_path, {"PITA_TEST_FAIL_ALGO": "PITA", "PITA_TEST_MARKERS": str(markers)}
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "deliberate failure" in proc.stdout and "resume_from=" in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr
    [run_dir] = run_dirs(tmp_path, "raise")
    final = {e["task"]: e for e in journal(run_dir) if e.get("task")}
    assert final["QSharp.goal_walk.tiny.r0.evaluate"]["event"] == "task_done"
    assert final["reference.goal_walk.tiny.r0.evaluate"]["event"] == "task_done"
    assert final["PITA.goal_walk.tiny.r0.collect.s00"]["failure"] == "error"  # not retried
    assert final["PITA.goal_walk.tiny.r0.train"]["event"] == "task_skipped"
    assert len(list(markers.glob("PITA.goal_walk.tiny.r0.collect.s00.raised"))) == 1
    log = (
        run_dir / "tasks" / "PITA.goal_walk.tiny.r0.collect.s00.attempt1.failed" / "log.txt"
    ).read_text()
    assert "ValueError: deliberate failure" in log


def test_hung_worker_times_out(tmp_path):
    args = [
        *BASE,
        *REF,
        "experiment.name=hang",
        "executor.task_timeout_s=2",
        "executor.max_retries=0",
        *sleep_overrides(),
        "+executor.stage_overrides.reference.evaluate_merge=tests.fault_stages:hang_stage",
    ]
    proc = run_cli(args, tmp_path, timeout=120)  # a hang guard, not a claim about speed
    assert proc.returncode == 1, proc.stdout + proc.stderr
    [run_dir] = run_dirs(tmp_path, "hang")
    failed = [e for e in journal(run_dir) if e["event"] == "task_failed"]
    assert failed and failed[0]["failure"] == "timeout" and "task_timeout_s" in failed[0]["message"]


# forked: the forkserver's imports cost 5-10 s, so that case runs with the slow set
@pytest.mark.parametrize("workers", ["fresh", pytest.param("forked", marks=pytest.mark.slow)])
def test_sigkill_orchestrator_then_resume_redoes_nothing(tmp_path, markers, workers):
    """Fresh workers (no preimport) die with their parent; forked ones (preimport on fake
    devices: children of the orchestrator's forkserver) die with the forkserver, which
    leaves when the orchestrator does."""
    env = slow_env(markers, "QSharp.goal_walk.tiny.r0.train", 30)
    stages = sleep_overrides(preimport=workers == "forked")
    args = [*BASE, "experiment.name=crash", *only("reference", "QSharp"), *stages]
    proc = _start(args, tmp_path, env)
    started = markers / "QSharp.goal_walk.tiny.r0.train.started"
    _wait_for(started)
    marker = json.loads(started.read_text())
    worker_pid = marker["pid"]
    assert (marker["ppid"] == proc.pid) == (workers == "fresh"), (marker, proc.pid)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    deadline = time.time() + 15
    while _pid_alive(worker_pid) and time.time() < deadline:  # workers die with their parent
        time.sleep(0.1)
    assert not _pid_alive(worker_pid), "worker outlived the killed orchestrator"
    [run_dir] = run_dirs(tmp_path, "crash")
    done_before = {e["task"] for e in journal(run_dir) if e["event"] == "task_done"}
    assert "pretrain.goal_walk.tiny" in done_before
    resumed = run_cli(  # fresh workers: what is checked now is the resume
        ["resume_from=" + str(run_dir), "executor.progress=false", "executor.preimport=false"],
        tmp_path,
        {"PITA_TEST_MARKERS": str(markers)},
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    for tid in done_before:  # nothing that finished ran again
        assert len((markers / f"{tid}.started").read_text().splitlines()) == 1, tid
    assert len(started.read_text().splitlines()) == 2  # the interrupted task ran again
    assert len(run_dirs(tmp_path, "crash")) == 1  # resumed in place
    events = journal(run_dir)
    assert events[-1]["event"] == "run_finished" and events[-1]["failed"] == 0


def test_ctrl_c_stops_workers_exits_130_and_is_resumable(tmp_path, markers):
    env = slow_env(markers, "pretrain.goal_walk.tiny", 30)
    proc = _start([*BASE, *REF, "experiment.name=ctrlc", *sleep_overrides()], tmp_path, env)
    started = markers / "pretrain.goal_walk.tiny.started"
    _wait_for(started)
    worker_pid = json.loads(started.read_text())["pid"]
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    assert "resume_from=" in out
    assert not _pid_alive(worker_pid)
    [run_dir] = run_dirs(tmp_path, "ctrlc")
    assert journal(run_dir)[-1]["event"] == "run_interrupted"
    resumed = run_cli(["resume_from=" + str(run_dir), "executor.progress=false"], tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
