"""Resume with a fix: a resumed run may change any key; what the change touches runs again.

A run that failed on its config (a value TRL refuses, a dataset file that was wrong) is
finished by `resume_from=<run> <key>=<fixed value>`: the saved config and the override are
compared key by key, the plan is built again from the new config, and a task runs again
when

- it is new (the change adds it: another round, another algorithm), or its own config
  identity changed (its dataset or model family mapping, its function, inputs or shard), or
- it reads a changed key: `STAGE_READERS` says which stages read which keys (a key not
  listed is read by every stage, the safe default; `algos.<NAME>.*` only by that
  algorithm's tasks),

and everything downstream of a task that runs again runs again too (pita/core/resume.py).
The rest is kept. Keys that only say where and how the run goes or where results are recorded (their
field's `affects="place"` / `"record"`: `schema.resume_safe`; `RECORD_PREFIXES` for the
few outside it) touch no task. `dry_run=true` with `resume_from`
lists each task that will run and why, and changes nothing.

Applying a change (`apply_change`, under the run lock) first removes the committed
folders of the touched tasks, then writes the new plan and saved config: a resume that
dies in between finds the old config and redoes those tasks with it, never keeps a folder
computed from a config the run no longer has.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pita.core.dag import Plan
from pita.core.paths import RunPaths, TaskPaths, atomic_write_json, atomic_write_text
from pita.core.tasks import TaskSpec
from pita.experiment.cli_extras import flatten

log = logging.getLogger("pita")

# key prefix -> the stages that read it (merges count as their stage); a prefix not listed
# is read by every stage. `algos.<NAME>.` keys reach only that algorithm's tasks.
STAGE_READERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("algos.*.trl.", ("train",)),
    ("algos.*.peft", ("train",)),
    ("algos.*.reward_trl.", ("reward_model",)),
    ("evaluation.", ("evaluate",)),
    ("pretrain.", ("pretrain",)),
    ("training.", ("pretrain", "reward_model", "train")),
    ("generation.", ("collect", "train", "evaluate")),
    ("data_collection.", ("collect", "reward_model", "train")),
)
# keys no task computes with: where results are recorded, how the run is named
RECORD_PREFIXES = ("logger.", "experiment.name", "system.trust_group")
# keys whose effect is the plan's shape or a task's own mapping (compared task by task)
PLAN_PREFIXES = (
    "dataset.",
    "model.",
    "experiment.datasets",
    "experiment.dataset_file",
    "experiment.families",
    "rounds_of_training",
)
IDENTITY = (
    "fn",
    "deps",
    "inputs",
    "shard",
    "num_shards",
    "shard_range",
    "dataset_cfg",
    "family_cfg",
)
PLACEMENT_ONLY = ("memory_gb",)  # family_cfg keys that place a task, not what it computes


def changed_keys(saved: Mapping, new: Mapping, run_safe: Callable[[str], bool]) -> dict[str, tuple]:
    """key -> (saved value, new value) for every leaf that differs, except run-safe ones."""
    a, b = flatten(saved), flatten(new)
    out = {}
    for key in sorted(set(a) | set(b)):
        if run_safe(key) or key in ("resume_from", "dry_run"):
            continue
        if a.get(key, "<absent>") != b.get(key, "<absent>"):
            out[key] = (a.get(key, "<absent>"), b.get(key, "<absent>"))
    return out


def _reads(key: str, task: TaskSpec) -> bool:
    """Whether `task` reads `key` (by STAGE_READERS; the plan compares the rest)."""
    if key.startswith(RECORD_PREFIXES + PLAN_PREFIXES):
        return False
    stage = task.stage.removesuffix("_merge")
    generic = key
    if key.startswith("algos."):
        _, name, rest = key.split(".", 2) if key.count(".") >= 2 else (*key.split("."), "")
        if name != task.algo or rest == "enabled":
            return False
        generic = f"algos.*.{rest}"
    for prefix, stages in STAGE_READERS:
        if generic.startswith(prefix):
            return stage in stages
    return True


def _identity(task: TaskSpec) -> dict[str, Any]:
    d = task.to_dict()
    out = {k: d[k] for k in IDENTITY}
    out["family_cfg"] = {k: v for k, v in d["family_cfg"].items() if k not in PLACEMENT_ONLY}
    return out


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass
class Change:
    """What a resume with other values changes: the keys, the new plan, the touched tasks."""

    keys: dict[str, tuple] = field(default_factory=dict)
    plan: Plan = field(default_factory=Plan)
    touched: dict[str, str] = field(default_factory=dict)  # task id -> why it runs again

    def summary(self) -> str:
        shown = [f"{k}: {_show(a)} -> {_show(b)}" for k, (a, b) in list(self.keys.items())[:4]]
        more = f" (+{len(self.keys) - 4} more)" if len(self.keys) > 4 else ""
        return "; ".join(shown) + more


def touched_tasks(old: Plan, new: Plan, keys: Mapping[str, tuple]) -> dict[str, str]:
    """task id of `new` -> why it runs again, for the tasks the change touches directly."""
    out = {}
    for tid, task in new.tasks.items():
        before = old.tasks.get(tid)
        if before is None:
            out[tid] = "new task (the change adds it)"
            continue
        diff = [k for k, v in _identity(task).items() if _identity(before)[k] != v]
        if diff:
            out[tid] = f"its own {', '.join(diff)} changed"
            continue
        read = [k for k in keys if _reads(k, task)]
        if read:
            more = f" (+{len(read) - 1} more)" if len(read) > 1 else ""
            out[tid] = f"reads {read[0]}, changed{more}"
    return out


def plan_change(
    cfg: DictConfig, run_dir: Path, old: Plan, build: Any, run_safe: Callable[[str], bool]
) -> Change | None:
    """The change `cfg` makes to the run saved in `run_dir` (None: same config, the saved
    plan is reused as it is). `build(cfg) -> Plan` plans the new config."""
    from pita.core.safe_files import read_control_text
    from pita.experiment.config import PitaConfig, drop_retired_algo_keys

    saved = OmegaConf.create(read_control_text(RunPaths(run_dir).saved_config))
    assert isinstance(saved, DictConfig)  # the command line loaded it before (cli.py)
    # over the schema, as the command line loads it: a key a newer pita added is a default
    # on both sides, not a change
    before = OmegaConf.merge(OmegaConf.structured(PitaConfig), drop_retired_algo_keys(saved))
    from pita.experiment.strategy import keep_run_strategy

    keep_run_strategy(before, cfg)  # a saved `auto` (never resolved) is what this run resolved
    try:
        old_values = OmegaConf.to_container(before, resolve=True)
        new = OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # noqa: BLE001 - an interpolation only Hydra resolves: compare as written
        old_values = OmegaConf.to_container(before, resolve=False)
        new = OmegaConf.to_container(cfg, resolve=False)
    assert isinstance(old_values, dict) and isinstance(new, dict)
    keys = changed_keys(old_values, new, run_safe)
    if not keys:
        return None
    plan = build(cfg)
    return Change(keys, plan, touched_tasks(old, plan, keys))


def apply_change(cfg: DictConfig, run_dir: Path, change: Change) -> None:
    """Make the run folder hold `change` (the caller holds the run lock): touched tasks'
    committed folders removed first, then the new plan and saved config written."""
    from pita.core.journal import Journal

    paths = RunPaths(run_dir)
    removed = 0
    for tid in change.touched:
        final = TaskPaths(run_dir, tid).final
        if final.is_dir() and not final.is_symlink():
            aside = paths.tasks / f".tmp-stale-{tid}-{os.getpid()}"
            os.replace(final, aside)  # atomic: never a half-removed folder that verifies
            shutil.rmtree(aside, ignore_errors=True)
            removed += 1
    atomic_write_json(paths.plan, change.plan.to_json())
    atomic_write_text(paths.saved_config, OmegaConf.to_yaml(cfg, resolve=True))
    journal = Journal(paths.journal)
    journal.append(
        "run_changed",
        keys={k: [str(a), str(b)] for k, (a, b) in change.keys.items()},
        touched=sorted(change.touched),
        removed=removed,
    )
    journal.close()
    log.info("Config changed on resume: %s", change.summary())
    log.info(
        "%d task(s) touched by the change run again (%d finished folder(s) removed), with "
        "everything downstream of them",
        len(change.touched),
        removed,
    )


def print_resume_plan(plan: Plan, why: Mapping[str, str], change: Change | None) -> None:
    """The dry run of a resume: what changed and each task that will run, with why."""
    if change is not None:
        print(f"Config changed on resume: {change.summary()}")
    kept = len(plan.tasks) - len(why)
    print(f"Resume: {len(why)} task(s) will run, {kept} finished task(s) kept.")
    for tid, reason in why.items():
        print(f"  {tid:58s} {reason}")
