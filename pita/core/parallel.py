"""The parallel plan of a task: which strategy its ranks run and how many there are (`Gang`).

The strategy is decided once, when a plan is built: `training.parallel_strategy` (`auto`
resolved for the run's devices, pita/experiment/strategy.py) gives each training stage its
`Strategy`; the planner (pita/experiment/plan.py) and the sizer
(pita/experiment/gangs.py: a task too large for one device gets FSDP, a TRL stage on CPU
DDP) set each task's `Gang` (`TaskSpec.gang`); sizing at dispatch and growth
(pita/core/elastic.py, growth.py) change only its `world`. A worker and a stage read the
task's gang, never the config key; one function applies it to a model
(`pita.training.ddp.apply_gang`), as torchtitan's `parallelize` applies its parallel dims.

This module is the one that spells the strategies' names (the config's and the task's);
torch-free, like the rest of `pita.core`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

AUTO = "auto"  # `training.parallel_strategy=auto`: resolved per run (pita/experiment/strategy.py)


class Strategy(str, Enum):
    """How a task's ranks share its model: one process, DDP (replicated ranks) or FSDP2
    (parameters, gradients and optimizer state sharded). The value is the task's name
    (plan.json, the dry run); `key` the config's (`training.parallel_strategy`)."""

    NONE = "none"
    DDP = "ddp"
    FSDP = "fsdp"

    def __str__(self) -> str:  # "ddp", not "Strategy.DDP", in f-strings on every Python
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def key(self) -> str:
        """The name `training.parallel_strategy` gives it."""
        return _KEYS[self]

    @classmethod
    def of(cls, name: str | Strategy) -> Strategy:
        """The strategy a config key ("data_parallel") or a task's value ("ddp") names."""
        if isinstance(name, Strategy):
            return name
        for strategy, key in _KEYS.items():
            if name in (key, strategy.value):
                return strategy
        raise ValueError(f"parallel strategy {name!r}: expected one of {' | '.join(KEYS)}")


_KEYS = {Strategy.NONE: "none", Strategy.DDP: "data_parallel", Strategy.FSDP: "fsdp"}
KEYS: tuple[str, ...] = tuple(_KEYS.values())  # what the config key may say, besides `auto`


@dataclass(frozen=True)
class Gang:
    """A task's parallel plan: `strategy` over `world` ranks (one process each), on Ray
    `nodes` (node ids; empty locally). `asked`: the strategy the config asked for, when the
    planner chose another (a TRL stage on CPU runs DDP under fsdp, a task too large for one
    device FSDP whatever the key says), so the task's log can say why; None otherwise.

    A DDP gang of one rank is one plain process (`runs` is NONE): an elastic task keeps DDP
    as its strategy at every k, and only `world` changes when it is resized."""

    strategy: Strategy = Strategy.NONE
    world: int = 1
    nodes: tuple[str, ...] = ()
    asked: Strategy | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "strategy", Strategy.of(self.strategy))
        object.__setattr__(self, "nodes", tuple(self.nodes))
        if self.asked is not None:
            object.__setattr__(self, "asked", Strategy.of(self.asked))
        if int(self.world) < 1:
            raise ValueError(f"Gang(world={self.world}): a gang has at least one rank")

    @property
    def runs(self) -> Strategy:
        """The strategy its ranks run: NONE for DDP over one rank (nothing to all-reduce)."""
        if self.strategy is Strategy.DDP and self.world <= 1:
            return Strategy.NONE
        return self.strategy

    @property
    def ranked(self) -> bool:
        """Whether it trains under a gang strategy (its checkpoints are by parameter name and
        resume on any k), whatever its current world."""
        return self.strategy is not Strategy.NONE

    def resized(self, world: int) -> Gang:
        """The same plan on `world` ranks (sizing at dispatch, growth)."""
        return replace(self, world=int(world))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"strategy": self.strategy.value, "world": self.world}
        if self.nodes:
            out["nodes"] = list(self.nodes)
        if self.asked is not None:
            out["asked"] = self.asked.value
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | Gang) -> Gang:
        if isinstance(d, Gang):
            return d
        return cls(
            strategy=Strategy.of(d.get("strategy", "none")),
            world=int(d.get("world", 1)),
            nodes=tuple(d.get("nodes", ())),
            asked=d.get("asked"),
        )


def run_trains_on_gangs(cfg: Mapping[str, Any]) -> bool:
    """Whether a run's (resolved) config trains on gangs: a worker warms its forkserver for
    their ranks (pita/runtime/worker.py)."""
    training = cfg.get("training") or {}
    key = training.get("parallel_strategy")
    if key is None:  # a partial config (a unit test's): no gang
        return False
    return str(key) != AUTO and Strategy.of(str(key)) is not Strategy.NONE
