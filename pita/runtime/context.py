"""What a stage function receives: `def stage(ctx: StageContext) -> dict | None`.

A stage is a plain function looked up by (algorithm, stage) in `pita/algos/registry.py`.
It reads its config from `ctx.cfg` only — the worker has already put the chain's own
dataset and model family into `ctx.cfg.dataset` / `ctx.cfg.model`, so a stage of a
multi-dataset experiment never sees another chain's groups — its inputs through
`ctx.input(...)`, loads models through `ctx.load_model(...)` (the worker's LRU, so shards
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pita.core.paths import Artifact, RunPaths
from pita.core.progress import progress_line
from pita.core.tasks import TaskSpec

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
    chain_merged: bool = (
        False  # cfg already carries the task's dataset/family (the worker caches it)
    )
    _reported_at: float = field(default=-1e9, init=False, repr=False)  # report_progress

    def __post_init__(self) -> None:
        if not self.chain_merged:
            self.cfg = chain_config(self.cfg, self.task)
            self.chain_merged = True

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
        self.heartbeat(progress_line(done, total, unit, detail))

    @property
    def algo_cfg(self) -> DictConfig:
        return self.cfg.algos[self.task.algo]

    def input(self, name: str) -> Path | list[Path]:
        """The committed folder(s) of the task(s) this task consumes under `name`."""
        ref = self.task.inputs[name]
        run = RunPaths(self.run_dir)
        return [run.task(r).final for r in ref] if isinstance(ref, list) else run.task(ref).final

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
            lambda: ValueModel.load(
                folder, device=self.device, attn_impl=self.cfg.system.attn_impl
            ),
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
                attn_impl=self.cfg.system.attn_impl,
                logger=self.logger,
            ),
        )

    def build_task(self) -> Any:
        """The chain's task (`cfg.dataset`) in π_ref's tokenizer. A task scored by a reward
        model (IMDB, TL;DR) gets the family's `model.reward` as its scorer (in the LRU)."""
        from pita.datasets import build_task

        task = build_task(self.cfg.dataset, tokenizer=self.reference_model())
        if getattr(task, "kind", None) != "rm":
            return task
        from pita.models.catalog import resolve_family
        from pita.models.reward_scorer import load_text_scorer

        family = resolve_family(self.task.family, self.cfg.model)
        if not family.reward:
            raise ValueError(
                f"dataset {task.name} is scored by a reward model: set model.reward=<a "
                f"sequence-classification checkpoint> (family {self.task.family} has none)"
            )
        batch = self.cfg.data_collection.reward_batch_size
        task.scorer = self.models.get(
            f"rm-text:{family.reward}",
            lambda: load_text_scorer(
                family.reward,
                device=self.device,
                dtype=self.cfg.model.get("dtype", "auto"),
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
        """A per-task seed: the run seed mixed with the task id (stable across resumes)."""
        import zlib

        return (int(self.cfg.experiment.seed) * 1_000_003 + zlib.crc32(self.task.id.encode())) % (
            2**31
        )


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
    merged = dict(cfg) if isinstance(cfg, dict) else OmegaConf.to_container(cfg, resolve=True)
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
