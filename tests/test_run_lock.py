"""One orchestrator per run folder (issue 13): a second `resume_from=` of a live run exits
2 naming the holder; the lock dies with its holder, even by SIGKILL. Real processes."""

from __future__ import annotations

import json
import signal

import pytest

from pita.core.errors import ConfigError
from pita.core.run_lock import RunLock
from tests.conftest import journal, run_cli, run_dirs, sleep_overrides, slow_env
from tests.test_faults import BASE, REF, _start, _wait_for


def test_second_orchestrator_exits_2_naming_the_holder(tmp_path, markers):
    victim = "pretrain.goal_walk.tiny"
    env = slow_env(markers, victim, 60)
    first = _start([*BASE, *REF, "experiment.name=locked", *sleep_overrides()], tmp_path, env)
    try:
        _wait_for(markers / f"{victim}.started")
        [run_dir] = run_dirs(tmp_path, "locked")
        second = run_cli(
            ["resume_from=" + str(run_dir), "executor.progress=false"], tmp_path, env, timeout=60
        )
        assert second.returncode == 2, second.stdout + second.stderr
        [line] = second.stderr.strip().splitlines()
        assert line.startswith("error: run folder") and f"in use by pid {first.pid} on " in line, (
            line
        )
        assert (
            len((markers / f"{victim}.started").read_text().splitlines()) == 1
        )  # it started nothing
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    # the kernel released the dead holder's lock: resuming now works and finishes the run
    resumed = run_cli(
        ["resume_from=" + str(run_dir), "executor.progress=false"],
        tmp_path,
        {"PITA_TEST_MARKERS": str(markers)},
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert journal(run_dir)[-1]["event"] == "run_finished"
    assert json.loads((run_dir / ".lock").read_text())["pid"] != first.pid


def test_lock_in_process(tmp_path):
    with RunLock(tmp_path):
        with pytest.raises(ConfigError, match=r"in use by pid \d+ on .* since "):
            RunLock(tmp_path).acquire()
    with RunLock(tmp_path):  # released on exit
        pass


def test_multirun_job_takes_the_lock_before_hydra_writes_its_folder(tmp_path, markers):
    """Issue 28: a sweep job whose folder another orchestrator holds is refused with one
    line and exit 2 before Hydra writes `.hydra/` (the job's run.log handler locks first:
    pita/experiment/job_log.py); once free, the sweep runs, each job holding its own folder
    while it runs and releasing it when the next job starts."""
    import os
    import time

    victim = "pretrain.goal_walk.tiny"
    sweep = tmp_path / "sweep"
    args = ["-m", *BASE, *REF, *sleep_overrides(), f"hydra.sweep.dir={sweep}", "dataset.seed=0,1"]
    holder = RunLock(sweep / "0").acquire()
    try:
        refused = run_cli(args, tmp_path, timeout=120)
    finally:
        holder.release()
    assert refused.returncode == 2, refused.stdout + refused.stderr
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"in use by pid {os.getpid()} on " in errors[0], refused.stderr
    assert "Traceback" not in refused.stderr
    assert not (sweep / "0" / ".hydra").exists()  # Hydra wrote nothing into a folder in use
    env = {"PITA_TEST_MARKERS": str(markers), "PITA_TEST_SLOW_TASK": victim}
    sweep_run = _start(args, tmp_path, {**env, "PITA_TEST_SLOW_S": "2"})
    try:
        started = markers / f"{victim}.started"
        deadline = time.time() + 120
        while not (started.is_file() and len(started.read_text().splitlines()) == 2):
            assert time.time() < deadline and sweep_run.poll() is None, "job 1 never started"
            time.sleep(0.1)
        with pytest.raises(ConfigError, match="in use by pid"):  # job 1 holds its folder
            RunLock(sweep / "1").acquire()
        with RunLock(sweep / "0"):  # job 0 ended: its lock went with its logging
            pass
        out, _ = sweep_run.communicate(timeout=120)
    finally:
        if sweep_run.poll() is None:
            sweep_run.send_signal(signal.SIGKILL)
            sweep_run.wait()
    assert sweep_run.returncode == 0, out[-3000:]
    for job in ("0", "1"):
        assert (sweep / job / ".hydra" / "config.yaml").is_file()
        assert journal(sweep / job)[-1]["event"] == "run_finished"
