"""Red-team cases (issue 21): each plants a real attack in a real run folder and checks
that nothing executes, no file outside the run changes, and each refusal is one line
with exit 2. Run as another user where a case needs one (root only, else skipped)."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
from pathlib import Path

import pytest

from pita.core.errors import ConfigError
from pita.core.journal import Journal, read_events, replay
from pita.core.paths import TaskPaths
from pita.core.run_lock import RunLock, lock_holder_pid
from pita.core.safe_files import UnsafeFile, check_folder, read_control
from tests.conftest import journal, run_cli, run_dirs, sleep_overrides, slow_env
from tests.test_faults import BASE, REF

FINISHED_ARGS = [
    "experiment=smoke",
    "algos=[reference]",
    "executor.progress=false",
    *[o for o in sleep_overrides() if ".evaluate_merge=" not in o],
    "+executor.stage_overrides.any.evaluate_merge=tests.fault_stages:scored_merge_stage",
]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """One finished reference-only run of the smoke experiment. Its stages are the sleep
    stages and a merge that writes one summary row (tests/fault_stages.py): what these tests
    plant and resume is the run folder and its report, not what the stages computed."""
    cwd = tmp_path_factory.mktemp("hostile")
    done = run_cli([*FINISHED_ARGS, "experiment.name=hostile"], cwd)
    assert done.returncode == 0, done.stdout + done.stderr
    [run_dir] = run_dirs(cwd, "hostile")
    return cwd, run_dir


def _copy_run(finished_run, tmp_path):
    cwd, run_dir = finished_run
    copy = tmp_path / "outputs" / "hostile" / run_dir.name
    shutil.copytree(run_dir, copy, symlinks=True)
    return copy


def _one_line_exit_2(proc) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    [line] = proc.stderr.strip().splitlines()
    return line


# --- symlinks and special files in a run folder -------------------------------------------


def _planted_link_is_refused(finished_run, tmp_path, name: str) -> None:
    """`<run>/<name> -> ~/important.txt`: a resume exits 2 naming the link, the file is intact."""
    run_dir = _copy_run(finished_run, tmp_path)
    victim = tmp_path / "important.txt"
    victim.write_text("precious\n")
    (run_dir / name).unlink()
    (run_dir / name).symlink_to(victim)
    proc = run_cli(["resume_from=" + str(run_dir), "executor.progress=false"], tmp_path)
    line = _one_line_exit_2(proc)
    assert "symbolic link" in line and name in line
    assert victim.read_text() == "precious\n"


def test_symlinked_lock_does_not_overwrite_its_target(finished_run, tmp_path):
    _planted_link_is_refused(finished_run, tmp_path, ".lock")


def test_symlinked_journal_is_refused(finished_run, tmp_path):
    _planted_link_is_refused(finished_run, tmp_path, "journal.jsonl")


def test_lock_that_is_a_folder_is_one_line(tmp_path):
    (tmp_path / ".lock").mkdir()
    with pytest.raises(UnsafeFile, match="not a regular file"):
        RunLock(tmp_path).acquire()


def test_manifest_linked_to_dev_zero_is_not_read(tmp_path):
    task = TaskPaths(tmp_path, "t")
    task.final.mkdir(parents=True)
    task.manifest.symlink_to("/dev/zero")
    assert "not trusted" in task.verify()
    task.manifest.unlink()
    with open(task.manifest, "wb") as f:  # a huge regular manifest: refused by its size
        f.truncate(17 * 2**20)
    assert "not trusted" in task.verify()


def test_fifo_control_file_does_not_hang(tmp_path):
    os.mkfifo(tmp_path / "plan.json")
    with pytest.raises(UnsafeFile, match="not a regular file"):
        read_control(tmp_path / "plan.json")


def test_world_writable_run_folder_is_refused(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    folder.chmod(0o777)
    with pytest.raises(UnsafeFile, match="writable by every user"):
        check_folder(folder)


# --- the run lock ----------------------------------------------------------------------------


def test_lock_is_private_and_fixes_an_old_mode(tmp_path):
    lock = tmp_path / ".lock"
    lock.write_text("{}")
    lock.chmod(0o644)  # what an older pita left: any user could open it and flock it
    with RunLock(tmp_path):
        assert stat.S_IMODE(lock.stat().st_mode) == 0o600


def test_holder_is_read_from_the_kernel_not_the_text(tmp_path):
    if not os.path.exists("/proc/locks"):
        pytest.skip("no /proc/locks on this system")
    with RunLock(tmp_path):
        assert lock_holder_pid(tmp_path / ".lock") == os.getpid()
        # stale text from a dead holder must not be reported
        (tmp_path / ".lock").write_text(json.dumps({"pid": 1, "host": "x", "started": "old"}))
        with pytest.raises(ConfigError, match=rf"in use by pid {os.getpid()} on "):
            RunLock(tmp_path).acquire()


# --- the journal --------------------------------------------------------------------------------


def test_journal_survives_garbage_and_a_torn_line(tmp_path):
    path = tmp_path / "journal.jsonl"
    path.write_bytes(
        b'{"event": "task_done", "task": "a"}\n'
        b"[1, 2, 3]\n"  # JSON, not an object
        b'"just a string"\n'
        b"\xff\xfe not utf-8\n"
        b'{"event": "task_done", "task": "b"'  # torn by a full disk: no newline
    )
    j = Journal(path)
    j.append("task_done", task="c")
    j.close()
    assert set(replay(path)) == {"a", "c"}  # the torn line stays torn, the next is whole
    assert [e["task"] for e in read_events(path)] == ["a", "c"]


# --- another user (root only) -------------------------------------------------------------------


def _as_nobody(path):
    import pwd

    nobody = pwd.getpwnam("nobody")
    os.chown(path, nobody.pw_uid, nobody.pw_gid)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create another user's files")
def test_journal_owned_by_another_user_is_refused(tmp_path):
    path = tmp_path / "journal.jsonl"
    path.write_text('{"event": "task_done", "task": "a"}\n')
    _as_nobody(path)
    with pytest.raises(UnsafeFile, match="owned by uid"):
        Journal(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create another user's files")
def test_run_folder_owned_by_another_user_is_refused(finished_run, tmp_path):
    run_dir = _copy_run(finished_run, tmp_path)
    _as_nobody(run_dir)
    proc = run_cli(["resume_from=" + str(run_dir), "executor.progress=false"], tmp_path)
    line = _one_line_exit_2(proc)
    assert "owned by uid" in line
    assert journal(run_dir)[-1]["event"] == "run_finished"  # nothing appended


# --- leftovers of a SIGKILLed orchestrator --------------------------------------------------


def test_sigkilled_run_socket_folder_is_removed_by_the_next(tmp_path, markers):
    import signal
    import tempfile

    from pita.core.worker_pool import SOCKET_DIR_PREFIX, remove_dead_socket_dirs
    from tests.test_faults import _start, _wait_for

    victim = "pretrain.goal_walk.tiny"
    # a temp folder of this test's own (short: a Unix socket path has 107 characters): a
    # pool started meanwhile by another run of the machine (a pytest-xdist worker's test)
    # removes the dead folders of the system's temp folder, and must not take this one
    tmp = tempfile.mkdtemp(prefix="pt-")
    env = {**slow_env(markers, victim, 60), "TMPDIR": tmp}
    try:
        first = _start([*BASE, *REF, "experiment.name=socks", *sleep_overrides()], tmp_path, env)
        _wait_for(markers / f"{victim}.started")
        [left] = list(Path(tmp).glob(f"{SOCKET_DIR_PREFIX}{first.pid}-*"))
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        assert left.is_dir()  # SIGKILL: nobody cleaned up
        assert left.name in remove_dead_socket_dirs(tmp)  # what the next pool's start calls
        assert not left.exists()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --- the report, the logs, the modes of committed files --------------------------------------


def test_report_that_cannot_be_written_is_exit_1_then_resume_finishes_it(finished_run, tmp_path):
    from pita.experiment.cli_extras import run_finished

    run_dir = _copy_run(finished_run, tmp_path)
    summary = run_dir / "results" / "summary.csv"
    summary.unlink()
    summary.mkdir()  # the report cannot replace it (root ignores a read-only mode)
    proc = run_cli(["resume_from=" + str(run_dir), "executor.progress=false"], tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "writing the report failed: " in proc.stdout + proc.stderr
    assert not run_finished(run_dir)  # resume_from=auto will finish it
    summary.rmdir()
    proc = run_cli(["resume_from=" + str(run_dir), "executor.progress=false"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert summary.is_file() and run_finished(run_dir)
    assert journal(run_dir)[-1]["event"] == "run_finished" and journal(run_dir)[-1]["report"]


def test_report_killed_after_run_finished_is_finished_by_resume_auto(finished_run, tmp_path):
    run_dir = _copy_run(finished_run, tmp_path)
    lines = (run_dir / "journal.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["event"] == "run_finished"
    (run_dir / "journal.jsonl").write_text("\n".join(lines[:-1]) + "\n")  # killed mid-report
    shutil.rmtree(run_dir / "results")
    proc = run_cli([*FINISHED_ARGS, "resume_from=auto", "experiment.name=hostile"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert run_dirs(tmp_path, "hostile") == [run_dir]  # no new run started
    assert (run_dir / "results" / "summary.csv").is_file()
    assert "config is code" not in proc.stdout + proc.stderr  # no override runs on this resume


def test_logs_that_is_not_a_folder_is_refused_before_anything_starts(finished_run, tmp_path):
    run_dir = _copy_run(finished_run, tmp_path)
    before = (run_dir / "journal.jsonl").read_text()
    shutil.rmtree(run_dir / "logs", ignore_errors=True)
    (run_dir / "logs").write_text("not a folder")
    proc = run_cli(["resume_from=" + str(run_dir), "executor.progress=false"], tmp_path)
    assert "logs is not a folder" in _one_line_exit_2(proc)
    assert (run_dir / "journal.jsonl").read_text() == before


def test_committed_files_follow_the_umask(tmp_path):
    task = TaskPaths(tmp_path, "t")
    tmp = task.tmp(1)
    (tmp / "model").mkdir(parents=True)
    for name in ("result.json", "log.txt", "model/model.safetensors"):
        (tmp / name).write_text("{}")
        (tmp / name).chmod(0o600)  # what safetensors writes
    task.commit(tmp)
    mask = os.umask(0o022)
    os.umask(mask)
    mode = stat.S_IMODE((task.final / "model" / "model.safetensors").stat().st_mode)
    assert mode == 0o666 & ~mask


# --- sizes without a ceiling -------------------------------------------------------------------


def test_three_hundred_fake_devices_are_refused_at_once():
    from pita.core.gpu_manager import MAX_FAKE_DEVICES, validate_devices_spec

    spec = "fake:[" + ",".join(["8GB"] * 300) + "]"
    with pytest.raises(ConfigError, match=f"up to {MAX_FAKE_DEVICES} sizes"):
        validate_devices_spec(spec)


def test_unreachable_ray_address_fails_within_the_deadline():
    """An address that never answers (a listener whose accept queue is full drops every
    new SYN, so the connection hangs) is refused by the probe's deadline, not by a refused
    connection: the message names the timeout. A closed port is refused as well."""
    import contextlib
    import socket

    from pita.core.ray_executor import probe_ray_address

    with contextlib.ExitStack() as stack:
        server = stack.enter_context(socket.socket())
        server.bind(("127.0.0.1", 0))
        server.listen(0)
        port = server.getsockname()[1]
        for _ in range(3):  # fill the accept queue; nobody accepts
            client = stack.enter_context(socket.socket())
            client.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                client.connect(("127.0.0.1", port))
        with pytest.raises(ConfigError, match=r"': no Ray .*TimeoutError within 2 s"):
            probe_ray_address(f"127.0.0.1:{port}", timeout_s=2)
    with socket.socket() as s:  # a port nobody listens on: bind, never listen
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        with pytest.raises(ConfigError, match=r"^executor.ray_address='127.0.0.1:\d+': no Ray"):
            probe_ray_address(f"127.0.0.1:{port}", timeout_s=2)


# --- aggregate over hand-edited or damaged runs ---------------------------------------------------


def test_aggregate_survives_inf_nan_mixed_keys_and_bad_yaml(tmp_path):
    from pita.results.aggregate import main
    from tests.test_aggregate import _job

    sweep = tmp_path / "sweep"
    row = ["QSharp", "goal_walk", "tiny", 0, 5.0, 40, 80, 0.5, 0.5, 0.5, 0.4, 1.0]
    _job(sweep / "0", 0, [row, ["QSharp", "goal_walk", "tiny", 0, 5.0, 40, 80, "inf", "nan"]])
    _job(sweep / "1", 1, [row, ["QSharp", "goal_walk", "tiny", "x", "eta?", 40, 80, 0.1]])
    (sweep / "1" / ".hydra" / "overrides.yaml").write_text("- [unclosed\n  : : :\n")
    assert main([str(sweep), "--out", str(tmp_path / "agg")]) == 0
    table = (tmp_path / "agg" / "aggregate.md").read_text()
    assert "inf" not in table and "nan" not in table.lower().replace("n_runs", "")


# --- lock first, then write ---------------------------------------------------------------------


def test_refused_new_run_writes_nothing_in_the_locked_folder(tmp_path):
    """Another orchestrator holds the folder (a real flock, from this test process): a new
    run pointed at it exits 2 before Hydra writes `.hydra/` or run.log."""
    target = tmp_path / "outputs" / "busy"
    with RunLock(target):
        before = sorted(p.name for p in target.iterdir())
        proc = run_cli(
            ["experiment=smoke", "algos=[reference]", f"hydra.run.dir={target}"], tmp_path
        )
        assert "in use by pid" in _one_line_exit_2(proc)
        assert sorted(p.name for p in target.iterdir()) == before == [".lock"]


def test_refused_resume_changes_nothing(finished_run, tmp_path):
    run_dir = _copy_run(finished_run, tmp_path)
    files = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and p.name != ".lock"}
    with RunLock(run_dir):
        proc = run_cli(["resume_from=" + str(run_dir), "executor.progress=false"], tmp_path)
        assert "in use by pid" in _one_line_exit_2(proc)
    after = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and p.name != ".lock"}
    assert after == files  # saved config, run.log, journal: untouched


def test_dry_run_creates_no_folder(tmp_path):
    proc = run_cli(["experiment=smoke", "algos=[reference]", "dry_run=true"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Estimated wall time" in proc.stdout
    assert not (tmp_path / "outputs").exists()


# --- command-line and saved-config edges ----------------------------------------------------------


def test_missing_config_dir_is_one_line_exit_2(tmp_path):
    proc = run_cli(["--config-dir", str(tmp_path / "nonexistent")], tmp_path)
    assert "no such folder" in _one_line_exit_2(proc)


def test_interpolation_error_in_an_experiment_file_names_file_and_line(tmp_path):
    conf = tmp_path / "myconf" / "experiment"
    conf.mkdir(parents=True)
    (conf / "mine.yaml").write_text("# @package _global_\nexperiment:\n  name: ${oops}\n")
    proc = run_cli(["--config-dir", str(tmp_path / "myconf"), "experiment=mine"], tmp_path)
    assert "set in myconf/experiment/mine.yaml:3" in _one_line_exit_2(proc)


def test_type_error_in_a_saved_config_is_one_line(finished_run, tmp_path):
    run_dir = _copy_run(finished_run, tmp_path)
    saved = run_dir / ".hydra" / "config.yaml"
    head, _, tail = saved.read_text().partition("\npretrain:\n")
    tail = re.sub(r"(?m)^  lr: .*$", "  lr: abc", tail, count=1)  # a float key, hand-edited
    saved.write_text(f"{head}\npretrain:\n{tail}")
    proc = run_cli(["resume_from=" + str(run_dir)], tmp_path)
    assert "pretrain.lr" in _one_line_exit_2(proc)


def test_resume_auto_with_a_relative_dataset_path_finds_its_own_run(tmp_path, monkeypatch):
    """run() saves dataset.path made absolute; the same command line (relative path) must
    still describe the same run for resume_from=auto (it was refused as 'another run')."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from pita.experiment import cli
    from pita.experiment.preflight import absolutize_paths

    monkeypatch.chdir(tmp_path)
    overrides = ["dataset=gsm8k", "dataset.path=data.jsonl", "model=local"]
    saved = cli.compose_config(overrides)
    absolutize_paths(saved)
    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(saved))
    args = SimpleNamespace(config_name=None, config_dir=None)
    assert cli._same_run_overrides(str(run_dir), overrides, args) == []


