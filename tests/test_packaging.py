"""A real package: a built wheel, installed without the source tree, runs with its own conf/."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.conftest import ROOT


@pytest.mark.slow
def test_wheel_installs_and_runs_python_m_pita_and_the_pita_command_outside_the_repo(tmp_path):
    wheels, site, cwd = tmp_path / "wheels", tmp_path / "site", tmp_path / "elsewhere"
    cwd.mkdir()
    source = (
        tmp_path / "source"
    )  # setuptools builds in the tree: build from a copy, leave the checkout clean
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(
            ".git",
            ".venv",
            "outputs",
            "build",
            "*.egg-info",
            "__pycache__",
            ".pytest_cache",
            ".ruff_cache",
            ".mypy_cache",  # tens of MB once tests/test_types.py ran
        ),
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(source),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(wheels),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    wheel = next(wheels.glob("pita-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "pita/conf/config.yaml" in names and "pita/conf/logger/tensorboard.yaml" in names
    assert any(n.endswith("licenses/LICENSE") for n in names)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--target",
            str(site),
            "-q",
            str(wheel),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    env = {**os.environ, "PYTHONPATH": str(site)}  # the repo is not importable from here
    where = subprocess.run(
        [
            sys.executable,
            "-c",
            "import pita, pita.experiment.cli as c; print(pita.__file__);print(c.CONF_DIR)",
        ],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert where.stdout.splitlines() == [
        str(site / "pita" / "__init__.py"),
        str(site / "pita" / "conf"),
    ]
    for cmd in ([sys.executable, "-m", "pita"], [sys.executable, str(site / "bin" / "pita")]):
        done = subprocess.run(
            [*cmd, "experiment=smoke", "algos=[reference]", "dry_run=true"],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert (
            "pretrain.goal_walk.tiny" in done.stdout and "dry run, nothing started" in done.stdout
        )
    bad = subprocess.run(
        [sys.executable, "-m", "pita", "logger=nope"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2
    assert (
        "logger=nope: no such logger config; available: csv, mlflow, none, tensorboard, wandb"
        in bad.stderr
    )
