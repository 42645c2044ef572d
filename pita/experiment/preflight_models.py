"""Preflight against the models' and datasets' own files: what the first task would hit.

Read without torch or transformers, from the files a task would load (a local folder, or
the local Hugging Face cache; nothing is downloaded here):

- a model whose positions (`config.json`: `max_position_embeddings` / `n_positions` /
  `n_ctx`) are fewer than a hub task's prompt + response budget (`dataset.max_prompt_tokens`
  + `dataset.max_new_tokens`): every task would end in `IndexError: index out of range in
  self` from the position embedding;
- LoRA `target_modules` that match no module of the trained policy (PEFT's rule: a module
  name equal to the entry or ending in `.<entry>`; module names come from the weights'
  names in the safetensors header or index, never from the tensors);
- a hub dataset that is neither in the local cache nor reachable (HF_HUB_OFFLINE, or the
  hub does not answer): every task would wait for the hub, then fail. When every dataset
  is cached and the hub cannot be reached, workers run with HF_DATASETS_OFFLINE=1.

Bounded whatever the files hold: `config.json` and an index are read up to `MAX_JSON_BYTES`,
a safetensors header up to `MAX_HEADER_BYTES` (a larger one is skipped, not read).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from pita.core.schema import DatasetConfig, settings

MAX_JSON_BYTES = 4 * 2**20
MAX_HEADER_BYTES = 32 * 2**20
POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length")
# the built-in family is a transformers Llama (pita/models/tiny.py): its modules' last names
BUILTIN_MODULES = (
    "embed_tokens",
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "input_layernorm",
    "post_attention_layernorm",
    "norm",
    "lm_head",
)


# --- reading a model's files ------------------------------------------------------------------


def _read_bounded(path: Path, limit: int) -> bytes | None:
    try:
        if not path.is_file() or path.stat().st_size > limit:
            return None
        with open(path, "rb") as f:
            return f.read(limit + 1)[:limit]
    except OSError:
        return None


def model_file(ref: str, name: str) -> Path | None:
    """`name` of model `ref` (a local folder, or a hub id in the local cache), or None."""
    local = Path(ref).expanduser()
    if local.is_dir():
        return local / name if (local / name).is_file() else None
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(ref, name)
    except Exception:  # noqa: BLE001 - a malformed id is in no cache
        return None
    return Path(found) if isinstance(found, str) else None


def _json(path: Path | None) -> Any:
    data = _read_bounded(path, MAX_JSON_BYTES) if path is not None else None
    try:
        return json.loads(data) if data else None
    except ValueError:
        return None


def positions(ref: str) -> int | None:
    """The positions a model can embed, from its config.json (None: unknown)."""
    config = _json(model_file(ref, "config.json"))
    if not isinstance(config, dict):
        return None
    for key in POSITION_KEYS:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _safetensors_names(path: Path) -> list[str] | None:
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return None
            (size,) = struct.unpack("<Q", head)
            if size > MAX_HEADER_BYTES:
                return None
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error):
        return None
    return [k for k in header if k != "__metadata__"] if isinstance(header, dict) else None


def module_names(ref: str) -> list[str] | None:
    """Names of the modules that hold weights (`model.layers.0.self_attn.q_proj`), read
    from the safetensors index or header; None when the weights are not at hand."""
    index = _json(model_file(ref, "model.safetensors.index.json"))
    if isinstance(index, dict) and isinstance(index.get("weight_map"), dict):
        names = list(index["weight_map"])
    else:
        single = model_file(ref, "model.safetensors")
        found = _safetensors_names(single) if single is not None else None
        if found is None:
            return None
        names = found
    return sorted({n.rsplit(".", 1)[0] for n in names if "." in n})


# --- the checks ---------------------------------------------------------------------------------


def _hub_datasets(cfg: DictConfig) -> list[tuple[str, DatasetConfig]]:
    """(dataset name, its typed settings) of every hub task of the experiment."""
    from omegaconf import OmegaConf

    from pita.datasets import REGISTRY
    from pita.experiment.plan import _group_cfg

    out = []
    for name in list(cfg.experiment.datasets) or [cfg.dataset.name]:
        try:
            group = _group_cfg(cfg, "dataset", name)
            node = OmegaConf.to_container(group) if isinstance(group, DictConfig) else group
            ds = settings(DatasetConfig, dict(node or {}))
        except Exception:  # noqa: BLE001 - planning reports a bad dataset group itself
            continue
        if REGISTRY.get(ds.name) == "hub":
            out.append((name, ds))
    return out


def position_errors(cfg: DictConfig, families: Iterable[tuple[str, str, Any]]) -> list[str]:
    """A model with fewer positions than a hub task's prompt + response budget."""
    from pita.datasets.hub import SPECS

    errors = []
    for ds_name, ds in _hub_datasets(cfg):
        spec = SPECS.get(ds.name)
        new = ds.max_new_tokens or (spec.max_new_tokens if spec else 0)
        prompt = ds.max_prompt_tokens or 0
        for _, _, fam in families:
            if fam.is_builtin:
                continue
            for role in ("reference", "guide"):
                ref = getattr(fam, role)
                n = positions(ref) if ref else None
                if n is None or prompt + new <= n:
                    continue
                budget = f"{prompt} + {new}" if prompt else f"{new} (+ the prompt)"
                errors.append(
                    f"dataset.max_new_tokens={new}: model.{role}={ref!r} embeds {n} positions, fewer "
                    f"than dataset={ds_name}'s prompt + response budget ({budget}); set "
                    f"dataset.max_prompt_tokens and dataset.max_new_tokens to sum to at most {n}"
                )
                break
    return errors