def test_overridden_stage_that_writes_nothing_fails_its_task(tmp_path):
    args = ["experiment=smoke", "algos=[reference]", "executor.progress=false"]
    args += [o for o in sleep_overrides() if ".evaluate_merge=" not in o]  # the others sleep
    args += ["+executor.stage_overrides.any.evaluate_merge=tests.fault_stages:forgetful_stage"]
    proc = run_cli(args, tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "declared output(s): metrics.json" in proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "override, message",
    [
        ("rounds_of_training=100000", "rounds_of_training=100000: must be <= 20"),
        ("dataset.num_nodes=1000000000", "dataset.num_nodes=1000000000: must be <= 100000"),
    ],
)
def test_huge_sizes_are_refused_before_anything_is_built(tmp_path, override, message):
    proc = run_cli([override, "dry_run=true"], tmp_path, timeout=60)
    assert message in _one_line_exit_2(proc)


def test_dry_run_of_the_largest_accepted_plan_finishes(tmp_path):
    """20 rounds of every algorithm on 64 fake GPUs (~17k tasks): planned, estimated and
    simulated (the timeout is a hang guard: it never finished before the ceilings)."""
    args = ["rounds_of_training=20", "system.devices=fake:64", "dry_run=true"]
    proc = run_cli(args, tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Estimated wall time" in proc.stdout
