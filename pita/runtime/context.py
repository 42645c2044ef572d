"""What a stage function receives: `def stage(ctx: StageContext) -> dict | None`.

A stage is a plain function looked up by (algorithm, stage) in `pita/algos/registry.py`.
It reads its settings as typed, read-only values of the schema (pita/core/schema.py),
built once per chain: `ctx.algo` (the registry row's schema class; `ctx.algo_as(Schema)`
narrows it for the type checker), `ctx.training`, `ctx.system`, `ctx.generation`,
`ctx.evaluation`, `ctx.data_collection`, `ctx.pretrain`, `ctx.model`, `ctx.experiment`,
`ctx.logger_settings`. A default lives on its field only: a stage never restates one with
`.get("key", default)` (tests/test_stage_settings.py scans for them). `ctx.cfg`, the chain's
read-only DictConfig, stays for what is not a schema group (`executor.stage_overrides`,
the dataset's own keys). The worker has already put the chain's own dataset and model
family into the config, so a stage of a multi-dataset experiment never sees another
chain's groups. A stage gets its inputs through
`ctx.input(name)` (one folder) or `ctx.inputs(name)` (a list: rounds' data, shards), loads models through `ctx.load_model(...)` (the worker's LRU, so shards
of one stage do not reload weights), writes artifacts under `ctx.out_dir` (a temporary
folder committed atomically when the function returns) and returns a small JSON-able
dict that becomes `result.json`.
"""

from __future__ import annotations

import importlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar, cast

from omegaconf import DictConfig, OmegaConf

from pita.core import schema as S
from pita.core.paths import Artifact, RunPaths
from pita.core.progress import progress_line
from pita.core.tasks import TaskSpec, task_id

T = TypeVar("T")

PROGRESS_EVERY_S = 0.5  # a progress line per half second is plenty for a 2 s heartbeat


class ModelCache:
    """A worker's LRU of loaded models, so shards of one stage do not reload weights."""

    def __init__(self, capacity: int = 2):
        self.capacity = capacity
        self._items: OrderedDict[str, Any] = OrderedDict()

    def get(self, key: str, loader: Callable[[], Any]) -> Any:
        if key in self._items:
            self._items.move_to_end(key)
            return self._items[key]
        value = loader()
        self._items[key] = value
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)
        return value

    def clear(self) -> None:
        self._items.clear()


@dataclass(frozen=True)
class StageSettings:
    """The typed values of one chain's config (read-only schema instances)."""

    algo: S.ReferenceConfig
    experiment: S.ExperimentConfig
    system: S.SystemConfig
    training: S.TrainingConfig
    generation: S.GenerationConfig
    data_collection: S.DataCollectionConfig
    evaluation: S.EvaluationConfig
    pretrain: S.PretrainConfig
    model: S.ModelConfig
    logger: S.LoggerConfig


def stage_settings(cfg: DictConfig | dict, task: TaskSpec) -> StageSettings:
    """`cfg`'s groups as schema instances; `algos.<task.algo>` as the class the planner named
    in `task.algo_schema` (the registry row's; ReferenceConfig for tasks outside a chain)."""
    plain = cfg if isinstance(cfg, dict) else OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(plain, dict), "a run's config is a mapping"

    def group(name: str) -> Any:
        return plain.get(name) or {}

    algo_schema: type = S.ReferenceConfig
    if task.algo_schema:
        module, _, attr = task.algo_schema.partition(":")
        algo_schema = getattr(importlib.import_module(module), attr)
    return StageSettings(
        algo=S.settings(algo_schema, group("algos").get(task.algo), f"algos.{task.algo}."),
        experiment=S.settings(S.ExperimentConfig, group("experiment"), "experiment."),
        system=S.settings(S.SystemConfig, group("system"), "system."),
        training=S.settings(S.TrainingConfig, group("training"), "training."),
        generation=S.settings(S.GenerationConfig, group("generation"), "generation."),
        data_collection=S.settings(
            S.DataCollectionConfig, group("data_collection"), "data_collection."
        ),
        evaluation=S.settings(S.EvaluationConfig, group("evaluation"), "evaluation."),
        pretrain=S.settings(S.PretrainConfig, group("pretrain"), "pretrain."),
        model=S.settings(S.ModelConfig, group("model"), "model."),
        logger=S.settings(S.LoggerConfig, group("logger"), "logger."),
    )


def algo_settings(cfg: DictConfig, name: str, schema: type[T]) -> T | None:
    """`algos.<name>` of `cfg` as `schema` (its registry row's: the caller knows the
    registry, this module does not), None when the config has no such algorithm. Reads are
    recorded like a task's own settings': what another algorithm's keys a stage reads (the
    reference's evaluate samples under every enabled guided algorithm's rule) is then in
    its manifest, and a resume that changes them runs it again. An absent algorithm is
    recorded as read (`algos.<name>`: None), so one the change adds runs it again too."""
    node = (cfg.get("algos") or {}).get(name)
    if node is None:
        S.record_read(f"algos.{name}", None)
        return None
    plain = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node
    assert isinstance(plain, dict), "an algorithm's group is a mapping"
    return S.settings(schema, cast("dict[str, Any]", plain), f"algos.{name}.")


