"""run_info.json: git commit and dirty flag, package versions, devices and the typed command."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import ROOT, run_cli


@pytest.mark.slow
def test_run_folder_records_commit_packages_devices_and_command(smoke_run):
    """Read from the session's smoke run; the resume at the end only adds to run_info.json."""
    args = smoke_run.args
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    run, tmp_path = smoke_run.run_dir, smoke_run.cwd
    info = json.loads((run / "run_info.json").read_text())
    assert info["command"][1:] == [
        str(ROOT / "run_parallel.py"),
        *args,
    ]  # as typed, before algos=[..] expands
    if head.returncode == 0:
        assert info["git"]["commit"] == head.stdout.strip() and isinstance(
            info["git"]["dirty"], bool
        )
    for package in ("torch", "transformers", "trl", "hydra-core", "python"):
        assert info["packages"][package]
    assert info["devices"]["kind"] == "fake" and info["devices"]["count"] == 2
    assert len(info["devices"]["inventory"]) == 2 and info["resumes"] == []
    resumed = run_cli([f"resume_from={run}"], cwd=tmp_path, env=smoke_run.env)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    info = json.loads((run / "run_info.json").read_text())
    assert len(info["resumes"]) == 1 and info["resumes"][0]["command"][-1] == f"resume_from={run}"
