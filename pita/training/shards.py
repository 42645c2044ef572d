"""Sharded checkpoints: each rank of an FSDP2 gang writes the shards it holds, as safetensors.

A gathered checkpoint (`pita.training.ddp.FullState`) makes rank 0 hold the whole model
and optimizer state at every save; the models FSDP2 exists for, those that fit only
sharded, could not be checkpointed. Here every rank writes its own shards through torch's
distributed checkpoint (DCP) with the Hugging Face safetensors storage
(`torch.distributed.checkpoint.hf_storage`): `HuggingFaceStorageWriter(...,
save_distributed=True)` writes each rank's `shard-<r>-model-<i>-of-<n>.safetensors` (n
files of a few tensors each, `FILES`), whose headers record where each shard sits in its
full tensor (`DCP_SHARDING_INFO`: `saved_offsets`), and no `.metadata` at all; `HuggingFaceStorageReader` rebuilds DCP's
metadata from those headers, so DCP's pickled `.metadata` (read with `pickle.load`) is
never written nor read. DCP reshards on load: a checkpoint written by k ranks loads on
any k (1 included, no process group).

DCP writes tensors only (anything else would go through `torch.save`); the rest of an
optimizer's state (its param groups, scalar entries) travels as JSON with rank 0's
`state.json` (`ShardedState.tensors`). Before DCP reads a folder, `check_shards` proves the
headers: every byte range inside its file, none overlapping, and the shards of every
tensor tiling it exactly (no overlap, no gap, nothing past its shape) as rank 0 recorded
it; a forged header is refused, never trusted.

The final model of a sharded task (`save_consolidated`) goes the same way, then torch's
`consolidate_safetensors_files_on_every_rank` merges the shards into standard
safetensors file by file, tensor by tensor (one full tensor in memory at a time, never
the state): a Hugging Face folder `from_pretrained` loads.

The storage was private in earlier torch releases: `hf_storage()` detects it; where it
is missing the gang gathers as before (`pita.training.checkpoint.CheckpointPlan`).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import os
import shutil
import struct
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pita.core.parallel import Strategy

SHARDS = "shards"  # the subfolder of a checkpoint that holds the ranks' safetensors
# Each rank's shards go in files of about 1/FILES of the state (at least MIN_FILE bytes over
# the gang; a larger tensor alone in its file): DCP builds a whole file's bytes in memory
# (twice: each tensor's, then the file's) before writing it, so one file per rank would
# add twice the rank's shards to its peak (bench/checkpoint_memory.py).
FILES, MIN_FILE = 8, 64 << 20
MAX_HEADER = 100 << 20  # safetensors' own bound on a header (100 MB)
# bytes per element of each safetensors dtype (a dtype not listed is refused)
_DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip
# torch's dtype names -> safetensors' (a dtype not listed cannot be checkpointed sharded)
_TORCH_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
    "int32": "I32", "int16": "I16", "int8": "I8", "uint64": "U64", "uint32": "U32",
    "uint16": "U16", "uint8": "U8", "bool": "BOOL", "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}  # fmt: skip
_SEP = ":"  # an optimizer entry's key: "<parameter fqn>:<state name>" (fqns hold no colon)


def hf_storage() -> tuple[Any, Any, str] | None:
    """(writer class, reader class, the writer's "every rank saves its shard" keyword) of
    torch's safetensors storage for DCP, or None where the installed torch lacks it (it
    was private, `_hf_storage`, and named its flag `save_sharded`, in earlier releases)."""
    try:
        from torch.distributed.checkpoint import hf_storage as mod
    except ImportError:
        try:
            from torch.distributed.checkpoint import _hf_storage as mod
        except ImportError:
            return None
    writer = getattr(mod, "HuggingFaceStorageWriter", None) or getattr(
        mod, "_HuggingFaceStorageWriter", None
    )
    reader = getattr(mod, "HuggingFaceStorageReader", None) or getattr(
        mod, "_HuggingFaceStorageReader", None
    )
    if writer is None or reader is None:
        return None
    params = inspect.signature(writer.__init__).parameters
    flag = next((p for p in ("save_distributed", "save_sharded") if p in params), None)
    return (writer, reader, flag) if flag else None


def _in_gang() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def barrier() -> None:
    """Every rank of the gang waits here (no-op on one process)."""
    import torch.distributed as dist

    if _in_gang():
        dist.barrier()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns that it runs on one process when no process group exists: that is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to.*")
        yield


def write_shards(tensors: dict[str, Any], folder: Path) -> None:
    """Every rank writes the shards it holds of `tensors` (DTensors, or plain tensors that
    every rank holds alike: one rank writes those) into `folder`: a collective."""
    import torch.distributed.checkpoint as dcp

    found = hf_storage()
    assert found is not None, "write_shards needs torch's HuggingFaceStorageWriter"
    writer, _, flag = found
    kwargs: dict[str, Any] = {flag: True}
    if "fqn_to_index_mapping" in inspect.signature(writer.__init__).parameters:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        kwargs["fqn_to_index_mapping"] = _files_of(tensors, max(MIN_FILE, total // FILES))
    folder.mkdir(parents=True, exist_ok=True)
    with _quiet():
        dcp.save(tensors, storage_writer=writer(str(folder), **kwargs), no_dist=not _in_gang())


def read_shards(targets: dict[str, Any], folder: Path) -> None:
    """Fill `targets` (this rank's DTensors or whole tensors, by key) in place from the
    shards in `folder`, whatever k wrote them (call `check_shards` first): a collective."""
    import torch.distributed.checkpoint as dcp

    found = hf_storage()
    assert found is not None, "read_shards needs torch's HuggingFaceStorageReader"
    with _quiet():
        dcp.load(targets, storage_reader=found[1](str(folder)), no_dist=not _in_gang())


def index_of(tensors: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each tensor's full shape and safetensors dtype (a DTensor's global shape): what rank
    0 records so `check_shards` can prove the shards tile exactly these tensors."""
    return {
        k: {"shape": list(t.shape), "dtype": _TORCH_DTYPES[str(t.dtype).removeprefix("torch.")]}
        for k, t in tensors.items()
    }


# --- the state of a model / optimizer as shards ---------------------------------------------


class ShardedState:
    """A model's (or, with `optimizer`, its optimizer's) state for a `Checkpointer` as the
    shards this rank holds, keyed by parameter name (`get_model_state_dict` /
    `get_optimizer_state_dict` without gathering): `tensors()` for a save, `load_shards`
    after `read_shards` filled the targets. `load_state_dict` takes a full state (a
    gathered checkpoint, written by an older pita or a torch without the storage)."""

    def __init__(self, model: Any, optimizer: Any = None):
        self.model, self.optimizer = model, optimizer

    def tensors(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(this rank's tensors by key, the JSON-able rest: param groups, scalar entries)."""
        import torch
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        if self.optimizer is None:  # tied weights once: safetensors refuses shared storage
            return _unshared(get_model_state_dict(self.model)), {}
        osd = get_optimizer_state_dict(self.model, self.optimizer)
        tensors: dict[str, Any] = {}
        scalars: dict[str, Any] = {}
        for fqn, entries in osd["state"].items():
            for name, value in entries.items():
                key = f"{fqn}{_SEP}{name}"
                if isinstance(value, torch.Tensor):
                    tensors[key] = value
                else:
                    scalars[key] = value
        return tensors, {"param_groups": osd["param_groups"], "scalars": scalars}

    def load_shards(self, tensors: dict[str, Any], rest: dict[str, Any]) -> None:
        """Put the tensors `read_shards` filled (`tensors()`' keys) and the JSON `rest`
        into the model / optimizer."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        if self.optimizer is None:  # the keys `tensors()` gives (a tied weight's first name)
            set_model_state_dict(self.model, tensors, options=StateDictOptions(strict=False))
            return
        state: dict[str, dict[str, Any]] = {}
        for key, value in {**tensors, **rest.get("scalars", {})}.items():
            fqn, name = key.rsplit(_SEP, 1)
            state.setdefault(fqn, {})[name] = value
        osd = {"state": state, "param_groups": rest["param_groups"]}
        set_optimizer_state_dict(self.model, self.optimizer, osd)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A full (gathered) state, as `FullState` wrote it, into this rank's shards."""
        from pita.training.ddp import FullState

        FullState(self.model, self.optimizer).load_state_dict(state)


def _unshared(state: dict[str, Any]) -> dict[str, Any]:
    """`state` without the later names of a tensor met twice (tied weights: the embedding
    kept, `lm_head.weight` dropped, as `save_pretrained` writes it; safetensors refuses
    two names on one storage). Met twice: the same storage, offset and shape."""
    seen: set[tuple] = set()
    out = {}
    for key, value in state.items():
        local = value.to_local() if hasattr(value, "to_local") else value  # a DTensor's shard
        where = (
            (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(value.shape))
            if local.numel()
            else (id(value),)
        )
        if where not in seen:
            seen.add(where)
            out[key] = value
    return out


# --- proving the headers before DCP reads them ----------------------------------------------


def _header(path: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's header (JSON) and the length of its data section; ValueError if
    the header's length runs past the file or it is not a JSON object."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{path.name} is shorter than a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER or 8 + n > size:
            raise ValueError(f"{path.name}: its header runs past the file")
        header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise ValueError(f"{path.name}: its header is not a JSON object")
    return header, size - 8 - n


def _ints(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(type(v) is int and v >= 0 for v in value):
        raise ValueError(f"{what} is not a list of non-negative integers")
    return value


def _file_chunks(path: Path, index: dict[str, Any]) -> dict[str, tuple[list[int], list[int]]]:
    """{key: (offsets in the full tensor, shape)} of one shard file, once its byte ranges
    are proven: inside the data section, none overlapping, each its shape's size."""
    header, data_len = _header(path)
    meta = header.pop("__metadata__", None) or {}
    try:
        placed = json.loads(meta["DCP_SHARDING_INFO"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(
            f"{path.name}: no shard placement (DCP_SHARDING_INFO) in its header"
        ) from None
    ranges, chunks = [], {}
    for key, entry in header.items():
        if key not in index or not isinstance(entry, dict):
            raise ValueError(f"{path.name}: tensor {key!r} is not one this checkpoint holds")
        if entry.get("dtype") != index[key]["dtype"]:
            raise ValueError(
                f"{path.name}: {key} is {entry.get('dtype')}, not {index[key]['dtype']}"
            )
        shape = _ints(entry.get("shape"), f"{path.name}: {key}'s shape")
        begin, end = _ints(entry.get("data_offsets"), f"{path.name}: {key}'s data_offsets")[:2]
        if end > data_len or end - begin != math.prod(shape) * _DTYPE_BYTES[entry["dtype"]]:
            raise ValueError(f"{path.name}: {key}'s bytes run past the file or miss its shape")
        ranges.append((begin, end, key))
        offsets = _ints(
            (placed.get(key) or {}).get("saved_offsets"), f"{path.name}: {key}'s offsets"
        )
        chunks[key] = (offsets, shape)
    ranges.sort()
    for (_, end, key), (begin, _, other) in zip(ranges, ranges[1:]):
        if begin < end:
            raise ValueError(f"{path.name}: the bytes of {key} and {other} overlap")
    return chunks


def _overlap(a: tuple[list[int], list[int]], b: tuple[list[int], list[int]]) -> bool:
    """Two boxes (offsets, shape) of one tensor share an element."""
    return (
        all(oa < ob + sb and ob < oa + sa for oa, sa, ob, sb in zip(a[0], a[1], b[0], b[1]))
        and 0 not in a[1] + b[1]
    )


def check_shards(folder: Path, index: dict[str, Any]) -> str | None:
    """Why the shard files in `folder` may not be read into the tensors of `index`
    (`index_of`, recorded by rank 0), or None: a header whose byte ranges overlap or run
    past the file, a tensor not in the index, a shard placed past its tensor's shape or
    over another shard, a tensor not wholly covered (a shard missing)."""
    if not isinstance(index, dict) or not folder.is_dir():
        return "its shards or their index are missing"
    got: dict[str, list[tuple[list[int], list[int]]]] = {}
    try:
        for path in sorted(folder.iterdir()):
            if not path.name.endswith(".safetensors"):
                return f"{SHARDS}/{path.name} is not a shard"
            for key, chunk in _file_chunks(path, index).items():
                got.setdefault(key, []).append(chunk)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"a shard's header is refused ({exc})"
    for key, entry in index.items():
        full = entry["shape"]
        chunks = got.get(key, [])
        for offsets, shape in chunks:
            if len(offsets) != len(full) or len(shape) != len(full):
                return f"a shard of {key} has the wrong number of dimensions"
            if any(o + s > f for o, s, f in zip(offsets, shape, full)):
                return f"a shard of {key} lies past the tensor's shape {full}"
        if any(_overlap(a, b) for i, a in enumerate(chunks) for b in chunks[i + 1 :]):
            return f"two shards of {key} overlap"
        if sum(math.prod(s) for _, s in chunks) != math.prod(full):
            return f"the shards of {key} do not cover it (a shard is missing)"
    return None


# --- the final model, consolidated file by file ---------------------------------------------


def save_consolidated(model: Any, folder: Path, rank: int) -> None:
    """`model`'s weights (FSDP2 shards on every rank) as standard safetensors in `folder`
    (`model.safetensors`, or `model-0000i-of-0000n.safetensors` + the index JSON past
    5 GB), without gathering: every rank writes its shards, then the ranks merge them
    file by file (`consolidate_safetensors_files_on_every_rank`). A collective; rank 0
    writes the rest of the folder (config) after it."""
    from torch.distributed.checkpoint._consolidate_hf_safetensors import (
        consolidate_safetensors_files_on_every_rank,
    )
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = _unshared(get_model_state_dict(model))
    scratch = folder.parent / f".{folder.name}.shards"
    if rank == 0:
        shutil.rmtree(scratch, ignore_errors=True)
        folder.mkdir(parents=True, exist_ok=True)
    barrier()
    write_shards(state, scratch)
    mapping = _files_of(state, 5 << 30)
    with _quiet():
        consolidate_safetensors_files_on_every_rank(str(scratch), str(folder), mapping)
    if rank == 0:
        shutil.rmtree(scratch, ignore_errors=True)
        if max(mapping.values()) == 1:  # one file: the name from_pretrained looks for first
            os.replace(folder / "model-00001-of-00001.safetensors", folder / "model.safetensors")
            (folder / "model.safetensors.index.json").unlink(missing_ok=True)
    barrier()


def _files_of(state: dict[str, Any], budget: int) -> dict[str, int]:
    """Each tensor's output file (1..n), in order, a new file once `budget` bytes are full."""
    mapping, index, used = {}, 1, 0
    for key, t in state.items():
        size = t.numel() * t.element_size()
        if used and used + size > budget:
            index, used = index + 1, 0
        mapping[key] = index
        used += size
    return mapping


def sharded_model(dist: Any) -> bool:
    """The final model is written from each rank's shards (`save_consolidated`): an FSDP2
    gang of more than one rank, on a torch with the safetensors storage."""
    return (
        dist is not None
        and dist.world_size > 1
        and dist.gang.runs is Strategy.FSDP
        and hf_storage() is not None
    )


def save_hf_config(model: Any, folder: Path) -> None:
    """The rest of a `save_pretrained` folder beside consolidated weights, as
    `save_pretrained` writes it: `config.json` with the model's dtype and class (FSDP2's
    `FSDP<Class>` without its prefix) and the generation config of a model that generates."""
    config = model.config
    config.dtype = str(model.dtype).split(".")[1]
    config.architectures = [type(model).__name__.removeprefix("FSDP")]
    config.save_pretrained(folder)
    if model.can_generate():
        model.generation_config.save_pretrained(folder)