@dataclass
class StageContext:
    task: TaskSpec
    cfg: DictConfig
    run_dir: Path
    out_dir: Path
    logger: logging.Logger
    device: str = "cpu"  # "cuda" (the worker's pinned devices) or "cpu"
    models: ModelCache = field(default_factory=ModelCache)
    heartbeat: Callable[[str], None] = lambda msg: None
    # (done, total) of each progress report: a gang's rank tells its stall watch it stepped
    on_step: Callable[[int, int], None] | None = None
    chain_merged: bool = (
        False  # cfg already carries the task's dataset/family (the worker caches it)
    )
    settings: StageSettings | None = None  # built from cfg unless given (the worker caches it)
    # the typed settings, one attribute per group (set from `settings`)
    algo: S.ReferenceConfig = field(init=False)  # `algos.<task.algo>`, its row's schema class
    experiment: S.ExperimentConfig = field(init=False)
    system: S.SystemConfig = field(init=False)
    training: S.TrainingConfig = field(init=False)
    generation: S.GenerationConfig = field(init=False)
    data_collection: S.DataCollectionConfig = field(init=False)
    evaluation: S.EvaluationConfig = field(init=False)
    pretrain: S.PretrainConfig = field(init=False)
    model: S.ModelConfig = field(init=False)
    logger_settings: S.LoggerConfig = field(init=False)  # `logger.*` (`logger` is the task log)
    _reported_at: float = field(default=-1e9, init=False, repr=False)  # report_progress

    def __post_init__(self) -> None:
        if not self.chain_merged:
            self.cfg = chain_config(self.cfg, self.task)
            self.chain_merged = True
        if self.settings is None:
            self.settings = stage_settings(self.cfg, self.task)
        for f in fields(StageSettings):
            name = "logger_settings" if f.name == "logger" else f.name
            setattr(self, name, getattr(self.settings, f.name))

    def algo_as(self, schema: type[T]) -> T:
        """`ctx.algo` narrowed to the schema a stage was written for (refused otherwise:
        a stage plugged into the wrong algorithm fails here, not on a missing key)."""
        if not isinstance(self.algo, schema):
            raise TypeError(
                f"algos.{self.task.algo} is a {type(self.algo).__name__}; this stage needs a "
                f"{schema.__name__}"
            )
        return self.algo

    def algo_settings(self, name: str, schema: type[T]) -> T | None:
        """`algos.<name>` as `schema` (its registry row's; `ctx.algo` for the task's own),
        None when the config has no such algorithm; reading it is recorded (`algo_settings`)."""
        if name == self.task.algo:
            return self.algo_as(schema)
        return algo_settings(self.cfg, name, schema)

    @property
    def batch_size_safety_margin(self) -> float:
        """`batch_size_safety_margin`, a key outside every group, read (and recorded, as a
        settings field is) through here: the `auto` batch size's share of free memory."""
        value = self.cfg.get("batch_size_safety_margin")
        value = S.default_of("batch_size_safety_margin") if value is None else float(value)
        S.record_read("batch_size_safety_margin", value)
        return value

    def report_progress(self, done: int, total: int, unit: str = "step", detail: str = "") -> None:
        """Tell the orchestrator how far the task is (`step 412/1000 loss 0.31`): the live
        table shows it and the ETA projects the task's time left from it
        (pita/core/progress.py). Every stage's progress goes through here; a stage may
        call it every step: it passes at most one line per PROGRESS_EVERY_S on (a gang's
        rank 0 sends each over a pipe), and always the last."""
        now = time.monotonic()
        if done < total and now - self._reported_at < PROGRESS_EVERY_S:
            return
        self._reported_at = now
        if self.on_step is not None:
            self.on_step(done, total)
        self.heartbeat(progress_line(done, total, unit, detail))

    def input(self, name: str) -> Path:
        """The committed folder of the one task this task consumes under `name` (`policy`,
        `previous`, `guide`, `reference`, `reward_model`); a list-valued input is refused:
        read it with `inputs`."""
        ref = self.task.inputs[name]
        if isinstance(ref, list):
            raise TypeError(
                f"{self.task.id}: input {name!r} names {len(ref)} tasks; read it with "
                f"ctx.inputs({name!r})"
            )
        return RunPaths(self.run_dir).task(ref).final

    def inputs(self, name: str) -> list[Path]:
        """The committed folders of the tasks this task consumes under `name`, in order
        (`data`: the collect folders of rounds 0..k; `shards`: a stage's shards); a single
        task is a list of one."""
        ref = self.task.inputs[name]
        run = RunPaths(self.run_dir)
        return [run.task(r).final for r in (ref if isinstance(ref, list) else [ref])]

    def reference_model(self) -> str:
        """π_ref: `<pretrain>/model` for families built in the run (tiny), else the hub id
        or path of the family's reference model (pita/models/catalog.py)."""
        if self.has_input("reference"):
            return str(self.input("reference") / Artifact.MODEL)
        from pita.models.catalog import resolve_family

        return resolve_family(self.task.family, self.cfg.model).reference

    def load_value_model(self, guide_dir: Path | str) -> Any:
        """The value model of a train folder (`<guide_dir>/value_model`) on this task's
        device, through the worker's LRU so shards and η values of one stage load it once."""
        from pita.models.value_model import ValueModel

        folder = Path(guide_dir)
        if (folder / Artifact.VALUE_MODEL).is_dir():
            folder = folder / Artifact.VALUE_MODEL
        return self.models.get(
            f"value:{folder}",
            lambda: ValueModel.load(folder, device=self.device, attn_impl=self.system.attn_impl),
        )

    def load_model(self, name_or_path: Path | str) -> Any:
        """A causal LM (a save_pretrained folder or a hub id) on this task's device, through
        the worker's model LRU, loaded as the family says (`placement.load_stage_lm`: dtype,
        -8bit / -4bit, `model.device_map=auto` sharded over the gang with its layer
        distribution kept for run.log, see `placement.placement_lines`)."""
        from pita.models.placement import load_stage_lm

        return self.models.get(
            f"lm:{name_or_path}",
            lambda: load_stage_lm(
                str(name_or_path),
                family=self.task.family,
                family_cfg=self.cfg.model,
                device=self.device,
                attn_impl=self.system.attn_impl,
                logger=self.logger,
            ),
        )

    def build_task(self) -> Any:
        """The chain's task (`cfg.dataset`) in π_ref's tokenizer. A task scored by a reward
        model (IMDB, TL;DR) gets the family's `model.reward` as its scorer (in the LRU)."""
        from pita.datasets import build_task

        task: Any = build_task(self.cfg.dataset, tokenizer=self.reference_model())
        if (
            getattr(task, "kind", None) != "rm"
        ):  # a reward-model task (datasets/hub.py) has a scorer
            return task
        from pita.models.catalog import resolve_family
        from pita.models.reward_scorer import load_text_scorer

        family = resolve_family(self.task.family, self.cfg.model)
        reward = family.reward
        if not reward:
            raise ValueError(
                f"dataset {task.name} is scored by a reward model: set model.reward=<a "
                f"sequence-classification checkpoint> (family {self.task.family} has none)"
            )
        batch = self.data_collection.reward_batch_size
        task.scorer = self.models.get(
            f"rm-text:{reward}",
            lambda: load_text_scorer(
                reward,
                device=self.device,
                dtype=self.model.dtype,
                batch_size=batch if isinstance(batch, int) else 32,
                trust_remote_code=family.trust_remote_code,
            ),
        )
        return task

    def has_input(self, name: str) -> bool:
        return bool(self.task.inputs.get(name))

    def shard_slice(self, n_items: int) -> slice:
        """This shard's contiguous part of `n_items` items."""
        lo, hi = self.task.shard_range
        return slice(round(lo * n_items), round(hi * n_items))

    @property
    def seed(self) -> int:
        """A per-stage seed: the run seed mixed with the task id (stable across resumes).
        The shards of a sharded stage share it (their merge's id): they draw per example
        from it (pita/models/seeds.py), so no number depends on how many shards there are."""
        import zlib

        t = self.task
        stage_id = (
            t.id if t.shard is None else task_id(t.algo, t.dataset, t.family, t.round, t.stage)
        )
        return (int(self.experiment.seed) * 1_000_003 + zlib.crc32(stage_id.encode())) % (2**31)


