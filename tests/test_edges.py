"""Issue 22's edges: the in-process mode's threads and progress bars, SLURM without
`sbatch`, Ray's token auth messages, and the submitit sweep's job lines."""

from __future__ import annotations

import os
import pickle
import stat
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT, only, run_cli, run_dirs

# ---- the in-process mode ----------------------------------------------------------------------


def test_inprocess_runner_uses_the_worker_thread_budget_and_restores_it(monkeypatch):
    """Left alone, torch takes every core in-process (12x slower than the pool on the issue's
    machine): each task runs with a pool worker's threads, and the caller's setting returns."""
    import torch
    from transformers.utils import logging as hf_logging

    import pita.runtime.worker as worker

    seen = {}

    def fake_run(task, cfg_dict, run_dir, attempt, **kwargs):
        seen.update(
            threads=torch.get_num_threads(),
            bars=hf_logging.is_progress_bar_enabled(),
            hub_bars=os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS"),
        )
        return "outcome"

    monkeypatch.setattr(worker, "run_task_here", fake_run)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    hf_logging.enable_progress_bar()
    try:
        runner = worker.InProcessRunner(1)
        assert runner("task", {"system": {"threads_per_worker": 1}}, "run", 1) == "outcome"
        assert seen == {"threads": 1, "bars": False, "hub_bars": "1"}
        assert torch.get_num_threads() == 2 and hf_logging.is_progress_bar_enabled()
        assert "HF_HUB_DISABLE_PROGRESS_BARS" not in os.environ
    finally:
        torch.set_num_threads(before)


@pytest.mark.long
@pytest.mark.slow
def test_inprocess_run_prints_no_progress_bars(tmp_path):
    """A real in-process run (pretrain, DPO through TRL, evaluation) leaves no tqdm bars on
    the terminal (before: "Loading weights: 100%|...", "Writing model shards ..."). Slow:
    it trains for real; the quick set checks the mechanism (the test above: bars off and
    the worker's threads while a task runs in-process)."""
    args = [
        "experiment=smoke",
        "system.use_parallel_execution=false",
        "experiment.name=inq",
        "executor.progress=false",
        *only("DPO"),
    ]
    proc = run_cli(args, tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert run_dirs(tmp_path, "inq")
    bars = [ln for ln in proc.stderr.splitlines() if "it/s]" in ln or "%|" in ln]
    assert not bars, bars[:3]


# ---- SLURM without sbatch ---------------------------------------------------------------------


def _path_without_sbatch(tmp_path, monkeypatch) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    dirs = [d for d in os.environ.get("PATH", "").split(os.pathsep) if d]
    dirs = [d for d in dirs if not os.path.exists(os.path.join(d, "sbatch"))]
    monkeypatch.setenv("PATH", os.pathsep.join([str(bin_dir), *dirs]))


def test_slurm_launcher_without_sbatch_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    from pita.experiment import cli

    _path_without_sbatch(tmp_path, monkeypatch)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(cli.LAST_COMPOSE, "launcher", "")  # later tests see no SLURM launcher
    with pytest.raises(SystemExit) as done:
        cli.main(["-m", "hydra/launcher=slurm", "experiment=smoke"])
    assert done.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: hydra/launcher=slurm: sbatch not found on PATH; run on a SLURM login node "
        "or use hydra/launcher=submitit_local"
    ]
    assert not (tmp_path / "outputs").exists()


def test_check_launcher_passes_with_sbatch_and_for_other_launchers(tmp_path, monkeypatch):
    from pita.core.errors import ConfigError
    from pita.experiment.preflight import check_launcher

    slurm = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    _path_without_sbatch(tmp_path, monkeypatch)
    check_launcher(None)
    check_launcher("hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher")
    with pytest.raises(ConfigError, match="hydra/launcher=submitit_slurm: sbatch not found"):
        check_launcher(slurm, [])
    sbatch = tmp_path / "bin" / "sbatch"
    sbatch.write_text("#!/bin/sh\n")
    sbatch.chmod(sbatch.stat().st_mode | stat.S_IEXEC)
    check_launcher(slurm, ["hydra/launcher=slurm"])  # a login node: no complaint


# ---- Ray token auth ---------------------------------------------------------------------------


def test_ray_auth_failures_name_the_missing_or_refused_credential(tmp_path, monkeypatch):
    from pita.core import ray_executor as rx

    for var in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    refused = "AuthenticationError: RPC error: InvalidAuthToken: Authentication token is missing"
    assert rx.auth_error("h:6379", "ConnectionError: Failed to connect to Ray cluster") is None
    [line] = rx.auth_error("h:6379", refused).messages
    assert line.startswith(
        "executor.ray_address='h:6379': the Ray cluster requires token authentication and no "
        "token was found; set RAY_AUTH_TOKEN"
    )
    assert "no Ray cluster reachable" not in line
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "wrong")
    [line] = rx.auth_error("h:6379", refused).messages
    assert "refused the token from RAY_AUTH_TOKEN; set RAY_AUTH_TOKEN" in line