def _matches(target: str, modules: list[str]) -> bool:
    return any(m == target or m.endswith("." + target) for m in modules)


def lora_target_errors(cfg: DictConfig, families: Iterable[tuple[str, str, Any]]) -> list[str]:
    """`algos.<NAME>.peft.target_modules` entries that name no module of the policy."""
    errors = []
    fams = list(families)
    for name, algo in cfg.algos.items():
        peft = algo.get("peft") if algo.get("enabled") else None
        targets = peft.get("target_modules") if peft is not None else None
        if targets is None or isinstance(targets, str):
            continue  # all-linear: PEFT finds them itself
        for _, _, fam in fams:
            ref = "<built in the run>" if fam.is_builtin else fam.reference
            modules = list(BUILTIN_MODULES) if fam.is_builtin else module_names(str(fam.reference))
            if modules is None:
                continue  # not at hand: the offline check reports a missing model
            missing = [t for t in targets if not _matches(str(t), modules)]
            if missing:
                leaves = sorted({m.rsplit(".", 1)[-1] for m in modules})
                shown = ", ".join(leaves[:14]) + (" ..." if len(leaves) > 14 else "")
                verb = "matches" if len(missing) == 1 else "match"
                errors.append(
                    f"algos.{name}.peft.target_modules={list(targets)}: {', '.join(map(str, missing))} "
                    f"{verb} no module of model.reference={ref!r}; its modules end in: {shown} "
                    f"(or use target_modules=all-linear)"
                )
                break
    return errors


def _hf_home() -> Path:
    return Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface").expanduser()


def dataset_cached(hub_id: str, cache_dir: str | None) -> bool:
    """Whether `datasets` (its own cache) or the hub cache (`hf download --repo-type
    dataset`) holds the dataset."""
    hub_cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    hub = Path(hub_cache).expanduser() if hub_cache else _hf_home() / "hub"
    ds_cache = cache_dir or os.environ.get("HF_DATASETS_CACHE") or str(_hf_home() / "datasets")
    places = (
        hub / f"datasets--{hub_id.replace('/', '--')}" / "snapshots",
        Path(ds_cache).expanduser() / hub_id.replace("/", "___"),
    )
    return any(p.is_dir() and any(p.iterdir()) for p in places)


def hub_dataset_errors(cfg: DictConfig, offline: bool, reachable: Any) -> list[str]:
    """Hub datasets not cached while the hub is off or unreachable; `reachable()` is the
    (shared, memoised) probe. All cached and unreachable: workers read the cache offline."""
    from pita.datasets.hub import SPECS

    wanted = []
    for ds_name, ds in _hub_datasets(cfg):
        if ds.path:
            continue  # local files (their first lines are checked by preflight)
        spec = SPECS.get(ds.name)
        hub_id = ds.hub_id or (spec.hub_id if spec else None)
        if hub_id:
            wanted.append((ds_name, str(hub_id), ds.cache_dir))
    if not wanted or (not offline and reachable()):
        return []
    why = "HF_HUB_OFFLINE is set" if offline else "huggingface.co cannot be reached"
    errors = [
        f"dataset={ds_name}: {hub_id} is not in the local cache and {why}; download it once "
        f"(hf download {hub_id} --repo-type dataset) or set dataset.path to local .jsonl files"
        for ds_name, hub_id, cache_dir in wanted
        if not dataset_cached(hub_id, cache_dir)
    ]
    if not errors and not offline:
        os.environ["HF_DATASETS_OFFLINE"] = "1"  # workers inherit it: no wait for the hub each
    return errors