def write_stand_in_outputs(ctx: StageContext) -> None:
    """Satisfy the task's declared outputs with empty stand-ins (an empty `.json` list, an
    empty `.jsonl`, a folder holding one empty file): for stages that stand in for a real
    one's timing or faults (benches, tests). Outputs are the stage's contract whoever
    implements it (pita/algos/registry.py `stage_outputs`)."""
    for name in ctx.task.outputs:
        path = ctx.out_dir / name
        if name.endswith(".json"):
            path.write_text("[]\n")
        elif name.endswith(".jsonl"):
            path.write_text("")
        else:
            path.mkdir(parents=True, exist_ok=True)
            (path / "stand_in").write_text("")


def chain_config(cfg: DictConfig | dict, task: TaskSpec) -> DictConfig:
    """The config a stage sees: the run's config with `dataset` and `model` replaced by the
    task's own chain groups. One channel: in a multi-dataset experiment the selected
    groups (`cfg.dataset` of the command line) belong to another chain. Read-only, since a
    worker shares it between the tasks of a chain."""
    plain = cfg if isinstance(cfg, dict) else OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(plain, dict), "a run's config is a mapping"
    merged: dict[str, Any] = {str(k): v for k, v in plain.items()}
    if task.dataset_cfg:
        merged["dataset"] = task.dataset_cfg
    if task.family_cfg:
        merged["model"] = task.family_cfg
    out = OmegaConf.create(merged)
    OmegaConf.set_readonly(out, True)
    return out


def resolve_function(dotted: str) -> Callable[[StageContext], Any]:
    """'pkg.module:function' -> the function (imported in the worker, not the orchestrator)."""
    module_name, _, attr = dotted.partition(":")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ImportError(f"{module_name} has no function {attr!r}") from None
