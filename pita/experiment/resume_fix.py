"""Resume with a fix: a resumed run may change any key; what the change touches runs again.

A run that failed on its config (a value TRL refuses, a dataset file that was wrong) is
finished by `resume_from=<run> <key>=<fixed value>`: the saved config and the override are
compared key by key, the plan is built again from the new config, and a task runs again
when

- it is new (the change adds it: another round, another algorithm), or its own config
  identity changed (its dataset or model family mapping, its function, inputs or shard), or
- it read a key whose value is not the one it computed with. Which keys a task read is not
  listed by hand: every task records them in its manifest, with the values read
  (`reads`, written by the worker from the typed settings: `schema.recording_reads`; a
  gang's ranks send theirs back). So the reference's evaluate, which samples under every
  enabled guided algorithm's rule, runs again when `algos.PITA.guidance.top_k` changes or
  PITA is disabled. A finished task whose manifest records no reads (a folder written by a
  pita before this) is taken to read every key: any changed key runs it again.

Everything downstream of a task that runs again runs again too (pita/core/resume.py).
The rest is kept. Keys that only say where and how the run goes or where results are
recorded (their field's `affects="place"` / `"record"`: `schema.resume_safe`;
`RECORD_PREFIXES` for the few outside it) touch no task. `dry_run=true` with `resume_from`
lists each task that will run and why, and changes nothing.

The saved config is the run's own: its sha256 is in the journal each time pita writes it
(`config_sha256` of `run_started` / `run_resumed` / `run_changed`). A saved config edited
by hand since is named in one WARNING line on resume, and what it changed runs again: the
recorded values are compared with the edited config, not with what the file said before.

Applying a change (`apply_change`, under the run lock) first removes the committed
folders of the touched tasks, then writes the new plan and saved config: a resume that
dies in between finds the old config and redoes those tasks with it, never keeps a folder
computed from a config the run no longer has.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf

from pita.core.dag import Plan
from pita.core.paths import RunPaths, TaskPaths, atomic_write_json, atomic_write_text
from pita.core.tasks import TaskSpec
from pita.experiment.cli_extras import flatten

log = logging.getLogger("pita")

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


def _identity(task: TaskSpec) -> dict[str, Any]:
    d = task.to_dict()
    out = {k: d[k] for k in IDENTITY}
    out["family_cfg"] = {k: v for k, v in d["family_cfg"].items() if k not in PLACEMENT_ONLY}
    return out


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def value_at(plain: Mapping[str, Any], dotted: str) -> Any:
    """The value of `dotted` in a resolved config as a stage would read it now: the config's
    own, else the schema's default (an algorithm's keys: its registry row's schema), else
    None (an algorithm the config lacks reads as absent: `context.algo_settings`)."""
    node: Any = plain
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _default(dotted)
        node = node[part]
    return node


def _default(dotted: str) -> Any:
    from pita.core import schema as S

    schema: type = S.PitaConfig
    key = dotted
    if dotted.startswith("algos."):
        from pita.algos.registry import ALGORITHMS

        _, name, key = (dotted.split(".", 2) + [""])[:3]
        row = ALGORITHMS.get(name)
        schema = row.schema if row is not None else S.ReferenceConfig
    try:
        return S.default_of(key, schema)
    except KeyError:
        return None


def _as_recorded(value: Any) -> Any:
    """`value` as a manifest holds it (JSON: tuples are lists, odd types their str)."""
    return json.loads(json.dumps(value, default=str))


def recorded_reads(run_dir: Path, tid: str) -> dict[str, Any] | None:
    """The config keys task `tid`'s committed folder records it read, with their values;
    None when its manifest records none (written by an older pita) or cannot be read."""
    from pita.core.safe_files import read_control_text

    try:
        manifest = json.loads(read_control_text(TaskPaths(run_dir, tid).manifest))
    except (OSError, ValueError):
        return None
    reads = manifest.get("reads") if isinstance(manifest, dict) else None
    return reads if isinstance(reads, dict) else None


def stale_reads(
    reads: Mapping[str, Any], now: Mapping[str, Any], run_safe: Callable[[str], bool]
) -> list[str]:
    """The keys of `reads` (a task's recorded reads) whose value in `now` (the resolved
    config the resume runs) is not the one read, but for keys that change no result and
    the plan's own keys (compared through each task's identity)."""
    out = []
    for key, value in reads.items():
        if key.startswith(RECORD_PREFIXES + PLAN_PREFIXES) or run_safe(key):
            continue
        if _as_recorded(value_at(now, key)) != value:
            out.append(key)
    return out


@dataclass
class Change:
    """What a resume with other values changes: the keys, the new plan, the touched tasks;
    `edited`: the line naming a saved config edited since the run wrote it."""

    keys: dict[str, tuple] = field(default_factory=dict)
    plan: Plan = field(default_factory=Plan)
    touched: dict[str, str] = field(default_factory=dict)  # task id -> why it runs again
    edited: str = ""

    def summary(self) -> str:
        shown = [f"{k}: {_show(a)} -> {_show(b)}" for k, (a, b) in list(self.keys.items())[:4]]
        more = f" (+{len(self.keys) - 4} more)" if len(self.keys) > 4 else ""
        return "; ".join(shown) + more


def touched_tasks(
    old: Plan,
    new: Plan,
    run_dir: Path,
    now: Mapping[str, Any],
    run_safe: Callable[[str], bool],
    keys: Mapping[str, tuple] | None = None,
    edited: bool = False,
) -> dict[str, str]:
    """task id of `new` -> why it runs again, for the tasks the change touches directly: new
    tasks, tasks whose identity changed, and finished tasks whose recorded reads differ from
    `now`. One whose manifest records no reads runs again when any key of `keys` may reach
    it, or the saved config was `edited`: which keys it read is not known."""
    unread = [k for k in keys or {} if not k.startswith(RECORD_PREFIXES + PLAN_PREFIXES)]
    unread += ["the saved config"] if edited else []
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
        if not TaskPaths(run_dir, tid).manifest.is_file():
            continue  # not finished: it runs anyway (pita/core/resume.py says why)
        reads = recorded_reads(run_dir, tid)
        if reads is None:
            if unread:
                out[tid] = f"its manifest records no reads (older pita); {unread[0]} changed"
            continue
        stale = stale_reads(reads, now, run_safe)
        if stale:
            more = f" (+{len(stale) - 1} more)" if len(stale) > 1 else ""
            was, now_value = _show(reads[stale[0]]), _show(value_at(now, stale[0]))
            out[tid] = f"read {stale[0]}={was}, now {now_value}{more}"
    return out


def config_sha256(run_dir: Path) -> str | None:
    """sha256 of the run's saved config as it is now (None: no readable file)."""
    from pita.core.safe_files import read_control

    try:
        return hashlib.sha256(read_control(RunPaths(run_dir).saved_config)).hexdigest()
    except OSError:
        return None


