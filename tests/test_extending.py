"""Your own algorithm and dataset without editing pita (issue 34 item 7, docs/extending.md):
the example package examples/my_pita registers an algorithm (Copycat) and a dataset
(short_walk) through entry points, and its config folder adds them to an experiment."""

from __future__ import annotations

import csv
import dataclasses
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
    """Planned with the dataset's own key set on the command line (`dataset.length`, which
    pita's DatasetConfig lacks: my_pita.short_walk.SCHEMA declares it); a typo of it is one
    line, exit 2."""
    proc = _run(["dry_run=true", "dataset.length=3"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    typo = _run(["dry_run=true", "dataset.lenght=3"], tmp_path)
    assert typo.returncode == 2 and "dataset.lenght" in typo.stderr, typo.stderr
    assert len(typo.stderr.strip().splitlines()) == 1, typo.stderr
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


@pytest.mark.long
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


def _fenced(markdown: str) -> list[tuple[str, str]]:
    """(language, body) of each fenced block of `markdown`."""
    import re

    return [(m[1], m[2]) for m in re.finditer(r"```(\w*)\n(.*?)```", markdown, re.S)]


def test_the_docs_are_the_example_as_written(tmp_path):
    """docs/extending.md, as a new user reads it: its toml block is the example's
    pyproject.toml (comments aside), every `ctx.<name>` it names is a StageContext attribute,
    every example path it names exists, and its command runs (as a dry run: the slow
    end-to-end test above runs it to the end)."""
    import re
    import shlex

    from pita.runtime.context import StageContext

    doc = (ROOT / "docs" / "extending.md").read_text()
    blocks = _fenced(doc)
    [toml] = [body for lang, body in blocks if lang == "toml"]
    project = (EXAMPLE / "pyproject.toml").read_text().splitlines()
    lines = [ln.split("#")[0].rstrip() for ln in toml.splitlines()]
    lines = [ln for ln in lines if ln]
    assert lines and all(ln in project for ln in lines), lines
    [yaml] = [body for lang, body in blocks if lang == "yaml"]  # the dataset's config file
    own = (EXAMPLE / "conf" / "dataset" / "short_walk.yaml").read_text()
    assert yaml in own, yaml
    context = {f.name for f in dataclasses.fields(StageContext)} | set(dir(StageContext))
    named = set(re.findall(r"ctx\.(\w+)", doc))
    assert named and named <= context, named - context
    for path in set(re.findall(r"`(examples/my_pita/[\w./-]+)`", doc)):
        assert (ROOT / path).exists(), path
    [commands] = [body for lang, body in blocks if not lang and "run_parallel.py" in body]
    [command] = [c for c in commands.splitlines() if c.startswith("python run_parallel.py")]
    args = shlex.split(command.split("#")[0])[2:]
    args = [str(ROOT / a) if a.startswith("examples/") else a for a in args]
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(EXAMPLE / "src")])}
    proc = run_cli([*args, "dry_run=true"], tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Copycat.short_walk.tiny.r0.train" in proc.stdout
