"""Experiment tracking: the `logger` config group (conf/logger/*.yaml).

`logger.backend` picks where the metrics of every training step and the final results go:

- `none` (default): nothing beyond the task folder's own files.
- `tensorboard`: event files under `<run>/logs/tensorboard/<task id>/` (a task's retry
  purges the steps after its checkpoint, so a resumed curve has no overlap);
  `tensorboard --logdir outputs/<name>/<timestamp>/logs/tensorboard`.
- `wandb`: one W&B run per task, grouped by run folder, `mode=offline` unless
  `logger.mode=online` (`wandb sync <run>/logs/wandb/...` uploads later).
- `mlflow`: one MLflow run per task in the experiment `experiment.name`; the tracking URI
  is `logger.tracking_uri`, else a file store at `<run>/logs/mlruns`.
- `csv`: `<run>/logs/csv/<task id>.csv`, one row per logged step (any spreadsheet).

The hand-written loops (pretrain, value training) log through `TrainingMetrics` (every
optimizer step: loss, accuracy, lr, grad norm, step time); TRL stages get the same
backend through TRL's own `report_to` (so GRPO's `reward`, `kl`, ... arrive as TRL logs
them), except `csv`, which TRL lacks and `trl_callback` provides. The report step logs
the results table (`results/<algo>/<dataset>/<family>/<metric>` against η).

wandb and mlflow are optional packages: `missing_package(backend)` names the pip install
and config validation reports it before anything starts.
"""

from __future__ import annotations

import csv
import importlib.util
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pita.core.schema import LOGGER_BACKENDS as BACKENDS

_PACKAGES = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
}


def missing_package(backend: str) -> str | None:
    """The `pip install` line a backend still needs, or None when it is importable."""
    if backend not in _PACKAGES:
        return None
    module, package = _PACKAGES[backend]
    if importlib.util.find_spec(module) is None:
        return f"pip install {package}"
    return None


def logger_cfg(cfg: Any) -> Mapping:
    """`cfg.logger` as a plain mapping (configs built without the group: backend none)."""
    node = cfg.get("logger") if hasattr(cfg, "get") else None
    if node is None:
        return {"backend": "none"}
    if hasattr(node, "items"):
        return {k: v for k, v in node.items()}
    return dict(node)


def log_dir(run_dir: str | Path, backend: str) -> Path:
    from pita.core.paths import RunPaths

    return RunPaths(run_dir).logs / backend


class Tracker:
    """Backend `none`: accepts everything, writes nothing."""

    backend = "none"

    def __init__(self) -> None:
        self.start_step = 0  # a resumed task: steps after this one of a dead attempt are dropped

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        pass

    def close(self) -> None:
        pass


def _numeric(metrics: Mapping[str, Any]) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"
    }


