"""Experiment tracking: the `logger` config group (conf/logger/*.yaml).

`logger.backend` picks where the metrics of every training step and the final results go:

- `none` (default): nothing beyond the task folder's own files.
- `tensorboard`: event files under `<run>/logs/tensorboard/<task id>/` (a task's retry
  purges the steps after its checkpoint, so a resumed curve has no overlap);
  `tensorboard --logdir outputs/<name>/<timestamp>/logs/tensorboard`.
- `wandb`: exactly one W&B run per task (`name=<task id>`, `group=<experiment>/<run
  folder>`), `mode=offline` unless `logger.mode=online`: no API key, never a prompt
  (`wandb sync <run>/logs/wandb/wandb/offline-run-*` uploads later; a retried task's
  folders share its run id and disjoint steps, so they sync as one run).
- `mlflow`: one MLflow run per task in the experiment `experiment.name`; the tracking URI
  is `logger.tracking_uri`, else one sqlite store `outputs/mlflow/mlflow.db` for every run
  under the outputs folder (one file lock; artifacts in `outputs/mlflow/artifacts`; MLflow 3
  refuses a plain file store), so `mlflow ui` compares runs; each task's run is tagged
  with its run folder and group.
- `csv`: `<run>/logs/csv/<task id>.csv`, one row per logged step, appended (any spreadsheet).

The hand-written loops (pretrain, value training) log through `TrainingMetrics` (every
optimizer step: loss, accuracy, lr, grad norm, step time); TRL stages open no tracker of
their own (`report_to="none"`: TRL's wandb integration would open a second W&B run, or
log into another task's): `trl_callback` forwards every TRL log (GRPO's `reward`, `kl`,
...) to the task's tracker as `train/<key>`. The report step logs the results table
(`results/<dataset>/<family>/<algo>/<sampling>/eta_<η>/<metric>` against the round).

Every backend gets the same sanitized metric names (`metric_name`: `eta=0` -> `eta_0`,
`pass@1` -> `pass_at_1`), the resolved config as params / hparams (`flat_params`) and
`logger.tags`. A tracker that fails (a missing key, a locked store, a full disk) is one
WARNING in the task log and then silent: tracking never costs a task (`SafeTracker`).

wandb and mlflow are optional packages: `missing_package(backend)` names the pip install
and config validation reports it before anything starts.
"""

from __future__ import annotations

import contextlib
import csv
import functools
import importlib.util
import logging
import os
import re
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pita.core.schema import LOGGER_BACKENDS as BACKENDS
from pita.core.schema import LoggerConfig, settings

_PACKAGES = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
}
PARAM_VALUE_CHARS = 500  # MLflow's historical limit (newer servers take 6000): safe everywhere
PARAM_KEY_CHARS = 250
_log = logging.getLogger(__name__)


def missing_package(backend: str) -> str | None:
    """The `pip install` line a backend still needs, or None when it is importable."""
    if backend not in _PACKAGES:
        return None
    module, package = _PACKAGES[backend]
    if importlib.util.find_spec(module) is None:
        return f"pip install {package}"
    return None


def logger_cfg(cfg: Any) -> LoggerConfig:
    """`cfg.logger` as its typed settings (a config built without the group: the schema's
    defaults, backend none)."""
    node = cfg.get("logger") if hasattr(cfg, "get") else None
    if isinstance(node, LoggerConfig):
        return node
    plain = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node
    return settings(
        LoggerConfig, {str(k): v for k, v in plain.items()} if isinstance(plain, Mapping) else {}
    )


def log_dir(run_dir: str | Path, backend: str) -> Path:
    from pita.core.paths import RunPaths

    return RunPaths(run_dir).logs / backend


# --- names, params, tags: the same in every backend -------------------------------------------

_ILLEGAL = re.compile(r"[^A-Za-z0-9_\-./]+")


@functools.lru_cache(maxsize=4096)  # the same few keys, every optimizer step
def metric_name(key: str) -> str:
    """`key` legal in every backend (and a readable path): MLflow, the strictest, takes
    only letters, digits, `_ - . / : space` and refuses `eta=0`; kept are letters, digits
    and `_ - . /`. `@` becomes `_at_`, any other run of characters one `_` (`eta=0` ->
    `eta_0`, `pass@1` -> `pass_at_1`, `top-2, T=1` -> `top-2_T_1`). Params and tag keys
    go through it too."""
    name = _ILLEGAL.sub("_", str(key).replace("@", "_at_")).strip("_")
    return name[:PARAM_KEY_CHARS] or "_"


