"""TaskSpec: one stage of one chain in one round (or one shard of it).

A task is plain data (it crosses the process boundary as a dict): its stable id, the
dotted path of the stage function, its dependencies, its inputs by logical name, and the
resources the scheduler needs (devices and a memory estimate).
"""

from __future__ import annotations

import importlib.machinery
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from pita.core.parallel import Gang, Strategy

STAGES = ("pretrain", "collect", "reward_model", "train", "evaluate")
SHARDABLE = ("collect", "evaluate")
# Every stage a task can have: a shardable stage also has a "<stage>_merge" task.
TASK_STAGES = tuple(x for st in STAGES for x in ((st, f"{st}_merge") if st in SHARDABLE else (st,)))


def chain_id(algo: str, dataset: str, family: str) -> str:
    return f"{algo}.{dataset}.{family}"


def task_id(
    algo: str, dataset: str, family: str, round_idx: int, stage: str, shard: int | None = None
) -> str:
    """`QSharp.star_graph.tiny.r1.collect.s03`; the unsharded id names the shards' merge."""
    base = f"{chain_id(algo, dataset, family)}.r{round_idx}.{stage}"
    return base if shard is None else f"{base}.s{shard:02d}"


@dataclass
class TaskSpec:
    id: str
    algo: str
    dataset: str
    family: str
    round: int
    stage: str  # a STAGES name, or "<stage>_merge" for the merge of a sharded stage
    fn: str  # "module.path:function", resolved in the worker
    # "module:Class" of `algos.<algo>`'s schema (the registry row's), resolved in the worker
    # into `ctx.algo`; "" for tasks outside an algorithm's chain (pretrain, diagnostics)
    algo_schema: str = ""
    deps: list[str] = field(default_factory=list)
    inputs: dict[str, Any] = field(default_factory=dict)  # logical name -> task id or [ids]
    shard: int | None = None
    num_shards: int = 1
    shard_range: tuple[float, float] = (0.0, 1.0)  # fraction of the stage's items
    gpus: int = 1  # the devices it holds (a gang: one rank each; else one process's)
    # its parallel plan (pita/core/parallel.py): set by the planner and the sizer
    # (pita/experiment/plan.py, gangs.py); under a gang strategy its `world` is `gpus`
    gang: Gang = field(default_factory=Gang)
    # an elastic training task: the rank counts its gang may have, ascending; `gpus` is
    # chosen among them when it is dispatched (pita/core/elastic.py). Empty: `gpus` is fixed
    ranks: list[int] = field(default_factory=list)
    mem_mb: int = 0  # the whole task's, over its gang (per device: mem_mb / gpus)
    mem_source: str = ""  # where mem_mb came from (pita/experiment/estimates.py); shown by dry_run
    preferred_device: int | None = None
    work: float = 1.0  # relative duration estimate, for critical-path priority
    priority: float = 0.0  # filled by the planner (critical path by default)
    batch_scale: float = 1.0  # halved on each OOM retry (effective batch kept via accumulation)
    dataset_cfg: dict[str, Any] = field(default_factory=dict)
    family_cfg: dict[str, Any] = field(default_factory=dict)
    outputs: list[str] = field(
        default_factory=list
    )  # declared outputs its committed folder must hold
    # its checkpoints resume on any k with the numbers of an uninterrupted run (the registry
    # row's `growable_stages`, set by the planner): growth may restart it on more ranks
    growable: bool = False

    def __post_init__(self) -> None:
        self.gang = Gang.from_dict(self.gang)  # a dict from plan.json / a worker's message
        self._sync_world()

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name == "gpus" and "gang" in self.__dict__:  # a gang's world is its devices
            self._sync_world()

    def _sync_world(self) -> None:
        if self.gang.ranked and self.gang.world != self.gpus:
            object.__setattr__(self, "gang", self.gang.resized(self.gpus))

    def set_gang(self, gang: Gang) -> None:
        """Give the task `gang` (its devices follow a gang strategy's world)."""
        self.gang = gang
        if gang.ranked:
            self.gpus = gang.world

    @property
    def strategy(self) -> Strategy:
        """The strategy its ranks run (`Gang.runs`: DDP over one rank is one process)."""
        return self.gang.runs

    @strategy.setter
    def strategy(self, name: str) -> None:
        """A gang of `name` over its devices, chosen by hand (tests, benches): a gang strategy
        it replaces stays as the one `asked` (as when the sizer overrides the planner)."""
        strategy, old = Strategy.of(name), self.gang
        asked = old.asked or (old.strategy if old.ranked and old.strategy is not strategy else None)
        world = self.gpus if strategy is not Strategy.NONE else 1
        self.gang = Gang(strategy, world, old.nodes, asked=asked)

    @property
    def elastic(self) -> bool:
        """Whether its ranks are chosen at dispatch (`ranks`)."""
        return len(self.ranks) > 1

    @property
    def chain(self) -> str:
        return chain_id(self.algo, self.dataset, self.family)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["shard_range"] = list(self.shard_range)
        d["gang"] = self.gang.to_dict()
        return d

    @classmethod
    def standalone(cls, id: str, algo: str, stage: str, fn: str, **fields: Any) -> TaskSpec:
        """A task outside any chain: no dataset, family or round (a diagnostic, a bench's)."""
        return cls(id=id, algo=algo, dataset="-", family="-", round=0, stage=stage, fn=fn, **fields)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TaskSpec:
        d = dict(d)
        d["shard_range"] = tuple(d.get("shard_range", (0.0, 1.0)))
        legacy = d.pop("strategy", None)  # a plan written before tasks carried a gang
        if legacy is not None and "gang" not in d:
            d["gang"] = Gang(Strategy.of(legacy), int(d.get("gpus", 1)) if legacy != "none" else 1)
        return cls(**d)


def module_exists(name: str) -> bool:
    """Whether `a.b.c` can be imported, found on sys.path without importing `a` or `a.b`
    (importlib.util.find_spec imports every parent package, i.e. runs its code)."""
    if name in sys.modules:
        return True
    parts = name.split(".")
    path = None
    for i in range(len(parts)):
        qualified = ".".join(parts[: i + 1])
        if qualified in sys.modules:
            spec = getattr(sys.modules[qualified], "__spec__", None)
        else:
            try:
                spec = importlib.machinery.PathFinder.find_spec(qualified, path)
            except (ImportError, ValueError):
                return False
        if spec is None:
            return False
        path = spec.submodule_search_locations
        if path is None and i < len(parts) - 1:
            return False  # a plain module has no submodules
    return True
