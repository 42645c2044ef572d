"""The run's own files failing (issue 34 item 5): a full disk, an immutable journal or
tasks folder stop the run at once with one line naming the file and the cause, every
finished task is kept, and a resume finishes the run once the cause is gone; a journal
line of the wrong shape is one WARNING and skipped wherever the journal is read.

The faults are real: `chattr +i` and a full tmpfs need root (else skipped); the run is
the real command line with sleeping stages (tests/fault_stages.py)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import time
from pathlib import Path

import pytest

from pita.core.journal import Journal, RunFileError, read_events, replay
from tests.conftest import journal, run_cli, sleep_overrides
from tests.test_faults import BASE, REF, _start, _wait_for

SLOW = "reference.goal_walk.tiny.r0.evaluate.s00"
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="chattr +i and mount need root")


def _chattr(flag: str, path: Path) -> None:
    if subprocess.run(["chattr", flag, str(path)], capture_output=True).returncode != 0:
        pytest.skip("chattr is not supported on this file system")


# --- a journal line of the wrong shape ------------------------------------------------------


def test_journal_line_of_the_wrong_shape_is_one_warning_and_skipped(tmp_path, caplog):
    from pita.experiment.durations import done_walls
    from pita.results.timeline import spans

    path = tmp_path / "journal.jsonl"
    good = {"ts": 1.0, "event": "task_done", "task": "a", "wall_s": 2.0}
    lines = [
        good,
        {"ts": 1.0, "event": "task_done", "task": ["a", "list"], "wall_s": 1.0},
        {"ts": 1.0, "event": "task_done", "task": "b", "wall_s": "abc"},
        {"ts": "noon", "event": "task_running", "task": "c", "devices": [0]},
        {"ts": 2.0, "event": "task_running", "task": "d", "devices": "all"},
        {"ts": 2.0, "task": "e"},  # no event
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    with caplog.at_level(logging.WARNING, logger="pita"):
        events = read_events(path)
        assert events == [good]
        assert replay(path) == {"a": good}
        assert done_walls(read_events(path)) == {"a": 2.0}  # no float("abc")
        assert spans(read_events(path), {}) == ([], 0.0)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 5, warnings  # one per bad line, however often it is read
    assert 'line 2: task is ["a", "list"]' in warnings[0]
    assert 'line 3: wall_s is "abc"' in warnings[1]


@pytest.fixture(scope="module")
def finished_sleep_run(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("runfiles")
    done = run_cli([*BASE, *REF, "experiment.name=rf", *sleep_overrides()], cwd)
    assert done.returncode == 0, done.stdout + done.stderr
    [run_dir] = list((cwd / "outputs" / "rf").iterdir())
    return run_dir


def test_resume_over_wrong_shaped_journal_lines_warns_and_finishes(finished_sleep_run):
    run_dir = finished_sleep_run
    with open(run_dir / "journal.jsonl", "a") as f:
        f.write(json.dumps({"ts": 1.0, "event": "task_done", "task": [1, 2]}) + "\n")
        f.write(json.dumps({"ts": 1.0, "event": "task_done", "task": "x", "wall_s": "abc"}) + "\n")
    proc = run_cli(["resume_from=" + str(run_dir), "executor.progress=false"], run_dir.parent)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    assert "Traceback" not in text
    assert text.count("not what pita writes; line skipped") == 2, text
    assert journal(run_dir)[-1]["event"] == "run_finished"


# --- the journal, the tasks folder, the disk -------------------------------------------------


def _run_with_a_fault(tmp_path: Path, fault, extra: list[str] = ()) -> tuple[Path, Path]:
    """Start a run whose evaluate shard s00 sleeps; once pretrain finished and s00 started,
    `fault(run_dir)` breaks a file of the run. The run must stop at once with one line;
    then `fault.undo()` and a resume must finish it without redoing pretrain."""
    markers = tmp_path / "markers"
    markers.mkdir()
    env = {"PITA_TEST_MARKERS": str(markers), "PITA_TEST_SLOW_TASK": SLOW, "PITA_TEST_SLOW_S": "3"}
    proc = _start([*BASE, *REF, "experiment.name=rf", *sleep_overrides(), *extra], tmp_path, env)
    try:
        _wait_for(markers / "pretrain.goal_walk.tiny.finished")
        _wait_for(markers / f"{SLOW}.started")
        run_dir = fault.run_dir(tmp_path)
        fault(run_dir)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        fault.undo()
    assert proc.returncode == 1, out
    assert "Traceback" not in out and "Logging error" not in out, out
    [line] = [ln for ln in out.splitlines() if "Run stopped" in ln]
    assert line.startswith("Run stopped: cannot write ")
    assert (
        f"once that is fixed, finish the run with: python run_parallel.py resume_from={run_dir}"
        in line
    )
    resumed = run_cli(
        ["resume_from=" + str(run_dir), "executor.progress=false"],
        tmp_path,
        env={"PITA_TEST_MARKERS": str(markers)},
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert len((markers / "pretrain.goal_walk.tiny.started").read_text().splitlines()) == 1
    assert journal(run_dir)[-1]["event"] == "run_finished"
    return run_dir, Path(line)


class _Chattr:
    def __init__(self, name: str):
        self.name, self.path = name, None

    def run_dir(self, cwd: Path) -> Path:
        return next((cwd / "outputs" / "rf").iterdir())

    def __call__(self, run_dir: Path) -> None:
        self.path = run_dir / self.name
        _chattr("+i", self.path)

    def undo(self) -> None:
        if self.path is not None:
            subprocess.run(["chattr", "-i", str(self.path)], check=True)


@ROOT_ONLY
def test_immutable_journal_mid_run_stops_at_once_and_resume_finishes(tmp_path):
    fault = _Chattr("journal.jsonl")
    _, line = _run_with_a_fault(tmp_path, fault)
    assert f"cannot write {fault.path}: Operation not permitted." in str(line)


@ROOT_ONLY
@pytest.mark.slow
def test_immutable_tasks_folder_stops_at_once_naming_it_and_resume_finishes(tmp_path):
    fault = _Chattr("tasks")
    _, line = _run_with_a_fault(tmp_path, fault)
    assert f"cannot write {fault.path}/" in str(line) and "Operation not permitted" in str(line)


class _FullDisk:
    """The run folder on a 70 MB tmpfs (preflight wants 64 MB free), filled mid-run."""

    def __init__(self, mnt: Path):
        self.mnt = mnt
        mnt.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=70m", "tmpfs", str(mnt)]).returncode:
            pytest.skip("cannot mount a tmpfs here")
        self.mounted = True

    def run_dir(self, cwd: Path) -> Path:
        return self.mnt / "run"

    def __call__(self, run_dir: Path) -> None:
        # unbuffered: a buffered file's close would flush its tail into the full disk and raise
        with open(self.mnt / "filler", "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
            except OSError:
                pass
        time.sleep(0.1)

    def undo(self) -> None:
        (self.mnt / "filler").unlink(missing_ok=True)


@ROOT_ONLY
@pytest.mark.slow
def test_full_disk_stops_the_run_at_once_and_resume_finishes(tmp_path):
    disk = _FullDisk(tmp_path / "mnt")
    try:
        _, line = _run_with_a_fault(tmp_path, disk, [f"hydra.run.dir={disk.mnt}/run"])
        assert "No space left on device" in str(line)
    finally:
        subprocess.run(["umount", str(disk.mnt)])


def test_journal_that_cannot_be_opened_or_appended_is_one_line(tmp_path):
    """Unit level (any user): a read-only journal cannot be opened; /dev/full-like writes
    (an fd whose writes fail) raise RunFileError naming the file and the cause."""
    path = tmp_path / "journal.jsonl"
    path.write_text("")
    path.chmod(0o444)
    if os.geteuid() != 0:
        with pytest.raises(RunFileError, match=f"cannot write {path}: Permission denied"):
            Journal(path)
    path.chmod(0o644)
    j = Journal(path)
    full = os.open("/dev/full", os.O_WRONLY)
    os.dup2(full, j._fd)  # every write now fails with ENOSPC, as on a full disk
    os.close(full)
    with pytest.raises(RunFileError, match=f"cannot write {path}: No space left on device"):
        j.append("task_done", task="a")
    j.close()