class TensorBoardTracker(Tracker):
    backend = "tensorboard"

    def __init__(self, folder: Path):
        super().__init__()
        self.folder = folder
        self._writer = None

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        if self._writer is None:  # opened lazily: a resumed task knows its start step by now
            from torch.utils.tensorboard import SummaryWriter

            self.folder.mkdir(parents=True, exist_ok=True)
            self._writer = SummaryWriter(str(self.folder), purge_step=self.start_step or None)
        for key, value in _numeric(metrics).items():
            self._writer.add_scalar(key, value, step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None


class CsvTracker(Tracker):
    """One CSV per task; columns grow as new keys appear (the file is rewritten then)."""

    backend = "csv"

    def __init__(self, path: Path):
        super().__init__()
        self.path = path
        self.rows: list[dict[str, float]] = []
        self._pruned = False

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        if not self._pruned:  # a resumed task: keep the dead attempt's rows up to the checkpoint
            self._pruned = True
            if self.path.is_file():
                with open(self.path, newline="") as f:
                    self.rows = [
                        {k: float(v) for k, v in r.items() if v != ""}
                        for r in csv.DictReader(f)
                        if float(r["step"]) <= self.start_step
                    ]
        self.rows.append({"step": float(step), **_numeric(metrics)})
        self._write()

    def _write(self) -> None:
        from pita.core.paths import atomic_write_text

        columns = ["step"] + sorted({k for r in self.rows for k in r} - {"step"})
        lines = [",".join(columns)]
        lines += [
            ",".join("" if r.get(c) is None else repr(r[c]) for c in columns) for r in self.rows
        ]
        atomic_write_text(self.path, "\n".join(lines) + "\n")


class WandbTracker(Tracker):
    backend = "wandb"

    def __init__(self, folder: Path, name: str, group: str, cfg: Mapping):
        super().__init__()
        import wandb

        folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=str(cfg.get("project") or "pita"),
            name=name,
            group=group,
            dir=str(folder),
            mode=str(cfg.get("mode") or "offline"),
            reinit="create_new",
        )

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        self.run.log(_numeric(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker(Tracker):
    backend = "mlflow"

    def __init__(self, uri: str, experiment: str, name: str):
        super().__init__()
        import mlflow

        self.client = mlflow.tracking.MlflowClient(tracking_uri=uri)
        found = self.client.get_experiment_by_name(experiment)
        exp_id = found.experiment_id if found else self.client.create_experiment(experiment)
        self.run_id = self.client.create_run(exp_id, run_name=name).info.run_id

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        for key, value in _numeric(metrics).items():
            self.client.log_metric(self.run_id, key.replace("@", "_at_"), value, step=step)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def mlflow_uri(cfg: Mapping, run_dir: str | Path) -> str:
    return str(cfg.get("tracking_uri") or (log_dir(run_dir, "mlruns").resolve().as_uri()))


def open_tracker(cfg: Any, run_dir: str | Path, name: str) -> Tracker:
    """The tracker of one task (or of the run's results, `name="results"`)."""
    lcfg = logger_cfg(cfg)
    backend = str(lcfg.get("backend") or "none")
    if backend == "none":
        return Tracker()
    need = missing_package(backend)
    if need:
        raise RuntimeError(f"logger.backend={backend}: the package is not installed; {need}")
    if backend == "tensorboard":
        return TensorBoardTracker(log_dir(run_dir, backend) / name)
    if backend == "csv":
        return CsvTracker(log_dir(run_dir, backend) / f"{name}.csv")
    experiment = str(cfg.experiment.name) if hasattr(cfg, "experiment") else "pita"
    if backend == "wandb":
        return WandbTracker(
            log_dir(run_dir, backend), name, group=f"{experiment}/{Path(run_dir).name}", cfg=lcfg
        )
    if backend == "mlflow":
        return MlflowTracker(mlflow_uri(lcfg, run_dir), experiment, name)
    raise ValueError(f"logger.backend={backend!r}: allowed: {' | '.join(BACKENDS)}")


# --- TRL / transformers Trainer -------------------------------------------------------------


def trl_report_to(
    cfg: Any, run_dir: str | Path, name: str
) -> tuple[list[str] | str, dict[str, str]]:
    """(`report_to` for a TRL config, environment variables the integration reads) of the
    run config `cfg`'s `logger` group, for the task `name` of the run in `run_dir`.

    TensorBoard writes where `open_tracker` would (`TENSORBOARD_LOGGING_DIR`), W&B offline
    unless `logger.mode=online`, MLflow into the run's file store; `csv` is not a TRL
    integration: `trl_callback` writes it instead.
    """
    lcfg = logger_cfg(cfg)
    backend = str(lcfg.get("backend") or "none")
    if backend in ("none", "csv"):
        return "none", {}
    need = missing_package(backend)
    if need:
        raise RuntimeError(f"logger.backend={backend}: the package is not installed; {need}")
    experiment = str(cfg.experiment.name)
    if backend == "tensorboard":
        return ["tensorboard"], {"TENSORBOARD_LOGGING_DIR": str(log_dir(run_dir, backend) / name)}
    if backend == "wandb":
        folder = log_dir(run_dir, backend)
        folder.mkdir(parents=True, exist_ok=True)
        return ["wandb"], {
            "WANDB_MODE": str(lcfg.get("mode") or "offline"),
            "WANDB_DIR": str(folder),
            "WANDB_PROJECT": str(lcfg.get("project") or "pita"),
            "WANDB_RUN_GROUP": f"{experiment}/{Path(run_dir).name}",
            "WANDB_NAME": name,
        }
    return ["mlflow"], {
        "MLFLOW_TRACKING_URI": mlflow_uri(lcfg, run_dir),
        "MLFLOW_EXPERIMENT_NAME": experiment,
        "MLFLOW_RUN_NAME": name,
    }


class scoped_env:
    """Set environment variables for a block (the worker runs one task at a time)."""

    def __init__(self, env: Mapping[str, str]):
        self.env, self.saved = dict(env), {}

    def __enter__(self) -> scoped_env:
        for key, value in self.env.items():
            self.saved[key] = os.environ.get(key)
            os.environ[key] = value
        return self

    def __exit__(self, *exc: Any) -> None:
        for key, value in self.saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def trl_callback(tracker: Tracker):
    """A TrainerCallback forwarding every numeric log of a Trainer to `tracker` (csv)."""
    from transformers import TrainerCallback

    class TrackerCallback(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs:
                tracker.log({f"train/{k}": v for k, v in logs.items()}, state.global_step)

        def on_train_end(self, args, state, control, **kwargs):
            tracker.close()

    return TrackerCallback()
