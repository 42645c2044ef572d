"""logger=<backend>: training metrics (loss, reward, KL) and results reach the tracker."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from tests.conftest import only, run_cli, run_dirs


def _scalars(folder: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.slow
def test_tensorboard_logger_records_pretrain_value_grpo_and_results(tmp_path):
    done = run_cli(
        [
            "experiment=smoke",
            *only("QSharp", "GRPO"),
            "logger=tensorboard",
            "executor.progress=false",
            "pretrain.steps=30",
        ],
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    run = run_dirs(tmp_path, "smoke")[0]
    tb = run / "logs" / "tensorboard"
    pretrain = _scalars(tb / "pretrain.goal_walk.tiny")
    assert (
        len(pretrain["train/loss"]) == 30
        and "train/lr" in pretrain
        and "perf/step_time_s" in pretrain
    )
    value = _scalars(tb / "QSharp.goal_walk.tiny.r0.train")
    assert len(value["train/loss"]) == 20 and "train/accuracy" in value
    grpo = _scalars(tb / "GRPO.goal_walk.tiny.r0.train")  # through TRL's report_to
    assert grpo["train/reward"] and grpo["train/kl"] and grpo["train/loss"]
    results = _scalars(tb / "results")
    assert any(
        t.startswith("results/goal_walk/tiny/QSharp/eta=5/") and t.endswith("/kl") for t in results
    )
    assert "results/goal_walk/tiny/GRPO/avg_reward" in results
    assert (
        run / "results" / "plots" / "frontier_goal_walk.png"
    ).is_file()  # reward–KL of a single run


def test_csv_tracker_rows_and_resume_prunes_the_dead_attempts_steps(tmp_path):
    from pita.training.loop import TrainingMetrics
    from pita.training.tracking import CsvTracker

    path = tmp_path / "task.csv"
    metrics = TrainingMetrics("cpu", tracker=CsvTracker(path))
    for step in range(1, 6):
        metrics.record(step=step, loss=1.0 / step, step_time_s=0.1)
    metrics.close_tracker()
    rows = list(csv.DictReader(open(path)))
    assert [float(r["step"]) for r in rows] == [1, 2, 3, 4, 5]
    assert float(rows[1]["train/loss"]) == 0.5 and "perf/step_time_s" in rows[0]
    resumed = CsvTracker(path)
    resumed.start_step = 3  # a retry resumed from the step-3 checkpoint
    resumed.log({"train/loss": 9.0}, 4)
    rows = list(csv.DictReader(open(path)))
    assert [float(r["step"]) for r in rows] == [1, 2, 3, 4] and float(rows[-1]["train/loss"]) == 9.0


@pytest.mark.parametrize("backend", ["wandb", "mlflow"])
def test_missing_tracker_package_is_a_config_error_naming_the_pip_install(tmp_path, backend):
    from pita.training.tracking import missing_package

    if missing_package(backend) is None:
        pytest.skip(f"{backend} is installed")
    done = run_cli(["logger=" + backend, "dry_run=true"], cwd=tmp_path)
    assert done.returncode == 2
    assert (
        f"error: logger={backend}: the {backend} package is not installed; pip install {backend}"
        in done.stderr
    )
    assert not (tmp_path / "outputs").exists()


def test_unknown_logger_lists_the_options(tmp_path):
    done = run_cli(["logger=tensorbord", "dry_run=true"], cwd=tmp_path)
    assert done.returncode == 2
    assert (
        "logger=tensorbord: no such logger config; available: csv, mlflow, none, tensorboard, wandb"
        in done.stderr
    )
