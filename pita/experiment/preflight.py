"""Preflight: what the config's values alone cannot show, checked before any folder or
worker exists (exit 2, one line per problem naming the key and what is allowed).

`validate` (config.py) checks values; this module checks them against the world: local
dataset files (made absolute against the user's folder, their first lines parsed), the
model families against the datasets and the devices (quantized aliases need CUDA, a hub
task needs a hub family's tokenizer), hub models and datasets against the local Hugging
Face cache when the hub is off or unreachable (instead of minutes of retries in every
worker), the models' own files (positions against the prompt + response budget, LoRA
target modules: pita/experiment/preflight_models.py), and whether the output folder can be
written.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

PATH_KEYS = ("path", "train_path", "cache_dir")  # dataset.<key>: local paths
JSONL_LINES_CHECKED = 5
MAX_LINE_CHARS = 4 * 2**20
MIN_FREE_MB = 64
HUB_HOST, HUB_PROBE_S = "huggingface.co", 3.0
_TRUE = ("1", "true", "yes", "on")


def absolutize_paths(cfg: DictConfig, cwd: Path | None = None) -> list[str]:
    """Make relative `dataset.path/train_path/cache_dir` absolute against the user's folder
    (workers run from the project root, where a relative path means something else)."""
    cwd = Path.cwd() if cwd is None else Path(cwd)
    changed = []
    for key in PATH_KEYS:
        value = cfg.dataset.get(key)
        if isinstance(value, str) and value and not Path(value).expanduser().is_absolute():
            cfg.dataset[key] = str((cwd / Path(value).expanduser()).resolve())
            changed.append(f"dataset.{key}")
    return changed


def environment_errors(
    cfg: DictConfig, gpu_kind: str, *, output_dir: Path | None = None
) -> list[str]:
    """Every preflight problem, as one-line messages (empty: go)."""
    from pita.experiment.preflight_models import (
        hub_dataset_errors,
        lora_target_errors,
        position_errors,
    )

    errors = _jsonl_errors(cfg)
    families = _families(cfg)
    family_errors = _family_errors(cfg, families, gpu_kind)
    errors += family_errors
    reachable = _probe_once()  # one probe of the hub for models and datasets
    errors += _offline_model_errors(families, reward=_needs_reward(cfg), reachable=reachable)
    if not family_errors:  # a hub task on the built-in family: that line says it all
        errors += hub_dataset_errors(cfg, hub_offline(), reachable)
    errors += position_errors(cfg, families)
    errors += lora_target_errors(cfg, families)
    if output_dir is not None:
        errors += output_dir_errors(output_dir)
    return errors


# ---- datasets ------------------------------------------------------------------------------


def _jsonl_errors(cfg: DictConfig) -> list[str]:
    """The first lines of each local .jsonl file must be JSON objects (a malformed file
    would otherwise fail every collect/evaluate task after the workers started)."""
    errors = []
    for key in ("path", "train_path"):
        value = cfg.dataset.get(key)
        if not isinstance(value, str) or not value:
            continue
        p = Path(value)
        files = sorted(p.glob("*.jsonl")) if p.is_dir() else [p] if p.is_file() else []
        for f in files:
            problem = _first_lines_problem(f)
            if problem:
                errors.append(
                    f"dataset.{key}={value!r}: {problem}; each line must be one JSON object"
                )
                break
    return errors


def _first_lines_problem(path: Path) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            seen, eof = 0, False
            # bounded whatever the file holds: at most JSONL_LINES_CHECKED records, each read
            # up to MAX_LINE_CHARS (a longer first record is left to the task)
            for n in range(1, JSONL_LINES_CHECKED * 100 + 1):
                line = f.readline(MAX_LINE_CHARS)
                if not line:
                    eof = True
                    break
                if len(line) == MAX_LINE_CHARS and not line.endswith("\n"):
                    return None
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as exc:
                    return f"{path.name} line {n} is not valid JSON ({exc.args[0].split(':')[0]})"
                if not isinstance(row, dict):
                    return f"{path.name} line {n} is a JSON {type(row).__name__}, not an object"
                seen += 1
                if seen >= JSONL_LINES_CHECKED:
                    break
            return None if seen or not eof else f"{path.name} holds no records"
    except UnicodeDecodeError:
        return f"{path.name} is not UTF-8 text"
    except OSError as exc:
        return f"{path.name} cannot be read ({exc.strerror})"


# ---- model families ------------------------------------------------------------------------


def _families(cfg: DictConfig) -> list[tuple[str, str, Any]]:
    """(config key, family name, resolved Family) for every family of the experiment."""
    from pita.core.errors import ConfigError
    from pita.experiment.plan import _group_cfg
    from pita.models.catalog import resolve_family

    names = list(cfg.experiment.families) or [cfg.model.name]
    key = "experiment.families" if cfg.experiment.families else "model.name"
    out = []
    for name in names:
        try:
            out.append((key, name, resolve_family(name, _group_cfg(cfg, "model", name))))
        except (ValueError, ConfigError):
            continue  # planning reports an unknown family with its own message
    return out


def _family_errors(
    cfg: DictConfig, families: list[tuple[str, str, Any]], gpu_kind: str
) -> list[str]:
    from pita.datasets import REGISTRY

    errors = []
    trainer = _policy_trainer(cfg)
    for key, name, fam in families:
        if fam.quantization and gpu_kind != "cuda":
            errors.append(
                f"{key}={name!r}: -{fam.quantization} aliases load with bitsandbytes on CUDA GPUs, "
                f"but this run's devices are {gpu_kind}; drop the -{fam.quantization} suffix"
            )
        elif fam.quantization and trainer:
            errors.append(  # the task would refuse it (placement.trained_policy_refusal)
                f"{key}={name!r}: algos.{trainer} trains the family's policy in fp32; "
                f"-{fam.quantization} (quantized training) is not supported: drop the suffix "
                f"or disable algos.{trainer}"
            )
    datasets = list(cfg.experiment.datasets) or [cfg.dataset.name]
    hub = [d for d in datasets if REGISTRY.get(_dataset_task(cfg, d)) == "hub"]
    builtin = [name for _, name, fam in families if fam.is_builtin]
    if hub and builtin:
        errors.append(
            f"dataset={hub[0]!r} with model={builtin[0]!r}: a hub task is tokenized by its model "
            f"family's tokenizer, and {builtin[0]!r} is built in the run for the synthetic tasks "
            f"(goal_walk, star_graph); use a hub family (e.g. model=gpt2) or a synthetic dataset"
        )
    return errors


def _policy_trainer(cfg: DictConfig) -> str | None:
    """The first enabled algorithm that trains the family's policy (DPO, GRPO, ...), if any."""
    from pita.algos.registry import ALGORITHMS
    from pita.experiment.plan import enabled_algos

    for name in enabled_algos(cfg):
        held = (h for models in ALGORITHMS[name].models.values() for h in models)
        if any(h.model == "policy" and h.use == "train" for h in held):
            return name
    return None


