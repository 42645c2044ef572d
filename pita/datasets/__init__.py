"""Tasks (datasets): the registry, config validation and `build_task`.

    task = build_task(cfg.dataset)                       # goal_walk, star_graph (built-in ids)
    task = build_task(cfg.dataset, tokenizer="gpt2")     # the same, as text in a family's tokenizer
    task = build_task(cfg.dataset, tokenizer=tok)        # gsm8k, math500, aime
    task = build_task(cfg.dataset, tokenizer=tok, scorer=rm_score)   # imdb, tldr

Importing this package loads neither torch nor transformers: the orchestrator calls
`validate_dataset_cfg` before it starts any process. Task modules are imported on demand.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Mapping
from typing import Any

from .base import Example, Task, cfg_error

# name -> module under pita.datasets that defines `validate_cfg(cfg) -> list[str]` and
# `build(cfg, tokenizer=None, scorer=None) -> Task`
REGISTRY: dict[str, str] = {
    "goal_walk": "goal_walk",
    "star_graph": "star_graph",
    "gsm8k": "hub",
    "math500": "hub",
    "aime": "hub",
    "imdb": "hub",
    "tldr": "hub",
}

# Datasets of your own package (docs/extending.md): entry points of group `pita_datasets`,
# `name = "pkg.module"`, read when this package is imported (orchestrator and workers alike).
# pita's own names win.
PLUGIN_DATASETS = "pita_datasets"
for _ep in importlib.metadata.entry_points(group=PLUGIN_DATASETS):
    REGISTRY.setdefault(_ep.name, _ep.value)

# Tasks generated in code: π_ref is trained on them by the run's `pretrain` stage (from
# scratch for the tiny family, fine-tuned from the family's weights otherwise).
OFFLINE_TASKS = ("goal_walk", "star_graph")

__all__ = [
    "OFFLINE_TASKS",
    "REGISTRY",
    "Example",
    "Task",
    "build_task",
    "is_offline",
    "needs_reward_model",
    "validate_dataset_cfg",
]


def is_offline(name: str) -> bool:
    """True for a task generated in code (its π_ref is pretrained in the run)."""
    return name in OFFLINE_TASKS


def needs_reward_model(name: str) -> bool:
    """True for a task scored by the family's reward model (IMDB, TL;DR)."""
    if REGISTRY.get(name) != "hub":
        return False
    from .hub import SPECS

    return SPECS[name].kind == "rm"


def _as_dict(dataset_cfg: Mapping) -> dict[str, Any]:
    """A plain dict of the keys that are set (dicts and OmegaConf DictConfigs).

    A key whose value is None counts as not set (the config schema declares every task's
    keys and leaves the other tasks' keys None), so the task's default applies.
    """
    if not isinstance(dataset_cfg, Mapping):
        raise TypeError(f"dataset config must be a mapping, got {type(dataset_cfg).__name__}")
    return {str(k): dataset_cfg[k] for k in dataset_cfg if dataset_cfg[k] is not None}


def _module(name: str):
    """pita's own task modules by their short name; a dataset of your own package (entry
    point `pita_datasets`, docs/extending.md) by its full module path."""
    module = REGISTRY[name]
    return importlib.import_module(module if "." in module else f"{__name__}.{module}")


def with_defaults(dataset_cfg: Mapping) -> dict:
    """`dataset_cfg` with the task's own defaults (its module's DEFAULTS) under it."""
    cfg = _as_dict(dataset_cfg)
    return {**getattr(_module(cfg["name"]), "DEFAULTS", {}), **cfg}


def validate_dataset_cfg(dataset_cfg: Mapping) -> None:
    """Raise ValueError naming every bad key: "dataset.<key>=<value>: <what is allowed>".

    Several problems are joined with "; " on one line. Loads no torch/transformers and
    touches no network (local paths are checked for existence).
    """
    cfg = _as_dict(dataset_cfg)
    name = cfg.get("name")
    if name not in REGISTRY:
        raise ValueError(cfg_error("name", name, f"must be one of {', '.join(REGISTRY)}"))
    errors = _module(name).validate_cfg(cfg)
    if errors:
        raise ValueError("; ".join(errors))


def build_task(dataset_cfg: Mapping, tokenizer: Any = None, scorer: Any = None) -> Task:
    """Build the task named by dataset_cfg["name"].

    tokenizer: required for hub tasks (the model family's tokenizer, or a path/hub id to
    load it from); goal_walk and star_graph render as text in it, unless it is absent or
    their own built-in tokenizer (the tiny family's), which they then use.
    scorer: reward function for imdb/tldr, `fn(prompts, responses) -> list[float]`.
    """
    validate_dataset_cfg(dataset_cfg)
    cfg = _as_dict(dataset_cfg)
    return _module(cfg["name"]).build(cfg, tokenizer=tokenizer, scorer=scorer)
