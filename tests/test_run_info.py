"""run_info.json: git commit and dirty flag, package versions, devices and the typed command."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import ROOT, run_cli, run_dirs


@pytest.mark.slow
def test_run_folder_records_commit_packages_devices_and_command(tmp_path):
    args = [
        "experiment=smoke",
        "algos=[reference]",
        "pretrain.steps=3",
        "executor.progress=false",
        "system.devices=fake:2",
    ]
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    done = run_cli(args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    run = run_dirs(tmp_path, "smoke")[0]
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
    resumed = run_cli([f"resume_from={run}"], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    info = json.loads((run / "run_info.json").read_text())
    assert len(info["resumes"]) == 1 and info["resumes"][0]["command"][-1] == f"resume_from={run}"
