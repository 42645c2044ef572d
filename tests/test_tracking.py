"""logger=<backend>: training metrics (loss, reward, KL) and results reach the tracker."""

from __future__ import annotations

import csv
import importlib.util
import os
from concurrent.futures import Future
from pathlib import Path

import pytest

from tests.conftest import only, run_cli, run_cli_later, run_dirs

SMOKE = [  # a pita-native training (pretrain, Q# value model) and a TRL one (GRPO), results
    "experiment=smoke",
    *only("QSharp", "GRPO"),
    "executor.progress=false",
    "pretrain.steps=30",
    "logger.tags=[smoke_test,ci]",
    "executor.cpu_workers=1",  # one worker importing torch (and the tracker), not one per core
    "dataset.test_size=8",  # what is read back is that results are tracked, not their size
    "data_collection.max_examples=16",
]


def _scalars(folder: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _tensorboard(run: Path) -> dict[str, dict[str, list[float]]]:
    """{task: {tag: values}} of the event files, checking the hparams and tags each holds."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = {}
    for folder in sorted((run / "logs" / "tensorboard").iterdir()):
        acc = EventAccumulator(str(folder))
        acc.Reload()
        assert "_hparams_/session_start_info" in acc.PluginTagToContent("hparams"), folder
        assert "tags/text_summary" in acc.Tags()["tensors"], folder  # logger.tags
        out[folder.name] = {t: [e.value for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
    return out


def _wandb_records(path: Path):
    from pita.training.wandb_log import records

    return records(path)


def _wandb(run: Path) -> dict[str, dict[str, list[float]]]:
    """{run name: {key: values}} of the offline W&B runs, checking one per tracker."""
    import json

    from pita.training.tracking import wandb_run_id

    out = {}
    runs = sorted((run / "logs" / "wandb" / "wandb").glob("offline-run-*"))
    for folder in runs:
        (path,) = folder.glob("run-*.wandb")
        name, history = None, {}
        for record in _wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                name = record.run.display_name
                assert record.run.run_group == f"smoke/{run.name}"
                assert list(record.run.tags) == ["smoke_test", "ci"]
                assert {u.key for u in record.run.config.update} >= {"training", "logger"}
            elif kind == "history":
                for item in record.history.item:
                    key = item.key or "/".join(item.nested_key)
                    history.setdefault(key, []).append(json.loads(item.value_json))
        assert name not in out, f"two W&B runs named {name}"
        assert folder.name.endswith(f"-{wandb_run_id(run, name)}")  # every attempt: one run id
        out[name] = history
    assert len(out) == len(runs)
    return out


def _mlflow(run: Path) -> dict[str, dict[str, list[float]]]:
    """{run name: {key: values}} read back with `MlflowClient` from the sqlite store shared
    by every run under outputs/."""
    import mlflow

    store = run.parents[1] / "mlflow"  # outputs/<name>/<timestamp> -> outputs/mlflow
    client = mlflow.MlflowClient(f"sqlite:///{store / 'mlflow.db'}")
    exp = client.get_experiment_by_name("smoke")
    assert exp.artifact_location.startswith(store.resolve().as_uri())
    out = {}
    for r in client.search_runs([exp.experiment_id]):
        assert r.info.status == "FINISHED" and r.data.tags["ci"] == "true"
        assert (
            r.data.params["logger.backend"] == "mlflow"
            and "training.max_grad_norm" in r.data.params
        )
        assert r.info.run_name not in out, f"two MLflow runs named {r.info.run_name}"
        out[r.info.run_name] = {
            k: [m.value for m in client.get_metric_history(r.info.run_id, k)]
            for k in r.data.metrics
        }
    return out


READ_BACK = {"tensorboard": _tensorboard, "wandb": _wandb, "mlflow": _mlflow}


# The session's smoke run (tests/conftest.py SMOKE_ARGS) runs under tensorboard; these
# two get a smaller run of their own each.
BACKENDS = ["wandb", "mlflow"]


@pytest.fixture(scope="module")
def logger_runs(tmp_path_factory) -> dict[str, tuple[Path, Future]]:
    """The smoke run under each installed backend, all started together (a run keeps about
    one core busy): {backend: (cwd, the finished run's future)}. No W&B API key reaches
    them, and WANDB_MODE=online is exported to the W&B one (logger.mode=offline wins)."""
    runs = {}
    for backend in BACKENDS:
        if importlib.util.find_spec(backend) is None:
            continue
        cwd = tmp_path_factory.mktemp(f"logger_{backend}")
        env = {"WANDB_API_KEY": None, **({"WANDB_MODE": "online"} if backend == "wandb" else {})}
        runs[backend] = (
            cwd,
            run_cli_later([*SMOKE, f"logger={backend}"], cwd, env=env, timeout=600),
        )
    return runs


def _check_tracked(run: Path, args: list[str], backend: str, exactly: bool) -> None:
    """No tracker warning in the run's logs; one tracked run per trained task (all of them
    when `exactly`, else at least pretrain, Q#'s value model and GRPO) and one for the
    results, each read back through the backend's own reader: every pretrain and value-
    training step (counts from the run's composed config), TRL's GRPO logs, the results."""
    from pita.experiment.cli import compose_config
    from pita.experiment.cli_extras import expand_algos
    from pita.experiment.config import ALGO_NAMES

    cfg = compose_config(expand_algos(args, ALGO_NAMES))  # `algos=[..]` as the CLI reads it
    logs = (run / "run.log").read_text() + "".join(
        p.read_text() for p in run.glob("tasks/*/log.txt")
    )
    assert f"logger.backend={backend}" not in logs  # no tracker WARNING anywhere
    tracked = READ_BACK[backend](run)
    expected = {
        "pretrain.goal_walk.tiny",
        "QSharp.goal_walk.tiny.r0.train",
        "GRPO.goal_walk.tiny.r0.train",
        "results",
    }
    assert set(tracked) == expected if exactly else expected <= set(tracked), sorted(tracked)
    pretrain = tracked["pretrain.goal_walk.tiny"]
    assert len(pretrain["train/loss"]) == cfg.pretrain.steps and "train/lr" in pretrain
    assert "perf/step_time_s" in pretrain
    value = tracked["QSharp.goal_walk.tiny.r0.train"]
    assert len(value["train/loss"]) == cfg.algos.QSharp.steps and "train/accuracy" in value
    grpo = tracked["GRPO.goal_walk.tiny.r0.train"]  # TRL's logs, through the task's tracker
    assert grpo["train/reward"] and grpo["train/kl"] and grpo["train/loss"]
    results = tracked["results"]
    assert "results/goal_walk/tiny/QSharp/top-2_T_1/eta_5/kl" in results
    assert "results/goal_walk/tiny/GRPO/full_T_1/pass_at_1" in results
    assert (run / "results" / "plots" / "frontier_goal_walk.png").is_file()


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_smoke_under_each_logger_reads_pretrain_value_grpo_and_results_back(logger_runs, backend):
    """`experiment=smoke` (Q# and GRPO) under W&B and MLflow, with the current releases: no
    failed task, one tracked run per task (W&B offline with no API key, even with
    WANDB_MODE=online exported; MLflow 3 on the run's own sqlite store), each with the
    config and the tags, and every training step and result read back through the
    backend's own reader."""
    pytest.importorskip(backend)
    cwd, future = logger_runs[backend]
    done = future.result()
    assert done.returncode == 0, done.stderr[-2000:]
    _check_tracked(run_dirs(cwd, "smoke")[0], [*SMOKE, f"logger={backend}"], backend, True)


@pytest.mark.slow
def test_the_smoke_run_under_tensorboard_reads_pretrain_value_grpo_and_results_back(smoke_run):
    """The session's smoke run (every algorithm, logger=tensorboard, tests/conftest.py):
    the event files of every trained task hold the hparams, the tags and every step."""
    pytest.importorskip("tensorboard")
    _check_tracked(smoke_run.run_dir, smoke_run.args, "tensorboard", False)


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
    resumed.close()
    rows = list(csv.DictReader(open(path)))
    assert [float(r["step"]) for r in rows] == [1, 2, 3, 4] and float(rows[-1]["train/loss"]) == 9.0


def test_csv_tracker_appends_each_step_and_rewrites_only_for_a_new_column(tmp_path):
    """Issue 28: each step appends one line to the same file (no rewrite: quadratic over a
    long training); a new key widens the header once; a torn last row (a killed worker) is
    dropped by the retry."""

    from pita.training.tracking import CsvTracker

    path = tmp_path / "task.csv"
    tracker = CsvTracker(path)
    tracker.log({"train/loss": 1.0}, 1)
    inode, sizes = os.stat(path).st_ino, []
    for step in range(2, 40):
        tracker.log({"train/loss": 1.0 / step}, step)
        assert os.stat(path).st_ino == inode  # the same file, appended to
        sizes.append(path.stat().st_size)
    assert sizes == sorted(set(sizes))  # grows by one row each step
    tracker.log({"train/loss": 0.1, "eval/acc": 0.5}, 40)  # a new column: one rewrite
    tracker.log({"train/loss": 0.1, "eval/acc": 0.6}, 41)
    tracker.close()
    rows = list(csv.DictReader(open(path)))
    assert [float(r["step"]) for r in rows] == list(range(1, 42))
    assert rows[0]["eval/acc"] == "" and float(rows[-1]["eval/acc"]) == 0.6
    with open(path, "a") as f:
        f.write("42,0.")  # killed mid-row
    retry = CsvTracker(path)
    retry.start_step = 41
    retry.log({"train/loss": 0.05, "eval/acc": 0.7}, 42)
    retry.close()
    rows = list(csv.DictReader(open(path)))
    assert [float(r["step"]) for r in rows] == list(range(1, 43))


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


def test_unknown_logger_lists_the_options(tmp_path, capsys, monkeypatch):
    from pita.experiment import cli

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["logger=tensorbord", "dry_run=true"])
    assert exit_info.value.code == 2
    assert (
        "logger=tensorbord: no such logger config; available: csv, mlflow, none, tensorboard, wandb"
        in capsys.readouterr().err
    )


def test_metric_names_are_legal_everywhere_and_result_tags_keep_rows_apart():
    """One sanitizer for every backend (MLflow refuses `eta=0` and `pass@1`); the results'
    tags carry every column that tells rows apart: two reference rows differ only by their
    sampling rule and must not share a curve."""
    from pita.results.report import RESULT_METRICS, result_tag
    from pita.training.tracking import metric_name

    assert metric_name("eta=0") == "eta_0" and metric_name("pass@1") == "pass_at_1"
    assert metric_name("top-2, T=1") == "top-2_T_1" and metric_name("train/loss") == "train/loss"
    row = {"dataset": "goal_walk", "family": "tiny", "algo": "reference", "round": 0, "eta": 0.0}
    full, top2 = {**row, "sampling": "full, T=1"}, {**row, "sampling": "top-2, T=1"}
    tags = [result_tag(r, m) for r in (full, top2) for m in RESULT_METRICS]
    assert len(set(tags)) == len(tags) == 2 * len(RESULT_METRICS)
    assert (
        result_tag(top2, "pass@1") == "results/goal_walk/tiny/reference/top-2_T_1/eta_0/pass_at_1"
    )
    assert result_tag({**full, "eta": None}, "kl") == "results/goal_walk/tiny/reference/full_T_1/kl"
    validation = pytest.importorskip("mlflow.utils.validation")
    for tag in tags:  # the strictest backend accepts every one
        validation._validate_metric_name(tag)


def test_config_is_flattened_into_params_every_backend_takes():
    from pita.training.tracking import PARAM_VALUE_CHARS, flat_params

    params = flat_params(
        {"training": {"lr": 0.1, "on": True, "x": None}, "tags": ["a"], "s": "y" * 999}
    )
    assert params["training.lr"] == 0.1 and params["training.on"] == "True"
    assert params["training.x"] == "None" and params["tags"] == "['a']"
    assert len(params["s"]) == PARAM_VALUE_CHARS and params["s"].endswith("...")


def test_a_failing_tracker_is_one_warning_never_an_exception(tmp_path, caplog):
    """A tracker that cannot open (a bad MLflow URI) or log (a backend raising) costs the
    task nothing: one WARNING naming the backend, then silence."""
    import importlib.util
    import logging

    from omegaconf import OmegaConf

    from pita.training.tracking import SafeTracker, Tracker, open_tracker

    class Broken(Tracker):
        backend = "broken"

        def log(self, metrics, step):
            raise OSError("disk full")

        def close(self):
            raise OSError("disk full")

    log = logging.getLogger("pita.task.test")
    has_mlflow = importlib.util.find_spec("mlflow") is not None
    with caplog.at_level(logging.WARNING, logger="pita.task.test"):
        tracker = SafeTracker(Broken(), log)
        tracker.start_step = 3
        for step in range(3):
            tracker.log({"train/loss": 1.0}, step)
        tracker.close()
        assert tracker.inner.start_step == 3
        if has_mlflow:
            cfg = OmegaConf.create(
                {
                    "experiment": {"name": "t"},
                    "logger": {"backend": "mlflow", "tracking_uri": "nosuchscheme://x"},
                }
            )
            bad = open_tracker(cfg, tmp_path, "task", logger=log)
            bad.log({"train/loss": 1.0}, 1)
            bad.close()
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 + has_mlflow, warnings
    assert (
        warnings[0].startswith("logger.backend=broken: log failed") and "disk full" in warnings[0]
    )
    assert not has_mlflow or warnings[1].startswith("logger.backend=mlflow: open failed")


def test_wandb_online_without_a_key_is_a_warning_not_a_prompt(tmp_path, monkeypatch, caplog):
    """`logger.mode=online` with no API key anywhere: one WARNING naming what is missing
    (a worker must never block on wandb's interactive login)."""
    import logging

    from omegaconf import OmegaConf

    from pita.training.tracking import open_tracker

    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    cfg = OmegaConf.create(
        {"experiment": {"name": "t"}, "logger": {"backend": "wandb", "mode": "online"}}
    )
    with caplog.at_level(logging.WARNING, logger="pita.task.test"):
        tracker = open_tracker(cfg, tmp_path, "task", logger=logging.getLogger("pita.task.test"))
        tracker.log({"train/loss": 1.0}, 1)
        tracker.close()
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "logger.backend=wandb: open failed" in warning and "needs a W&B API key" in warning


def test_mlflow_retry_reopens_the_tasks_run_in_the_runs_sqlite_store(tmp_path):
    """A retried task (a second `open_tracker` of one name) logs into its first MLflow run:
    one run per task, params logged once, metrics of both attempts, in
    `<run>/logs/mlflow/mlflow.db` with the artifacts beside it."""
    mlflow = pytest.importorskip("mlflow")
    from omegaconf import OmegaConf

    from pita.training.tracking import logger_cfg, mlflow_uri, open_tracker

    cfg = OmegaConf.create(
        {"experiment": {"name": "t"}, "logger": {"backend": "mlflow", "tags": ["x y"]}}
    )
    for attempt in range(2):
        tracker = open_tracker(cfg, tmp_path, "task")
        tracker.log({"train/loss": 1.0, "eval@k": 2.0}, attempt + 1)
        tracker.close()
        assert not tracker.failed
    uri = mlflow_uri(logger_cfg(cfg), tmp_path)
    assert uri == f"sqlite:///{tmp_path.resolve()}/logs/mlflow/mlflow.db"
    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name("t")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_name == "task" and run.info.status == "FINISHED"
    assert run.data.params["logger.backend"] == "mlflow" and run.data.tags["x_y"] == "true"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in history] == [1, 2] and "eval_at_k" in run.data.metrics
    assert exp.artifact_location == (tmp_path / "logs" / "mlflow" / "artifacts").resolve().as_uri()


def test_mlflow_default_store_is_shared_by_every_run_under_outputs(tmp_path):
    """Issue 28: `logger=mlflow` without a tracking_uri writes every run under `outputs/`
    (single runs and sweep jobs) into one store, `outputs/mlflow/mlflow.db` behind one
    lock, so `mlflow ui` compares them; a task's retry still reopens its own run's MLflow
    run, never another run's task of the same name."""
    mlflow = pytest.importorskip("mlflow")
    from omegaconf import OmegaConf

    from pita.training.tracking import logger_cfg, mlflow_uri, open_tracker

    cfg = OmegaConf.create({"experiment": {"name": "t"}, "logger": {"backend": "mlflow"}})
    outputs = tmp_path / "outputs"
    runs = [outputs / "t" / "ts1", outputs / "t" / "ts2", outputs / "t" / "multirun" / "ts3" / "0"]
    for i, run in enumerate([*runs, runs[0]]):  # the last: a retry in the first run
        assert mlflow_uri(logger_cfg(cfg), run) == f"sqlite:///{outputs.resolve()}/mlflow/mlflow.db"
        tracker = open_tracker(cfg, run, "task")
        tracker.log({"train/loss": float(i)}, i)
        tracker.close()
        assert not tracker.failed
    assert not any((run / "logs").exists() for run in runs)
    assert (outputs / "mlflow" / "mlflow.lock").is_file()
    client = mlflow.MlflowClient(mlflow_uri(logger_cfg(cfg), runs[0]))
    exp = client.get_experiment_by_name("t")
    found = client.search_runs([exp.experiment_id])
    by_run = {r.data.tags["pita.run"]: r for r in found}
    assert len(found) == 3 and set(by_run) == {str(r.resolve()) for r in runs}
    steps = {
        run: [
            m.step
            for m in client.get_metric_history(by_run[str(run.resolve())].info.run_id, "train/loss")
        ]
        for run in runs
    }
    assert steps == {runs[0]: [0, 3], runs[1]: [1], runs[2]: [2]}


KILLED_ATTEMPT = """
import sys, time
from pathlib import Path
from omegaconf import OmegaConf
from pita.training.tracking import open_tracker
cfg = OmegaConf.create({"experiment": {"name": "t"}, "logger": {"backend": "wandb"}})
tracker = open_tracker(cfg, Path(sys.argv[1]), "task")
tracker.start_step = 5
for step in range(6, 9):
    tracker.log({"train/loss": 1.0 / step}, step)
print("logged", flush=True)
time.sleep(600)
"""


def test_wandb_offline_folders_of_a_retried_task_sync_as_one_run(tmp_path, monkeypatch):
    """Issue 28: a task's first attempt logs steps 1-7 and fails (an OOM: its tracker
    closes); the second resumes from the step-5 checkpoint, logs 6-8 and is SIGKILLed
    before wandb wrote anything; the third resumes from step 5 again and trains 6-10.
    The offline folders must replay (`wandb sync`, in start-time order) into one run: the
    same run id and name in each, and steps that only go up from one folder to the next
    (W&B drops a step at or below the run's last one), with nothing lost that was not
    already on disk: 1-7 from the first attempt, 8-10 from the third."""
    import signal
    import subprocess
    import sys
    import time

    pytest.importorskip("wandb")
    from omegaconf import OmegaConf

    from pita.core.gpu_manager import GPUManager
    from pita.training.tracking import open_tracker, wandb_run_id
    from pita.training.wandb_log import history_steps, records
    from tests.conftest import ROOT

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    run = tmp_path / "outputs" / "t" / "ts"
    cfg = OmegaConf.create({"experiment": {"name": "t"}, "logger": {"backend": "wandb"}})

    def attempt(start: int, stop: int) -> None:
        tracker = open_tracker(cfg, run, "task")
        tracker.start_step = start - 1
        for step in range(start, stop + 1):
            tracker.log({"train/loss": 1.0 / step}, step)
        tracker.close()
        assert not tracker.failed
        time.sleep(1.1)  # a folder's name holds its start second: a real retry takes longer

    attempt(1, 7)
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_ATTEMPT, str(run)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,  # a worker's environment: this process's W&B service is not inherited
        env={**GPUManager("cpu").worker_env([0]), "PYTHONPATH": str(ROOT)},
    )
    try:
        assert child.stdout.readline().strip() == "logged"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    time.sleep(1.1)
    attempt(6, 10)
    folders = sorted((run / "logs" / "wandb" / "wandb").glob("offline-run-*"))  # start order
    assert len(folders) == 3
    run_id = wandb_run_id(run, "task")
    steps = []
    for folder in folders:
        (path,) = folder.glob(f"run-{run_id}.wandb")
        runs = {
            (r.run.run_id, r.run.display_name)
            for r in records(path)
            if r.WhichOneof("record_type") == "run"
        }
        assert runs <= {(run_id, "task")}, runs
        steps.append(history_steps(path))
    assert steps[0] == list(range(1, 8)) and steps[1] == [], (
        folders,
        steps,
    )  # the kill lost its steps
    assert steps[2] == [8, 9, 10]  # 6-7 were on disk already; 8 was not


def test_help_says_where_the_default_mlflow_store_is(tmp_path):
    """issue 45: `--help` (the schema's help of logger.tracking_uri) names the store
    `mlflow_folder` really picks: outputs/mlflow/ for a run under outputs/, the run's own
    logs/mlflow/ only outside it."""
    import dataclasses

    from pita.core.schema import LoggerConfig
    from pita.training.tracking import mlflow_folder

    (field,) = [f for f in dataclasses.fields(LoggerConfig) if f.name == "tracking_uri"]
    help_text = field.metadata["help"]
    run = tmp_path / "outputs" / "goal_walk" / "2026-01-01_00-00-00"
    assert mlflow_folder(run) == (tmp_path / "outputs" / "mlflow").resolve()
    assert "outputs/mlflow/mlflow.db" in help_text
    assert (
        mlflow_folder(tmp_path / "elsewhere")
        == (tmp_path / "elsewhere").resolve() / "logs" / "mlflow"
    )
    assert "<run>/logs/mlflow/" in help_text
