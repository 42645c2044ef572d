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
PLUGINS: dict[str, importlib.metadata.EntryPoint] = {}  # name -> its entry point (any module path)


def read_plugins() -> None:
    """Add the `pita_datasets` entry points installed now to REGISTRY (imported on use)."""
    for ep in importlib.metadata.entry_points(group=PLUGIN_DATASETS):
        if ep.name not in REGISTRY:
            REGISTRY[ep.name], PLUGINS[ep.name] = ep.value, ep


read_plugins()

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
    point `pita_datasets`, docs/extending.md) by its module path as written (a top-level
    module too). A plugin module that fails to import, or lacks `validate_cfg` and `build`,
    is a ValueError naming the package and the error (one line, exit 2, for a run that
    selects it: pita/core/plugins.py)."""
    if name not in PLUGINS:
        return importlib.import_module(f"{__name__}.{REGISTRY[name]}")
    from pita.core import plugins

    ep = PLUGINS[name]
    try:
        module = importlib.import_module(ep.value)
    except BaseException as exc:  # noqa: BLE001 - a plugin's import runs arbitrary code
        if isinstance(exc, KeyboardInterrupt):
            raise
        plugins.skip(PLUGIN_DATASETS, ep, plugins.error_line(exc))
        raise ValueError(
            cfg_error(
                "name",
                name,
                f"plugin {plugins.describe(PLUGIN_DATASETS, ep)} failed to "
                f"import: {plugins.error_line(exc)}",
            )
        ) from None
    missing = [f for f in ("validate_cfg", "build") if not callable(getattr(module, f, None))]
    if missing:
        raise ValueError(
            cfg_error(
                "name",
                name,
                f"plugin {plugins.describe(PLUGIN_DATASETS, ep)}: its module "
                f"has no {' and no '.join(missing)} (docs/extending.md)",
            )
        )
    return module


def plugin_schemas() -> dict[str, type]:
    """name -> the `SCHEMA` of each installed dataset plugin that declares one: a dataclass
    subclassing `pita.core.schema.DatasetConfig` with the dataset's own keys (docs/extending.md;
    registered with Hydra as `dataset_schema/<name>`, which the dataset's config file names
    in its defaults). A plugin that fails to import is skipped here (its run says so)."""
    import dataclasses

    from pita.core.schema import DatasetConfig

    out: dict[str, type] = {}
    for name in PLUGINS:
        try:
            schema = getattr(_module(name), "SCHEMA", None)
        except ValueError:  # failed to import: reported when a run selects it
            continue
        if dataclasses.is_dataclass(schema) and issubclass(schema, DatasetConfig):  # type: ignore[arg-type]
            out[name] = schema  # type: ignore[assignment]
    return out


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
        from pita.core.plugins import failure_hint

        raise ValueError(
            cfg_error("name", name, f"must be one of {', '.join(REGISTRY)}{failure_hint()}")
        )
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