def written_sha256(run_dir: Path) -> str | None:
    """The sha256 of the saved config the last time pita wrote it (the journal's last
    `config_sha256`); None for a run written before pita recorded it."""
    from pita.core.journal import read_events

    events = read_events(RunPaths(run_dir).journal)
    digests = [e["config_sha256"] for e in events if isinstance(e.get("config_sha256"), str)]
    return digests[-1] if digests else None


def edited_line(run_dir: Path) -> str:
    """One line when the saved config is not the file pita last wrote, else ""."""
    written, now = written_sha256(run_dir), config_sha256(run_dir)
    if written is None or now is None or written == now:
        return ""
    return (
        f"{RunPaths(run_dir).saved_config} was edited since the run wrote it (sha256 "
        f"{written[:12]} in journal.jsonl, now {now[:12]}): the tasks whose recorded reads or "
        f"plan it changes run again"
    )


def plan_change(
    cfg: DictConfig, run_dir: Path, old: Plan, build: Any, run_safe: Callable[[str], bool]
) -> Change | None:
    """The change `cfg` makes to the run saved in `run_dir` (None: same config, the saved
    plan is reused as it is). `build(cfg) -> Plan` plans the new config. A saved config
    edited since the run wrote it is a change too (`edited_line`), whatever `cfg` says."""
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
    edited = edited_line(run_dir)
    if not keys and not edited:
        return None
    plan = build(cfg)
    now = cast("dict[str, Any]", new)
    touched = touched_tasks(old, plan, run_dir, now, run_safe, keys, bool(edited))
    return Change(keys, plan, touched, edited)


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
        edited=bool(change.edited),
        config_sha256=config_sha256(run_dir),
    )
    journal.close()
    if change.edited:
        log.warning(change.edited)
    if change.keys:
        log.info("Config changed on resume: %s", change.summary())
    log.info(
        "%d task(s) touched by the change run again (%d finished folder(s) removed), with "
        "everything downstream of them",
        len(change.touched),
        removed,
    )


def print_resume_plan(plan: Plan, why: Mapping[str, str], change: Change | None) -> None:
    """The dry run of a resume: what changed and each task that will run, with why."""
    if change is not None and change.edited:
        print(change.edited)
    if change is not None and change.keys:
        print(f"Config changed on resume: {change.summary()}")
    kept = len(plan.tasks) - len(why)
    print(f"Resume: {len(why)} task(s) will run, {kept} finished task(s) kept.")
    for tid, reason in why.items():
        print(f"  {tid:58s} {reason}")
