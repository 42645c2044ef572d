"""A run shared with a teammate (issue 34 item 6, docs/operations.md "Permissions"): with
the run folder group-writable and `system.trust_group=true` a second, real user of the
group resumes it; a resume may add `system.trust_group`.

The two-user test creates a group and a user (root only, else skipped) and runs the
teammate's resume under that uid with `setpriv`; the only privilege it keeps is
CAP_DAC_READ_SEARCH, so it can read the interpreter under /root (0700 here) while every
write and every ownership check is the teammate's own."""

from __future__ import annotations

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
    home = tmp_path / "mate"
    home.mkdir()
    shutil.chown(home, MATE, GROUP)

    refused = _as_teammate(["resume_from=" + str(run)], home)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    [line] = refused.stderr.strip().splitlines()
    assert "owned by uid 0" in line and "needs system.trust_group=true" in line

    resumed = _as_teammate(["resume_from=" + str(run), "system.trust_group=true"], home)
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