def test_a_token_in_the_environment_turns_token_auth_on_for_an_explicit_address(tmp_path):
    """Ray enables token mode by itself only for `auto`: an explicit address went without
    the token and was refused (reported as "no Ray cluster reachable"). Run in a child
    process: Ray caches its auth config process-wide, and a later in-process local Ray of
    this test session must not inherit it."""
    pytest.importorskip("ray")
    body = textwrap.dedent(
        f"""
        import os
        from pathlib import Path
        from pita.core import ray_executor as rx

        home = Path({str(tmp_path)!r})
        rx.enable_token_auth("10.0.0.1:6379")
        assert "RAY_AUTH_MODE" not in os.environ  # no token anywhere: nothing to send
        (home / ".ray").mkdir()
        (home / ".ray" / "auth_token").write_text("abc\\n")
        assert rx.token_source() == str(home / ".ray" / "auth_token")
        rx.enable_token_auth("local")
        assert "RAY_AUTH_MODE" not in os.environ  # a new local Ray: Ray decides
        rx.enable_token_auth("10.0.0.1:6379")
        assert os.environ["RAY_AUTH_MODE"] == "token"
        os.environ["RAY_AUTH_MODE"] = "disabled"
        rx.enable_token_auth("10.0.0.1:6379")
        assert os.environ["RAY_AUTH_MODE"] == "disabled"  # the user's explicit choice stays
        print("ok")
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update(HOME=str(tmp_path), PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", body], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


# ---- submitit sweeps: a line per job start and end -------------------------------------------


def test_sweep_watcher_prints_each_job_start_and_end_once(tmp_path):
    from pita.results.aggregate import SWEEP_WATCHER, AggregateCallback, SweepWatcher

    lines: list[str] = []
    sweep = tmp_path / "multirun"
    watcher = SweepWatcher(sweep, out=lines.append)
    assert watcher.poll() == []  # the sweep folder does not exist yet
    (sweep / ".submitit" / "123").mkdir(parents=True)  # submitit's own folder: not a job
    (sweep / "0").mkdir()
    (sweep / "1").mkdir()
    watcher.poll()
    (sweep / "0" / "exit_code").write_text("0\n")
    watcher.poll()
    watcher.poll()  # nothing new: nothing printed
    (sweep / "1" / "exit_code").write_text("1\n")
    watcher.stop()  # the last poll reports what ended since the previous one
    assert lines == [
        f"job 0 started: {sweep / '0'}",
        f"job 1 started: {sweep / '1'}",
        "job 0 finished (exit 0)",
        "job 1 finished (exit 1)",
    ]
    from omegaconf import OmegaConf

    local = OmegaConf.create(
        {"hydra": {"sweep": {"dir": str(sweep)}, "launcher": {"_target_": "x.BasicLauncher"}}}
    )
    callback = AggregateCallback()
    callback.on_multirun_start(local)
    assert SWEEP_WATCHER[0] is None  # a local sweep's jobs print their own lines
    remote = OmegaConf.merge(local, {"hydra": {"launcher": {"_target_": "x.LocalLauncher"}}})
    callback.on_multirun_start(remote)
    watcher = SWEEP_WATCHER[0]
    try:
        assert watcher is not None and watcher.finished == {"0", "1"}  # an earlier sweep's
        pickle.dumps(callback)  # submitit pickles the callbacks with each job
    finally:
        SWEEP_WATCHER[0] = None
        watcher.stop()


def test_sweep_watcher_thread_prints_while_jobs_run(tmp_path):
    import time

    from pita.results.aggregate import SweepWatcher

    lines: list[str] = []
    watcher = SweepWatcher(tmp_path, interval_s=0.05, out=lines.append)
    watcher.start()
    try:
        (tmp_path / "0").mkdir()
        deadline = time.time() + 10
        while not lines and time.time() < deadline:
            time.sleep(0.05)
        assert lines == [f"job 0 started: {tmp_path / '0'}"]  # printed by the thread
    finally:
        watcher.stop()


def test_a_refusing_cluster_is_reported_by_the_auth_probe_not_after_ray_init_retries(
    tmp_path, monkeypatch
):
    """Ray 2.60's GCS answers a client without the token with `InvalidAuthToken`; ray.init
    would retry it for ~20 s and say only "Failed to connect to Ray cluster"."""
    ray_raylet = pytest.importorskip("ray._raylet")
    from ray.exceptions import AuthenticationError

    from pita.core import ray_executor as rx
    from pita.core.errors import ConfigError

    def refuse(address):
        raise AuthenticationError("RPC error: InvalidAuthToken: Authentication token is missing")

    for var in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(ray_raylet, "GcsClient", refuse, raising=False)
    rx.probe_ray_auth("auto")  # a cluster Ray finds itself: Ray's own token handling
    with pytest.raises(ConfigError, match="requires token authentication and no token was found"):
        rx.probe_ray_auth("10.0.0.1:6379")
    monkeypatch.setattr(ray_raylet, "GcsClient", lambda address: None, raising=False)
    rx.probe_ray_auth("10.0.0.1:6379")  # accepted: ray.init connects