def _numeric(metrics: Mapping[str, Any]) -> dict[str, float]:
    return {
        metric_name(k): float(v)
        for k, v in metrics.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"
    }


def config_dict(cfg: Any) -> dict[str, Any]:
    """The run config as plain nested containers, interpolations resolved where they can be
    (a `${hydra:...}` outside a Hydra app stays as written)."""
    from omegaconf import DictConfig, OmegaConf

    if not isinstance(cfg, DictConfig):
        return dict(cfg) if isinstance(cfg, Mapping) else {}
    try:
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    except Exception:  # an interpolation that only resolves inside Hydra
        return OmegaConf.to_container(cfg, resolve=False)  # type: ignore[return-value]


def flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str | int | float]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}`: the params / hparams every backend takes. Lists
    become their string; strings are cut at `PARAM_VALUE_CHARS` (MLflow's limit), keys
    sanitized (`metric_name`); None becomes "None" (TensorBoard's hparams take no None)."""
    out: dict[str, str | int | float] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flat_params(value, f"{name}."))
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            value = str(value)
            if len(value) > PARAM_VALUE_CHARS:
                value = value[: PARAM_VALUE_CHARS - 3] + "..."
        out[metric_name(name)] = value
    return out


def tag_list(lcfg: LoggerConfig) -> list[str]:
    """`logger.tags` as strings (a W&B tag is at most 64 characters)."""
    tags: Any = lcfg.tags
    if isinstance(tags, str):
        tags = [tags]
    return [str(t)[:64] for t in tags if str(t)]


def run_group(run_dir: str | Path, experiment: str) -> str:
    """What groups the tasks of one run: `<experiment>/<run folder>`, and for a sweep's job
    `<experiment>/<sweep folder>/<job>` (its folder name alone, `0`, repeats across sweeps)."""
    run = Path(run_dir).resolve()
    if run.parent.parent.name == "multirun":
        return f"{experiment}/{run.parent.name}/{run.name}"
    return f"{experiment}/{run.name}"


# --- backends ---------------------------------------------------------------------------------


class Tracker:
    """Backend `none`: accepts everything, writes nothing."""

    backend = "none"

    def __init__(self) -> None:
        self.start_step = 0  # a resumed task: steps after this one of a dead attempt are dropped

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardTracker(Tracker):
    backend = "tensorboard"

    def __init__(
        self, folder: Path, params: Mapping[str, Any] | None = None, tags: list[str] | None = None
    ):
        super().__init__()
        self.folder = folder
        self.params = dict(params or {})
        self.tags = list(tags or [])
        self._writer: Any = None  # torch's SummaryWriter, opened by the first log

    def _open(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.folder.mkdir(parents=True, exist_ok=True)
        self._writer = SummaryWriter(str(self.folder), purge_step=self.start_step or None)
        if self.params:  # the HPARAMS tab, in this run's own event file (not a sub-run)
            from torch.utils.tensorboard.summary import hparams

            for summary in hparams(self.params, {}):
                self._writer.file_writer.add_summary(summary)
        if self.tags:
            self._writer.add_text("tags", ", ".join(self.tags), 0)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        if self._writer is None:  # opened lazily: a resumed task knows its start step by now
            self._open()
        for key, value in _numeric(metrics).items():
            self._writer.add_scalar(key, value, step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None


class CsvTracker(Tracker):
    """One CSV per task, one row per logged step, *appended* (a long training writes each
    row once, not the whole file per step). Only when a new key appears is the file
    rewritten with the wider header (atomically; a handful of times per task). A resumed
    task drops the dead attempt's rows after its checkpoint once, at its first step; a
    half-written last row of a killed attempt is dropped then too."""

    backend = "csv"

    def __init__(self, path: Path):
        super().__init__()
        self.path = path
        self.columns: list[str] = []
        self._file: Any = None

    def _read(self) -> list[dict[str, float]]:
        """The rows on disk with a whole, numeric step (a torn last line is left out)."""
        if not self.path.is_file():
            return []
        rows = []
        with open(self.path, newline="") as f:
            for r in csv.DictReader(f):
                try:
                    rows.append({k: float(v) for k, v in r.items() if k and v not in ("", None)})
                except ValueError:
                    continue
        return [r for r in rows if "step" in r]

    def _rewrite(self, rows: list[dict[str, float]]) -> None:
        from pita.core.paths import atomic_write_text

        if self._file is not None:
            self._file.close()
        lines = [",".join(self.columns)] + [self._line(r) for r in rows]
        atomic_write_text(self.path, "\n".join(lines) + "\n")
        self._file = open(self.path, "a")

    def _line(self, row: Mapping[str, float]) -> str:
        return ",".join("" if row.get(c) is None else repr(row[c]) for c in self.columns)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        row = {"step": float(step), **_numeric(metrics)}
        if self._file is None:  # first step: keep the earlier attempts' rows up to the checkpoint
            kept = [r for r in self._read() if r["step"] <= self.start_step]
            self.columns = ["step"] + sorted({k for r in kept + [row] for k in r} - {"step"})
            self._rewrite(kept)
        elif set(row) - set(self.columns):  # a new key: the one case that rewrites
            self.columns = ["step"] + sorted((set(self.columns) | set(row)) - {"step"})
            self._file.flush()
            self._rewrite(self._read())
        self._file.write(self._line(row) + "\n")
        self._file.flush()  # a reader (or a killed worker's retry) sees every whole row

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def wandb_run_id(run_dir: str | Path, name: str) -> str:
    """A W&B run id fixed by (run folder, task): every attempt of a task (a retry, `resume_from`)
    logs to the same W&B run (offline: one `offline-run-*-<id>` folder per attempt, which
    `wandb sync` uploads into that run)."""
    import hashlib

    return hashlib.sha1(f"{Path(run_dir).resolve()}/{name}".encode()).hexdigest()[:16]


class WandbTracker(Tracker):
    """One W&B run. Offline unless `logger.mode=online`: `WANDB_MODE` and the API key are
    never consulted then, so no key is needed and nothing prompts; the console is not
    captured (the worker's log is ours).

    A retried task's attempts log into one run id, offline one `offline-run-*-<id>` folder
    each, which `wandb sync` replays in start-time order into one run. W&B cannot rewrite
    history and drops a step at or below the run's last one, so each attempt starts after
    the earlier attempts' last step: steps the retry re-trains after its checkpoint that a
    dead attempt had already written to its `.wandb` file are skipped
    (`pita.training.wandb_log.last_written_step`)."""

    backend = "wandb"

    def __init__(
        self,
        folder: Path,
        name: str,
        group: str,
        cfg: LoggerConfig,
        config: Mapping[str, Any] | None = None,
        run_id: str | None = None,
    ):
        super().__init__()
        import wandb

        from pita.training.wandb_log import last_written_step

        folder.mkdir(parents=True, exist_ok=True)
        self.written_before = last_written_step(folder, run_id) if run_id else None
        mode = cfg.mode
        if mode == "online" and not wandb.login(prompt=False, verify=False):  # never a prompt
            raise RuntimeError(
                "logger.mode=online needs a W&B API key (`wandb login` or WANDB_API_KEY); "
                "logger.mode=offline needs none"
            )
        with scoped_env({"WANDB_MODE": mode}):  # logger.mode wins over an exported WANDB_MODE
            settings = wandb.Settings(
                console="off", silent=True, disable_git=True, x_disable_stats=True
            )
            self.run = wandb.init(
                project=cfg.project,
                name=name,
                group=group,
                job_type=name.split(".", 1)[0],
                tags=tag_list(cfg),
                config=dict(config or {}),
                dir=str(folder),
                mode=mode,  # type: ignore[arg-type]
                id=run_id,  # a retried task's attempts share the run id
                resume="allow",
                reinit="create_new",  # one run per tracker, never the process's current run
                settings=settings,
            )

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        if self.written_before is not None and step <= self.written_before:
            return  # an earlier attempt of this task wrote it: the synced run keeps that one
        self.run.log(_numeric(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock between the workers writing one sqlite store (no `database is
    locked`, no two workers creating its tables at once)."""
    try:
        import fcntl
    except ImportError:  # Windows: sqlite's own locking only
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class MlflowTracker(Tracker):
    """One MLflow run per task (a retried task reopens its run); params, tags, and the
    metrics in batches (at most every 5 s, and at `close`)."""

    backend = "mlflow"

    def __init__(
        self,
        uri: str,
        experiment: str,
        name: str,
        *,
        artifacts: str | None = None,
        lock: Path | None = None,
        params: Mapping[str, Any] | None = None,
        tags: Mapping[str, str] | None = None,
    ):
        super().__init__()
        import mlflow

        self.lock = lock
        self._pending: list[Any] = []
        self._flushed = 0.0  # the first step goes out at once: the run shows up
        self.client = mlflow.MlflowClient(tracking_uri=uri)
        with self._locked():
            self.run_id = self._run(experiment, name, artifacts, dict(tags or {}))
            self._log_params(dict(params or {}))

    def _locked(self):
        return _file_lock(self.lock) if self.lock else contextlib.nullcontext()

    def _run(self, experiment: str, name: str, artifacts: str | None, tags: dict) -> str:
        found = self.client.get_experiment_by_name(experiment)
        exp_id = (
            found.experiment_id
            if found
            else self.client.create_experiment(experiment, artifact_location=artifacts)
        )

        def quoted(text: str) -> str:
            return text.replace("'", "\\'")

        run = f" and tags.`pita.run` = '{quoted(tags['pita.run'])}'" if "pita.run" in tags else ""
        earlier = self.client.search_runs(
            [exp_id], f"attributes.run_name = '{quoted(name)}'{run}"
        )  # this run's task only: the store holds every run under outputs/
        if earlier:  # a retry: the same run, not a second one
            self.client.update_run(earlier[0].info.run_id, status="RUNNING")
            return earlier[0].info.run_id
        return self.client.create_run(exp_id, run_name=name, tags=tags).info.run_id

    def _log_params(self, params: dict) -> None:
        from mlflow.entities import Param

        if not params or self.client.get_run(self.run_id).data.params:
            return  # a retry: params are immutable and already there
        items = [Param(k, str(v)) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        from mlflow.entities import Metric

        now = time.time()
        self._pending += [Metric(k, v, int(now * 1000), step) for k, v in _numeric(metrics).items()]
        if len(self._pending) >= 1000 or now - self._flushed >= 5.0:
            self._flush()

    def _flush(self) -> None:
        """One transaction for what the last seconds logged (a sqlite write per optimizer
        step would cost tens of ms each)."""
        batch, self._pending, self._flushed = self._pending, [], time.time()
        with self._locked():
            for i in range(0, len(batch), 1000):  # MLflow takes at most 1000 metrics per batch
                self.client.log_batch(self.run_id, metrics=batch[i : i + 1000])

    def close(self) -> None:
        self._flush()
        with self._locked():
            self.client.set_terminated(self.run_id)


def mlflow_folder(run_dir: str | Path) -> Path:
    """Where the default MLflow store lives: `<outputs>/mlflow/`, shared by every run under
    the nearest `outputs` folder above the run (single runs and sweep jobs alike), so
    `mlflow ui` lists and compares them as MLflow users expect; a run folder outside any
    `outputs/` (`hydra.run.dir` moved) keeps its own `<run>/logs/mlflow/`."""
    run = Path(run_dir).resolve()
    for parent in run.parents:
        if parent.name == "outputs":
            return parent / "mlflow"
    return log_dir(run, "mlflow")


def mlflow_uri(cfg: LoggerConfig, run_dir: str | Path) -> str:
    """`logger.tracking_uri`, else the shared sqlite store of `mlflow_folder` (MLflow 3
    accepts it; a bare file store it refuses)."""
    if cfg.tracking_uri:
        return cfg.tracking_uri
    return f"sqlite:///{mlflow_folder(run_dir) / 'mlflow.db'}"


class SafeTracker(Tracker):
    """A tracker whose failures are a WARNING in the task log, once, and then silence:
    metrics are a convenience, the task's result is not."""

    def __init__(self, inner: Tracker, logger: logging.Logger | None = None):
        super().__init__()
        self.inner = inner
        self.backend = inner.backend
        self.logger = logger or _log
        self.failed = False

    @property
    def start_step(self) -> int:
        return self.inner.start_step

    @start_step.setter
    def start_step(self, value: int) -> None:
        if hasattr(self, "inner"):
            self.inner.start_step = value

    def _guard(self, what: str, call, *args) -> None:
        if self.failed:
            return
        try:
            call(*args)
        except Exception as exc:  # noqa: BLE001 - never lose a task to its tracker
            self.failed = True
            self.logger.warning(
                "logger.backend=%s: %s failed, no more tracking for this task: %s: %s",
                self.backend,
                what,
                type(exc).__name__,
                " ".join(str(exc).split())[:300],
            )

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        self._guard("log", self.inner.log, metrics, step)

    def close(self) -> None:
        self._guard("close", self.inner.close)


def _backend_tracker(cfg: Any, lcfg: LoggerConfig, backend: str, run_dir: str | Path, name: str):
    need = missing_package(backend)
    if need:
        raise RuntimeError(f"logger.backend={backend}: the package is not installed; {need}")
    if backend == "csv":
        return CsvTracker(log_dir(run_dir, backend) / f"{name}.csv")
    params = flat_params(config_dict(cfg))
    tags = tag_list(lcfg)
    if backend == "tensorboard":
        return TensorBoardTracker(log_dir(run_dir, backend) / name, params, tags)
    experiment = str(cfg.experiment.name) if hasattr(cfg, "experiment") else "pita"
    group = run_group(run_dir, experiment)
    if backend == "wandb":
        folder, run_id = log_dir(run_dir, backend), wandb_run_id(run_dir, name)
        return WandbTracker(folder, name, group, lcfg, config_dict(cfg), run_id)
    if backend == "mlflow":
        folder = mlflow_folder(run_dir)
        own_store = not lcfg.tracking_uri
        return MlflowTracker(
            mlflow_uri(lcfg, run_dir),
            experiment,
            name,
            artifacts=(folder / "artifacts").as_uri() if own_store else None,
            lock=folder / "mlflow.lock" if own_store else None,  # one lock per store
            params=params,
            tags={
                "pita.group": group,
                "pita.task": name,
                "pita.run": str(Path(run_dir).resolve()),
                **{metric_name(t): "true" for t in tags},
            },
        )
    raise ValueError(f"logger.backend={backend!r}: allowed: {' | '.join(BACKENDS)}")


def open_tracker(
    cfg: Any, run_dir: str | Path, name: str, logger: logging.Logger | None = None
) -> Tracker:
    """The tracker of one task (or of the run's results, `name="results"`), with the run
    config as its params and `logger.tags` as its tags. It never raises: a backend that
    cannot open, log or close is a WARNING on `logger` (the task log) and tracks nothing."""
    lcfg = logger_cfg(cfg)
    backend = lcfg.backend
    if backend == "none":
        return Tracker()
    try:
        inner = _backend_tracker(cfg, lcfg, backend, run_dir, name)
    except Exception as exc:  # noqa: BLE001 - never lose a task to its tracker
        safe = SafeTracker(Tracker(), logger)
        safe.backend = backend
        safe._guard("open", _raise, exc)
        return safe
    return SafeTracker(inner, logger)


def _raise(exc: BaseException) -> None:
    raise exc


# --- TRL / transformers Trainer -------------------------------------------------------------


class scoped_env:
    """Set environment variables for a block (the worker runs one task at a time)."""

    def __init__(self, env: Mapping[str, str]):
        self.env = dict(env)
        self.saved: dict[str, str | None] = {}

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


def trl_log_key(key: str) -> str:
    """TRL's log key as the task's tracker names it (as transformers' integrations do):
    `eval_x` -> `eval/x`, `test_x` -> `test/x`, anything else `train/<key>`."""
    for split in ("eval", "test"):
        if key.startswith(f"{split}_"):
            return f"{split}/{key[len(split) + 1 :]}"
    return f"train/{key}"


def trl_callback(tracker: Tracker):
    """A TrainerCallback forwarding every numeric log of a Trainer (rank 0) to `tracker`,
    which it closes when training ends. A resumed Trainer's first step is the tracker's
    `start_step` (TensorBoard purges the dead attempt's later steps, CSV drops them)."""
    from transformers import TrainerCallback

    class TrackerCallback(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            if state.global_step and not tracker.start_step:
                tracker.start_step = int(state.global_step)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and state.is_world_process_zero:
                tracker.log({trl_log_key(k): v for k, v in logs.items()}, state.global_step)

        def on_train_end(self, args, state, control, **kwargs):
            tracker.close()

    return TrackerCallback()
