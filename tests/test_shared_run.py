"""A run shared with a teammate (issue 34 item 6, docs/operations.md "Permissions"): with
the run folder group-writable and `system.trust_group=true` a second, real user of the
group resumes it; a resume may add `system.trust_group`.

The two-user test creates a group and a user (root only, else skipped) and runs the
teammate's resume under that uid with `setpriv`; the only privilege it keeps is
CAP_DAC_READ_SEARCH, so it can read the interpreter under /root (0700 here) while every
write and every ownership check is the teammate's own."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from pita.core.run_lock import RunLock
from pita.core.safe_files import group_shared, share_with_group
from tests.conftest import ROOT, journal, run_cli, sleep_overrides
from tests.test_faults import BASE, REF

GROUP, MATE = "pitateam", "pita_mate"
MERGE = "reference.goal_walk.tiny.r0.evaluate"


def test_a_resume_may_add_system_trust_group(tmp_path):
    from pita.experiment.cli import compose_config, load_resume_config

    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(compose_config([])))
    (run / "plan.json").write_text("{}")
    try:
        cfg, _ = load_resume_config(str(run), ["system.trust_group=true"])
        assert cfg.system.trust_group is True and group_shared()
        cfg, _ = load_resume_config(str(run), [])
        assert cfg.system.trust_group is False and not group_shared()
    finally:
        share_with_group(False)


def test_a_shared_runs_lock_is_the_groups(tmp_path):
    try:
        share_with_group(True)
        with RunLock(tmp_path):
            assert stat.S_IMODE((tmp_path / ".lock").stat().st_mode) == 0o660
        share_with_group(False)
        with RunLock(tmp_path):  # unshared again: private
            assert stat.S_IMODE((tmp_path / ".lock").stat().st_mode) == 0o600
    finally:
        share_with_group(False)


def test_a_shared_run_creates_what_a_teammate_writes_group_writable(tmp_path):
    """Issue 43: under trust_group the umask's group bits are cleared, so the files a
    teammate's resume appends to or replaces (worker logs, run.log, journal, results, task
    folders) are created group-writable; unsharing restores the umask."""
    from pita.core.forked_worker import _forked_child  # noqa: F401 - its log mode is 0o666
    from pita.core.journal import Journal
    from pita.core.paths import atomic_write_text, current_umask

    before = os.umask(0o022)
    try:
        share_with_group(True)
        assert current_umask() == 0o002
        (tmp_path / "tasks").mkdir()
        atomic_write_text(tmp_path / "summary.csv", "x\n")
        journal_ = Journal(tmp_path / "journal.jsonl")
        journal_.append("run_started", tasks=1, already_done=0)
        journal_.close()
        fd = os.open(tmp_path / "worker-0.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
        os.close(fd)
        for name in ("tasks", "summary.csv", "journal.jsonl", "worker-0.log"):
            assert (tmp_path / name).stat().st_mode & stat.S_IWGRP, name
        share_with_group(False)
        assert current_umask() == 0o022
    finally:
        share_with_group(False)
        os.umask(before)


def test_a_log_this_user_cannot_append_to_gets_one_of_its_own(shared_place):
    """A teammate's 0644 log (a run shared after it was written): the worker and the resume
    write beside it instead of dying on PermissionError (checked as a real second user)."""
    from pita.core.paths import writable_log

    log = shared_place / "worker-0.log"
    assert writable_log(log) == log  # absent: created
    log.write_text("owner's\n")
    log.chmod(0o644)
    assert writable_log(log) == log  # yours
    _teammate()
    probe = "import sys; from pathlib import Path; from pita.core.paths import writable_log; "
    probe += "print(writable_log(Path(sys.argv[1])))"
    as_mate = ["setpriv", f"--reuid={MATE}", f"--regid={GROUP}", "--init-groups"]
    as_mate += ["--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]
    proc = subprocess.run(
        [*as_mate, sys.executable, "-c", probe, str(log)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    mate_uid = int(subprocess.run(["id", "-u", MATE], capture_output=True, text=True).stdout)
    assert proc.stdout.strip() == str(shared_place / f"worker-0.uid{mate_uid}.log"), proc.stderr


def _teammate() -> None:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to act as a second user")
    if subprocess.run(["getent", "group", GROUP], capture_output=True).returncode:
        subprocess.run(["groupadd", GROUP], check=True)
    if subprocess.run(["id", MATE], capture_output=True).returncode:
        subprocess.run(
            ["useradd", "-M", "-N", "-g", GROUP, "-s", "/usr/sbin/nologin", MATE], check=True
        )


def _run_as(prefix: list[str], args: list[str], cwd: Path, **env: str):
    """run_parallel.py under `prefix` (a `setpriv` command line) in `cwd`."""
    return subprocess.run(
        [*prefix, sys.executable, str(ROOT / "run_parallel.py"), *args],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def _as_teammate(args: list[str], home: Path) -> subprocess.CompletedProcess:
    as_mate = [
        "setpriv",
        f"--reuid={MATE}",
        f"--regid={GROUP}",
        "--init-groups",
        "--inh-caps=+dac_read_search",
        "--ambient-caps=+dac_read_search",
    ]
    return _run_as(as_mate, args, home, HOME=str(home), PITA_CACHE_DIR=str(home / "cache"))


@pytest.fixture
def shared_place():
    """A folder the teammate can reach: pytest's own tmp_path lies under a 0700 folder."""
    import tempfile

    place = Path(tempfile.mkdtemp(prefix="pita-shared-"))
    place.chmod(0o755)
    yield place
    shutil.rmtree(place, ignore_errors=True)


