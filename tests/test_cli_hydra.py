"""Hydra-native command line: -cn, --config-dir, hydra.searchpath, -sc, --help; algos=[..];
resume_from=auto; a non-local launcher checks devices in the job, not on the login node."""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import only, run_cli, run_dirs, sleep_overrides

MINE = """# @package _global_
experiment:
  name: mine
pretrain:
  steps: 7
"""
PRIMARY = """defaults:
  - config
  - _self_
pretrain:
  steps: 9
"""


@pytest.fixture
def user_conf(tmp_path):
    folder = tmp_path / "myconf"
    (folder / "experiment").mkdir(parents=True)
    (folder / "experiment" / "mine.yaml").write_text(MINE)
    (folder / "myconfig.yaml").write_text(PRIMARY)
    return folder


def test_help_lists_pita_keys_with_their_help_text(tmp_path):
    done = run_cli(["--help"], cwd=tmp_path)
    assert done.returncode == 0
    assert "training.checkpoint_every" in done.stdout and "logger.backend" in done.stdout
    assert "Run folder name under outputs/" in done.stdout  # the dataclass metadata help
    assert "algos=[QSharp,DPO]" in done.stdout and "cli" not in done.stdout.split("\n")[0]


def test_shell_completion_install_starts_nothing(tmp_path):
    done = run_cli(["-sc", "install=bash"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "hydra_bash_completion" in done.stdout
    assert not (tmp_path / "outputs").exists()


def test_config_dir_searchpath_and_config_name(tmp_path, user_conf):
    done = run_cli(
        ["--config-dir", str(user_conf), "experiment=mine", "--cfg", "job"], cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert "name: mine" in done.stdout and "steps: 7" in done.stdout
    done = run_cli(
        [
            f"hydra.searchpath=[file://{user_conf}]",
            "experiment=mine",
            "algos=[reference]",
            "dry_run=true",
        ],
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "pretrain.goal_walk.tiny" in done.stdout
    done = run_cli(
        ["--config-dir", str(user_conf), "-cn", "myconfig", "--cfg", "job"], cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert "steps: 9" in done.stdout
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    bad = run_cli(
        ["--config-dir", str(user_conf), "-cn", "myconfig", "pretrain.steps=0", "algos.GRPO.lr=-1"],
        cwd=fresh,
    )
    assert bad.returncode == 2
    assert sorted(bad.stderr.splitlines()) == [
        "error: algos.GRPO.lr=-1.0: must be > 0",
        "error: pretrain.steps=0: must be >= 1",
    ], bad.stderr
    assert not (fresh / "outputs").exists()


def test_algos_list_selects_algorithms_in_one_override(tmp_path):
    done = run_cli(["algos=[QSharp,DPO]", "--cfg", "job"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    dry = run_cli(["algos=[QSharp,DPO]", "dry_run=true"], cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr
    ids = [
        ln.split()[0]
        for ln in dry.stdout.splitlines()
        if ln.startswith(("QSharp.", "DPO.", "GRPO.", "PITA."))
    ]
    assert {i.split(".")[0] for i in ids} == {"QSharp", "DPO"}
    bad = run_cli(["algos=[QSharp,Qsharp]"], cwd=tmp_path)
    assert bad.returncode == 2
    assert bad.stderr.strip() == (
        "error: algos=[QSharp,Qsharp]: unknown algorithm 'Qsharp'; allowed: reference, "
        "PITA, QSharp, QSharp-HF, DPO, RPO, GRPO, GRPO-HF (e.g. algos=[QSharp,DPO] or algos=all)"
    )


@pytest.mark.slow
def test_resume_from_auto_starts_then_finishes_the_unfinished_run(tmp_path):
    args = [
        "experiment=smoke",
        "algos=[reference]",
        "executor.progress=false",
        "resume_from=auto",
        *sleep_overrides(),  # what is checked is the CLI's choice of run, not the training
    ]
    first = run_cli(args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "starting a new one" in first.stdout
    run = run_dirs(tmp_path, "smoke")[0]
    # as if the job was preempted before the last task: the requeued command finishes it
    (run / "journal.jsonl").open("a").write(json.dumps({"event": "run_started"}) + "\n")
    import shutil

    shutil.rmtree(run / "tasks" / "reference.goal_walk.tiny.r0.evaluate")
    again = run_cli(args, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert (
        f"resuming the unfinished run {run}" in again.stdout
        and "3 already done (resumed)" in again.stdout
    )
    assert len(run_dirs(tmp_path, "smoke")) == 1
    other = run_cli(args, cwd=tmp_path)  # the same command once its run finished: a new run
    assert other.returncode == 0 and len(run_dirs(tmp_path, "smoke")) == 2
    assert "starting a new one" in other.stdout


@pytest.mark.slow
def test_submitit_local_launcher_checks_devices_in_the_job(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    args = [
        "-m",
        "hydra/launcher=submitit_local",
        "experiment=smoke",
        "algos=[reference]",
        "dry_run=true",
    ]
    local = run_cli(["-m", "experiment=smoke", "system.devices=[3]", "dry_run=true"], cwd=tmp_path)
    assert (
        local.returncode == 2 and not (tmp_path / "outputs").exists()
    )  # checked before anything starts
    remote = run_cli([*args, "system.devices=[3]"], cwd=tmp_path, timeout=300)
    assert remote.returncode == 2, remote.stdout[-2000:] + remote.stderr[-2000:]
    err = next(
        (tmp_path / "outputs" / "smoke" / "multirun").glob("*/.submitit/*/*_0_log.err")
    ).read_text()
    assert "error: system.devices=[3]" in err  # the job, on its node, found no such GPU
    ok = run_cli([*args, "system.devices=cpu"], cwd=tmp_path, timeout=300)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "job 0 finished (exit 0)" in ok.stdout  # the sweep said when its job ended


def test_launcher_kind_comes_from_the_composed_config(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    from pita.experiment import cli

    cli.compose_config(["hydra/launcher=slurm_1gpu"])
    assert cli.remote_launcher().endswith("SlurmLauncher")
    cli.compose_config([])
    assert cli.remote_launcher() is None
    bad = run_cli(["-m", "hydra/launcher=slrum"], cwd=tmp_path)
    assert bad.returncode == 2
    assert bad.stderr.startswith(
        "error: hydra/launcher=slrum: no such launcher; available: basic, slurm, slurm_1gpu"
    )


def _run_in_process(tmp_path, monkeypatch, name: str, extra: list[str]) -> tuple[int, int]:
    """One in-process run of two sleep tasks through `cli.main`: (exit code, how many times
    Hydra composed the command line)."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    from pita.experiment import cli

    composes = []
    compose = ConfigLoaderImpl.load_configuration

    def counted(self, *args, **kwargs):
        composes.append(kwargs.get("run_mode"))
        return compose(self, *args, **kwargs)

    monkeypatch.setattr(ConfigLoaderImpl, "load_configuration", counted)
    monkeypatch.setattr(sys, "argv", ["run_parallel.py"])
    monkeypatch.setenv("PITA_COMMAND", "")  # main() sets it; restored after the test
    monkeypatch.setenv("PITA_TEST_SLEEP", "0.01")
    monkeypatch.chdir(tmp_path)
    args = ["system.use_parallel_execution=false", f"experiment.name={name}", *only("reference")]
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*args, "executor.progress=false", *sleep_overrides(), *extra])
    return int(exit_info.value.code or 0), len(composes)


def test_a_single_run_composes_once_and_hydra_records_what_its_own_composition_would(
    tmp_path, monkeypatch
):
    """A single local run hands the pre-check's composition to Hydra's run_job (`@hydra.main`
    would compose twice more: 0.3 s of CPU each); a typed Hydra key takes `@hydra.main`'s
    path. Both write the same `.hydra/` files."""
    import yaml

    once = _run_in_process(tmp_path, monkeypatch, "once", [])
    assert once == (0, 1)
    typed = _run_in_process(tmp_path, monkeypatch, "typed", ["hydra.job.chdir=false"])
    assert typed == (0, 3)  # the pre-check, then Hydra's mode check and its run

    def hydra_files(name: str) -> dict:
        [run_dir] = run_dirs(tmp_path, name)
        files = {
            f: yaml.safe_load((run_dir / ".hydra" / f).read_text())
            for f in ("config.yaml", "hydra.yaml", "overrides.yaml")
        }
        files["config.yaml"]["experiment"]["name"] = "-"
        files["overrides.yaml"] = [o for o in files["overrides.yaml"] if "experiment.name" not in o]
        hydra = files["hydra.yaml"]["hydra"]
        for varying in ("run", "runtime"):
            hydra.pop(varying)
        hydra["overrides"]["task"] = files["overrides.yaml"]
        hydra["overrides"]["hydra"] = [o.split("=")[0] for o in hydra["overrides"]["hydra"]]
        hydra["job"]["override_dirname"] = "-"
        return files

    with_chdir = hydra_files("typed")
    with_chdir["hydra.yaml"]["hydra"]["overrides"]["hydra"].remove("hydra.job.chdir")
    assert hydra_files("once") == with_chdir
