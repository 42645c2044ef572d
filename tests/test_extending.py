"""Your own algorithm and dataset without editing pita (issue 34 item 7, docs/extending.md):
the example package examples/my_pita registers an algorithm (Copycat) and a dataset
(short_walk) through entry points, and its config folder adds them to an experiment."""

from __future__ import annotations

import csv
import os
import shutil
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_cli

EXAMPLE = ROOT / "examples" / "my_pita"


def _run(args: list[str], cwd: Path):
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(EXAMPLE / "src")])}
    conf = cwd / "conf"
    if not conf.exists():
        shutil.copytree(EXAMPLE / "conf", conf)  # the user's folder, outside pita
    return run_cli(["--config-dir", str(conf), "experiment=mine", *args], cwd, env=env)


def test_own_algorithm_and_dataset_are_planned_without_editing_pita(tmp_path):
    proc = _run(["dry_run=true"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Copycat.short_walk.tiny.r0.train" in proc.stdout
    assert "Copycat.short_walk.tiny.r0.evaluate " in proc.stdout + " "
    assert "pretrain.short_walk.tiny" in proc.stdout


def test_without_the_package_each_name_is_one_line(tmp_path):
    """The same config without the package installed: one line per key it names, exit 2."""
    shutil.copytree(EXAMPLE / "conf", tmp_path / "conf")
    proc = run_cli(["--config-dir", str(tmp_path / "conf"), "experiment=mine"], tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    algo, dataset = proc.stderr.strip().splitlines()
    assert algo.startswith("error: algos.Copycat: unknown algorithm; allowed: reference")
    assert dataset.startswith("error: dataset.name='short_walk': must be one of goal_walk")


@pytest.mark.slow
def test_own_algorithm_and_dataset_run_end_to_end(tmp_path):
    # one worker importing torch, not one per core
    proc = _run(
        ["executor.progress=false", "pretrain.steps=20", "executor.cpu_workers=1"], tmp_path
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [run] = list((tmp_path / "outputs" / "mine").iterdir())
    with open(run / "results" / "summary.csv", newline="") as f:
        rows = {r["algo"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"reference", "Copycat"}
    assert rows["Copycat"]["dataset"] == "short_walk"
    assert abs(float(rows["Copycat"]["kl"])) < 1e-3  # π_ref copied: no distance from it
    assert (run / "tasks" / "Copycat.short_walk.tiny.r0.train" / "model").is_dir()


def test_an_installed_plugin_never_breaks_algos_lists(tmp_path):
    """Issue 45: with a plugin algorithm installed but not in the config (no experiment adds
    it), the README's `algos=[QSharp,GRPO,DPO]` plans as without the plugin (its algorithm is
    switched off with `++`); naming it says how to add it, in one line."""
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(EXAMPLE / "src")])}
    proc = run_cli(["algos=[QSharp,GRPO,DPO]", "dry_run=true"], tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "GRPO.goal_walk.tiny.r0.train" in proc.stdout and "Copycat" not in proc.stdout
    proc = run_cli(["algos=[QSharp,Copycat]", "dry_run=true"], tmp_path, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("error: algos.Copycat.enabled: algorithm Copycat is installed but not")
    assert "/algo@algos.Copycat" in line