@pytest.mark.slow
def test_a_teammate_resumes_a_group_writable_run_with_trust_group(shared_place):
    _teammate()
    tmp_path = shared_place
    done = run_cli([*BASE, *REF, "experiment.name=team", *sleep_overrides()], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    [run] = list((tmp_path / "outputs" / "team").iterdir())
    # the owner shares it: a resume that adds system.trust_group (the lock becomes 0660)
    shared = run_cli(["resume_from=" + str(run), "system.trust_group=true"], tmp_path)
    assert shared.returncode == 0, shared.stdout + shared.stderr
    shutil.rmtree(run / "tasks" / MERGE)  # work left for the teammate
    shutil.rmtree(run / "results")
    subprocess.run(["chgrp", "-R", GROUP, str(run)], check=True)
    subprocess.run(["chmod", "-R", "g+w", str(run)], check=True)
    subprocess.run(["find", str(run), "-type", "d", "-exec", "chmod", "g+s", "{}", "+"], check=True)
    # issue 43: the owner's own shared resume writes new worker logs and run.log lines; they
    # must be the group's to append to (they were 0644 and the teammate's workers died)
    shutil.rmtree(run / "workers")
    again = run_cli(["resume_from=" + str(run), "system.trust_group=true"], tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    logs = list((run / "workers").glob("worker-*.log"))
    assert logs and all(p.stat().st_mode & stat.S_IWGRP for p in logs), logs
    shutil.rmtree(run / "tasks" / MERGE)  # work left for the teammate, again
    shutil.rmtree(run / "results")
    home = tmp_path / "mate"
    home.mkdir()
    shutil.chown(home, MATE, GROUP)

    refused = _as_teammate(["resume_from=" + str(run)], home)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    [line] = refused.stderr.strip().splitlines()
    assert "owned by uid 0" in line and "needs system.trust_group=true" in line

    # the owner's stage overrides are code: the teammate runs them only by stating them
    # (pita/experiment/code_keys.py), else one line per key naming the owner
    resume = ["resume_from=" + str(run), "system.trust_group=true"]
    unstated = _as_teammate(resume, home)
    assert unstated.returncode == 2, unstated.stdout + unstated.stderr
    assert all("set by user root (uid 0)" in ln for ln in unstated.stderr.strip().splitlines())
    stages = [o for o in sleep_overrides() if "stage_overrides" in o]
    resumed = _as_teammate([*resume, *stages], home)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    mate_uid = int(subprocess.run(["id", "-u", MATE], capture_output=True, text=True).stdout)
    assert (run / "tasks" / MERGE).stat().st_uid == mate_uid  # the teammate redid it
    assert (run / "results").is_dir()  # the time report, written by the teammate
    assert journal(run)[-1]["event"] == "run_finished" and journal(run)[-1]["report"]
    # and the owner, a member of the group too, reads the teammate's files back: nothing redone
    gid = int(
        subprocess.run(["getent", "group", GROUP], capture_output=True, text=True).stdout.split(
            ":"
        )[2]
    )
    again = _run_as(
        ["setpriv", f"--groups=0,{gid}"],
        ["resume_from=" + str(run), "system.trust_group=true"],
        tmp_path,
    )
    assert again.returncode == 0, again.stdout + again.stderr
    assert "4 already done" in again.stdout + again.stderr


def _mate_uid() -> int:
    _teammate()
    return int(subprocess.run(["id", "-u", MATE], capture_output=True, text=True).stdout)


def _shared_run(tmp_path: Path, overrides: list[str], owner: int) -> Path:
    """A run folder whose saved config (with `overrides`) the user `owner` wrote, and that
    user's record of the code-bearing values it ran with (a real file of theirs)."""
    from pita.experiment.cli import compose_config
    from pita.experiment.code_keys import record

    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True, exist_ok=True)
    cfg = compose_config(overrides)
    (run / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    (run / "plan.json").write_text("{}")
    record(cfg, run)
    for p in [run / ".hydra" / "config.yaml", *run.glob(".code_keys.*.json")]:
        os.chown(p, owner, 0)  # gid 0: a group of this (root) user, as trust_group needs
    return run


EVIL = "+executor.stage_overrides.any.train=tests.fault_stages:sleep_stage"  # importable: the plan checks


@pytest.mark.parametrize("key", [EVIL, "model.trust_remote_code=true"])
def test_a_teammates_code_bearing_key_is_refused_until_the_owner_states_it(tmp_path, key):
    """Issue 43: a teammate's resume left `executor.stage_overrides` / `trust_remote_code` in
    the saved config; the owner's next resume ran it, as the owner. Now it is one line naming
    the teammate, until the owner states it again."""
    from pita.experiment.cli import load_resume_config
    from pita.experiment.code_keys import code_bearing, foreign_code_errors, record, stated_keys

    mate = _mate_uid()
    run = _shared_run(tmp_path, ["experiment=smoke", key], owner=mate)
    try:
        cfg, _ = load_resume_config(str(run), ["system.trust_group=true"])
        [line] = foreign_code_errors(cfg, run, stated_keys(["system.trust_group=true"]))
        name = key.lstrip("+").split("=")[0]
        assert line.startswith(f"{name}=") and f"set by user {MATE} (uid {mate})" in line, line
        assert foreign_code_errors(cfg, run, stated_keys([key])) == []  # stated again: yours
        # ... and stating it again on a resume works (a typed dict of a saved config did not
        # take a dotlist merge: "Value 'AnyNode' is not a supported primitive type")
        again, _ = load_resume_config(str(run), ["system.trust_group=true", key])
        assert code_bearing(again) == code_bearing(cfg)
        record(cfg, run)  # ... and once you ran with it, it is yours on later resumes
        assert foreign_code_errors(cfg, run, set()) == []
    finally:
        share_with_group(False)


def test_a_resume_refuses_it_in_one_line_exit_2(tmp_path, capsys, monkeypatch):
    """Through the command line: exit 2, one line; nothing of the run changes."""
    from pita.experiment import cli

    mate = _mate_uid()
    run = _shared_run(tmp_path, ["experiment=smoke", EVIL], owner=mate)
    (run / "plan.json").unlink()
    from pita.experiment.run import build_plan, make_gpu_manager

    composed = cli.compose_config(["experiment=smoke", EVIL])
    (run / "plan.json").write_text(
        json.dumps(build_plan(composed, make_gpu_manager(composed)).to_json())
    )
    os.chown(run / "plan.json", mate, 0)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    monkeypatch.chdir(tmp_path)
    try:
        with pytest.raises(SystemExit) as exit_info:
            cli.main([f"resume_from={run}", "system.trust_group=true"])
    finally:
        share_with_group(False)
    assert exit_info.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(
        "error: executor.stage_overrides.any.train=tests.fault_stages:sleep_stage: set by"
    )
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