def _dataset_task(cfg: DictConfig, name: str) -> str:
    from pita.experiment.plan import _group_cfg

    try:
        return str(_group_cfg(cfg, "dataset", name)["name"])
    except Exception:  # noqa: BLE001 - planning reports a bad dataset group itself
        return name


def hub_offline() -> bool:
    return any(
        os.environ.get(v, "").lower() in _TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def hub_reachable(timeout_s: float = HUB_PROBE_S) -> bool:
    """One TCP connect to the hub within `timeout_s` (DNS included, on a daemon thread)."""
    ok: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((HUB_HOST, 443), timeout=timeout_s).close()
            ok.append(True)
        except OSError:
            pass

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return bool(ok)


def _probe_once() -> Callable[[], bool]:
    """`hub_reachable`, probed at most once however many checks ask."""
    seen: list[bool] = []

    def reachable() -> bool:
        if not seen:
            seen.append(hub_reachable())
        return seen[0]

    return reachable


def _needs_reward(cfg: DictConfig) -> bool:
    """Whether any dataset is scored by the family's reward model (a star graph on gpt2
    never loads gpt2's IMDB classifier, so its absence must not stop the run)."""
    from pita.datasets import needs_reward_model

    datasets = list(cfg.experiment.datasets) or [cfg.dataset.name]
    return any(needs_reward_model(_dataset_task(cfg, d)) for d in datasets)


def _offline_model_errors(
    families: list[tuple[str, str, Any]],
    reward: bool = True,
    reachable: Callable[[], bool] = hub_reachable,
) -> list[str]:
    """Hub models must be in the local cache when the hub is off (HF_HUB_OFFLINE) or cannot
    be reached; when it cannot be reached and all are cached, the workers go offline too.
    The reward model counts only when a dataset is scored by it (`reward`)."""
    wanted = []
    for _, _, fam in families:
        for role in ("reference", "guide", "reward")[: 3 if reward else 2]:
            ref = getattr(fam, role)
            if ref and not fam.is_builtin and not Path(ref).expanduser().exists():
                wanted.append((f"model.{role}", ref))
    if not wanted:
        return []
    offline = hub_offline()
    if not offline and reachable():
        return []
    from huggingface_hub import constants, try_to_load_from_cache

    why = "HF_HUB_OFFLINE is set" if offline else f"{HUB_HOST} cannot be reached"
    errors = []
    first_key: dict[str, str] = {}
    for key, repo in wanted:
        first_key.setdefault(repo, key)  # each repo once, under the first key that names it
    for repo, key in first_key.items():
        try:
            cached = isinstance(try_to_load_from_cache(repo, "config.json"), str)
        except Exception:  # noqa: BLE001 - a malformed id is not in any cache
            cached = False
        if not cached:
            errors.append(
                f"{key}={repo!r}: not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and "
                f"{why}; download it first (hf download {repo}) or set {key} to a local folder"
            )
    if not errors and not offline:
        os.environ["HF_HUB_OFFLINE"] = "1"  # workers inherit it: no minutes of retries each
    return errors


# ---- the output folder ---------------------------------------------------------------------


def output_dir_errors(target: Path, key: str = "hydra.run.dir") -> list[str]:
    """Can the run folder `target` be created and written, with some room left?"""
    target = Path(target).expanduser()
    anchor = target if target.is_absolute() else Path.cwd() / target
    while not anchor.exists() and anchor != anchor.parent:
        anchor = anchor.parent
    if not anchor.is_dir():
        return [
            f"{key}={str(target)!r}: {anchor} is a file, not a folder; run from another folder or set {key}"
        ]
    try:
        fd, probe = tempfile.mkstemp(dir=anchor, prefix=".pita-write-test-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return [
            f"{key}={str(target)!r}: cannot write in {anchor} ({exc.strerror}); run from a writable folder "
            f"or set {key}=<writable folder>"
        ]
    free_mb = shutil.disk_usage(anchor).free // 2**20
    if free_mb < MIN_FREE_MB:
        return [
            f"{key}={str(target)!r}: only {free_mb} MB free in {anchor}; at least {MIN_FREE_MB} MB needed"
        ]
    return []


def planned_run_dir(cfg: DictConfig, overrides: list[str]) -> Path:
    """Where Hydra will put the run folder (its `hydra.run.dir`, resolved without `now`)."""
    for o in overrides:
        if o.startswith("hydra.run.dir="):
            return Path(o.split("=", 1)[1])
    return Path("outputs") / str(cfg.experiment.name)


# ---- the launcher --------------------------------------------------------------------------

SLURM_LAUNCHER_SUFFIX = "SlurmLauncher"  # submitit's class for hydra/launcher=slurm|submitit_slurm


def check_launcher(target: str | None, overrides: list[str] | None = None) -> None:
    """Refuse a SLURM launcher where `sbatch` is not on PATH, before anything starts:
    submitit would fail only when submitting the first job, with a long traceback."""
    from pita.core.errors import ConfigError

    if not target or not str(target).endswith(SLURM_LAUNCHER_SUFFIX):
        return
    if shutil.which("sbatch") is not None:
        return
    typed = next(
        (o.split("=", 1)[1] for o in overrides or [] if o.startswith("hydra/launcher=")),
        "submitit_slurm",
    )
    raise ConfigError(
        f"hydra/launcher={typed}: sbatch not found on PATH; run on a SLURM login node "
        "or use hydra/launcher=submitit_local"
    )
