"""Checkpoints inside a training task, so a retry or a resumed run continues mid-task.

A dead attempt's temporary folder is renamed `tasks/<id>.attemptN.failed/`, so the
checkpoints live beside it, in `tasks/<id>.checkpoints/` (`TaskPaths.checkpoints`), which
every attempt of the task sees; the worker removes it once the task is committed.

Hand-written loops (pretrain, value training) use `Checkpointer`. A stage unpacks its
context once into a `CheckpointPlan` (`pita.runtime.kit.checkpoint_plan(ctx)`: the task's
folder, `training.checkpoint_every*`, the task's identity, the state's format) and builds
from that value (`plan.checkpointer(logger)`, `plan.objects(model, optim)`):

    ckpt = Checkpointer(folder, every_steps, every_minutes, logger=log, identity=identity)
    start, extra = ckpt.restore(model=model, optimizer=optim, step=train_step, max_step=steps)
    for i in range(start, steps):
        ...
        ckpt.maybe_save(i + 1, lambda: dict(model=model, ...), extra=lambda: {"rng": rng.getstate()})

A checkpoint is a folder `step-<N>/`: `tensors.safetensors` (every tensor of the model,
optimizer, scheduler, the RNG streams...), `state.json` (everything else: the step, the
TrainStep's counter and metric rows, GradScaler and scheduler scalars, a `random.Random`
state) and, written last, `manifest.json` (the proof, see below). It is written to a
temporary folder and renamed, so a kill mid-write leaves the previous checkpoint intact.
Only the newest is kept. With the RNG streams restored the continued run computes what the
uninterrupted one would have.

**Nothing is unpickled.** A run folder may sit where others can write (a group's
project folder), so a checkpoint is data only: safetensors and JSON, never `torch.load`
of a pickle. A `step-N.pt` of an older pita is moved aside, never loaded. TRL checkpoints
hold torch pickles (`optimizer.pt`, `rng_state.pth`...) that transformers loads with
`weights_only=True`; pita checks each loads that way before the Trainer sees the folder,
and trains with `TORCH_FORCE_WEIGHTS_ONLY_LOAD=1`, so no pickle in them can run code.

**Every checkpoint carries its proof** (`manifest.json`, for TRL `pita_complete.json`):
the task id, a hash of the task's resolved config and of its inputs' manifests
(`identity`, see `pita.runtime.kit.checkpoint_identity`), the step and the sha256 of
every file. Restore verifies it; a checkpoint that does not verify (a flipped byte, a
truncated file, an extra or missing file), belongs to another task or config (copied
from a run with another seed), or lies past the schedule (step > max steps), or is a
link or owned / writable by others, is renamed `<name>.rejected/` with a WARNING in the
task log, and the task starts from the next older good one or from step 0. Restore runs
only when checkpointing is on.

TRL stages use the Trainer's own checkpoints (`resume_from_checkpoint`) in the same folder
(`trl_checkpoint_kwargs(folder, ...)`, `last_trl_checkpoint(folder, ...)`,
`checkpoint_commit_callback`, `time_checkpoint_callback`). The Trainer writes a
checkpoint's files one by one, so a checkpoint counts only once `pita_complete.json` was
written after it (atomically). It also holds the task's `train_log.jsonl` and metric rows
up to its step, which a resumed task replays so its log holds every step.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import stat
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_STEP_RE = re.compile(r"^step-(\d+)$")
_LEGACY_RE = re.compile(r"^step-(\d+)\.pt$")  # an older pita's pickle: never loaded
FORMAT = "pita-checkpoint-2"
FORMAT_SHARDED = "pita-checkpoint-3-sharded"  # + shards/: each rank's safetensors (FSDP2)
MANIFEST = "manifest.json"
TENSORS = "tensors.safetensors"
STATE = "state.json"
MAX_STATE_BYTES = 1 << 30  # state.json: metric rows of a long run, never more
FIRST_STEP = "step {} done"  # logged once per attempt (bench/growth.py times resizes by it)


# --- proof: manifests, verification, moving aside -------------------------------------------


def _listing(folder: Path, skip: str) -> dict[str, Path]:
    """Every file under `folder` by relative path (`skip` left out); a link or anything
    but a file or folder raises ValueError (a checkpoint holds neither)."""
    out: dict[str, Path] = {}
    for p in sorted(folder.rglob("*")):
        st = os.lstat(p)
        if stat.S_ISLNK(st.st_mode):
            raise ValueError(f"{p.relative_to(folder)} is a symbolic link")
        if stat.S_ISDIR(st.st_mode):
            continue
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{p.relative_to(folder)} is not a regular file")
        rel = p.relative_to(folder).as_posix()
        if rel != skip:
            out[rel] = p
    return out


def _sha256_safe(path: Path, trust_group: bool = False) -> str:
    """sha256 of a file opened like a control file (no link, regular, owned by you)."""
    import hashlib

    from pita.core.safe_files import open_control

    h = hashlib.sha256()
    with os.fdopen(open_control(path, os.O_RDONLY, trust_group=trust_group), "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def write_manifest(
    folder: Path, name: str, step: int, identity: dict[str, Any], **more: Any
) -> None:
    """The proof of a finished checkpoint folder, written last and atomically."""
    from pita.core.paths import atomic_write_json, file_sha256

    files = {rel: file_sha256(p) for rel, p in _listing(folder, name).items()}
    atomic_write_json(
        folder / name,
        {"format": FORMAT, **identity, "step": int(step), "files": files, **more},
    )


def check_manifest(
    folder: Path,
    name: str,
    step: int,
    identity: dict[str, Any],
    max_step: int | None = None,
    trust_group: bool = False,
    formats: tuple[str, ...] = (FORMAT,),
) -> str | None:
    """Why the checkpoint `folder` (named for `step`) may not be restored, or None
    (`trust_group`: files of your group's members count as yours, `system.trust_group`;
    `formats`: the manifest formats the reader knows)."""
    from pita.core.safe_files import UnsafeFile, check_folder, read_control

    try:
        check_folder(folder, trust_group)
        manifest = json.loads(read_control(folder / name, trust_group=trust_group))
        if not isinstance(manifest, dict) or manifest.get("format") not in formats:
            return f"its {name} is not a pita checkpoint manifest"
        if manifest.get("step") != step:
            return f"its manifest says step {manifest.get('step')}, its name step {step}"
        if max_step is not None and step > max_step:
            return f"step {step} is past the schedule ({max_step} steps)"
        for key, value in identity.items():
            if manifest.get(key) != value:
                return f"it belongs to another task or config ({key} differs)"
        listed = manifest.get("files")
        present = _listing(folder, name)
        if not isinstance(listed, dict) or set(listed) != set(present):
            return "its files are not those its manifest lists"
        for rel, p in present.items():
            if _sha256_safe(p, trust_group) != listed[rel]:
                return f"{rel} does not match its sha256 (corrupt or truncated)"
    except FileNotFoundError:
        return f"it has no {name} (not written by pita, or half-written)"
    except (UnsafeFile, OSError, ValueError, UnicodeDecodeError) as exc:
        return str(exc)
    return None


def move_aside(path: Path, why: str, logger: logging.Logger) -> None:
    """Rename a checkpoint that will not be restored to `<name>.rejected` (kept for a look,
    never read again) and say so in the task log."""
    target = path.with_name(path.name + ".rejected")
    k = 1
    while os.path.lexists(target):
        k += 1
        target = path.with_name(f"{path.name}.rejected{k}")
    try:
        os.rename(path, target)
    except OSError as exc:  # cannot rename: remove it, a bad checkpoint must not stay in the way
        logger.warning("rejected checkpoint %s: %s (not renamed: %s)", path, why, exc)
        if path.is_symlink() or not path.is_dir():
            path.unlink(missing_ok=True)
        else:
            shutil.rmtree(path, ignore_errors=True)
        return
    logger.warning(
        "rejected checkpoint %s: %s; moved aside to %s, not restored", path, why, target.name
    )


def _usable_folder(
    folder: Path, logger: logging.Logger, writer: bool, trust_group: bool = False
) -> bool:
    """The checkpoints folder is a real folder of yours: else (a link, another user's,
    writable by all) it is moved aside (writer) and nothing in it is read."""
    from pita.core.safe_files import UnsafeFile, check_folder

    try:
        check_folder(folder, trust_group)
    except UnsafeFile as exc:
        if writer:
            move_aside(folder, str(exc), logger)
        return False
    return folder.is_dir()


# --- tensors + JSON, no pickle --------------------------------------------------------------


def _encode(obj: Any, tensors: dict[str, Any]) -> Any:
    """A JSON-able copy of `obj` with every tensor replaced by a key into `tensors`."""
    import torch

    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = obj.detach().cpu().contiguous().clone()
        return {"__tensor__": key}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if type(obj).__module__ == "numpy" and hasattr(obj, "item"):
        return _encode(obj.item(), tensors)
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, tensors) for v in obj]}
    if isinstance(obj, list):
        return [_encode(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: _encode(v, tensors) for k, v in obj.items()}
        return {"__items__": [[_encode(k, tensors), _encode(v, tensors)] for k, v in obj.items()]}
    raise TypeError(f"a checkpoint holds tensors and JSON values, not a {type(obj).__name__}")


def _decode(obj: Any, tensors: dict[str, Any]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if "__tuple__" in obj:
        return tuple(_decode(v, tensors) for v in obj["__tuple__"])
    if "__items__" in obj:
        return {_decode(k, tensors): _decode(v, tensors) for k, v in obj["__items__"]}
    return {k: _decode(v, tensors) for k, v in obj.items()}


def save_state(folder: Path, state: dict[str, Any]) -> None:
    """`state` as `tensors.safetensors` + `state.json` in `folder` (fsynced)."""
    from safetensors.torch import save_file

    tensors: dict[str, Any] = {}
    encoded = _encode(state, tensors)
    save_file(tensors, str(folder / TENSORS))
    with open(folder / STATE, "w") as f:
        json.dump(encoded, f)
    for name in (TENSORS, STATE):
        fd = os.open(folder / name, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def load_state(folder: Path, trust_group: bool = False) -> dict[str, Any]:
    """What `save_state` wrote (call after `check_manifest`): no pickle is involved."""
    from safetensors.torch import load_file

    from pita.core.safe_files import read_control

    tensors = load_file(str(folder / TENSORS), device="cpu")
    state = read_control(folder / STATE, MAX_STATE_BYTES, trust_group)
    return _decode(json.loads(state), tensors)


def rank_zero_says(*flags: bool) -> tuple[bool, ...]:
    """`flags` as rank 0 of the process group has them (a broadcast; the flags themselves
    outside a gang): what every rank decides together, e.g. to stop at a checkpoint."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return tuple(bool(f) for f in flags)
    packed = torch.tensor([int(f) for f in flags])
    if dist.get_backend() == "nccl":  # NCCL moves device tensors only
        packed = packed.to(f"cuda:{torch.cuda.current_device()}")
    dist.broadcast(packed, src=0)
    return tuple(bool(v) for v in packed.tolist())


def rank_zero_int(value: int) -> int:
    """`value` as rank 0 of the process group has it (a broadcast; itself outside a gang)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return int(value)
    packed = torch.tensor([int(value)], dtype=torch.long)
    if dist.get_backend() == "nccl":
        packed = packed.to(f"cuda:{torch.cuda.current_device()}")
    dist.broadcast(packed, src=0)
    return int(packed.item())


def any_rank(flag: bool) -> bool:
    """`flag` is true on some rank of the process group (an all-reduce; itself outside one)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return bool(flag)
    packed = torch.tensor([int(flag)])
    if dist.get_backend() == "nccl":
        packed = packed.to(f"cuda:{torch.cuda.current_device()}")
    dist.all_reduce(packed, op=dist.ReduceOp.MAX)
    return bool(packed.item())


# --- sharded checkpoints (FSDP2: pita.training.shards) -------------------------------------

_FORMATS = (FORMAT, FORMAT_SHARDED)


def _shards_refused(path: Path, trust_group: bool = False) -> str | None:
    """Why the shards of a verified checkpoint may not be read (`check_shards`: headers,
    placement, coverage against rank 0's index), or None; None for a gathered one."""
    from pita.core.safe_files import read_control
    from pita.training.shards import SHARDS, check_shards, hf_storage

    if not os.path.lexists(path / SHARDS):
        return None  # gathered: tensors.safetensors holds everything (a stray index: `_load`)
    try:
        state = json.loads(read_control(path / STATE, MAX_STATE_BYTES, trust_group))
    except (OSError, ValueError) as exc:
        return f"its {STATE} is unreadable ({exc})"
    if not isinstance(state, dict) or "shard_index" not in state:
        return f"its {SHARDS}/ has no index in {STATE}"
    if hf_storage() is None:
        return "it is sharded and this torch lacks the safetensors storage to read it"
    return check_shards(path / SHARDS, state["shard_index"])


def _load_shards(state: dict[str, Any], objects: dict[str, Any], path: Path) -> None:
    """Read a sharded checkpoint's shards into its `ShardedState` objects (every rank, its
    own shards, whatever k wrote them) and give each its JSON rest; ValueError when the
    objects are not those the checkpoint holds."""
    from pita.training.shards import SHARDS, ShardedState, read_shards

    rests = state.get("sharded") or {}
    targets: dict[str, dict[str, Any]] = {}
    for name in rests:
        obj = objects.get(name)
        if not isinstance(obj, ShardedState):
            raise ValueError(f"it holds the shards of {name!r}, which this task does not shard")
        targets[name] = obj.tensors()[0]
    flat = {f"{name}/{k}": v for name, mine in targets.items() for k, v in mine.items()}
    if set(flat) != set(state["shard_index"]):
        raise ValueError("its tensors are not this model's and optimizer's")
    read_shards(flat, path / SHARDS)
    for name, mine in targets.items():
        objects[name].load_shards(mine, rests[name])


class _Built:
    """A state already built (on every rank of a gang) that `save` writes as it is."""

    def __init__(self, state: dict[str, Any]):
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return self.state


class Checkpointer:
    def __init__(
        self,
        folder: Path | str,
        every_steps: int = 0,
        every_minutes: float = 0.0,
        *,
        writer: bool = True,
        logger: logging.Logger | None = None,
        identity: dict[str, Any] | None = None,
        trust_group: bool = False,
        collective: bool = False,
        stop_file: Path | str | None = None,
    ):
        self.folder = Path(folder)
        # the orchestrator asks the task to checkpoint and stop by creating this file
        # (`TaskPaths.stop_request`): checked after each optimizer step, rank 0 decides
        self.stop_file = Path(stop_file) if stop_file is not None else None
        self.max_step: int | None = None  # the schedule's length (from `restore`)
        self._stepped = False  # maybe_save was called once (an optimizer step was taken)
        # a gang: building the objects' state is a collective (FSDP2 gathers its shards), so
        # every rank builds it when a save is due, and rank 0's clock decides when that is
        self.collective = collective
        self.trust_group = trust_group  # system.trust_group: a teammate's checkpoints count
        self.every_steps = int(every_steps)
        self.every_s = float(every_minutes) * 60.0
        self.writer = writer  # rank 0 of a data-parallel gang writes; every rank restores
        self.logger = logger or log
        self.identity = dict(identity or {})  # task id, config and inputs hashes
        self._last_save = time.monotonic()
        self.saved: list[int] = []

    @property
    def enabled(self) -> bool:
        return self.every_steps > 0 or self.every_s > 0

    def _found(self) -> list[tuple[int, Path]]:
        """`step-N/` folders, newest first; an older pita's `step-N.pt` pickles are moved
        aside (writer), never loaded."""
        found = []
        for p in self.folder.iterdir():
            if m := _STEP_RE.match(p.name):
                found.append((int(m.group(1)), p))
            elif _LEGACY_RE.match(p.name) and self.writer:
                move_aside(p, "a pickle (pita never unpickles a checkpoint)", self.logger)
        return sorted(found, reverse=True)

    def latest(self, max_step: int | None = None) -> tuple[int, Path] | None:
        """The newest checkpoint that verifies; the bad ones met on the way are moved aside."""
        if not _usable_folder(self.folder, self.logger, self.writer, self.trust_group):
            return None
        for n, path in self._found():
            why = check_manifest(
                path, MANIFEST, n, self.identity, max_step, self.trust_group, _FORMATS
            )
            why = why or _shards_refused(path, self.trust_group)
            if why is None:
                return n, path
            if self.writer:
                move_aside(path, why, self.logger)
        return None

    # -- restore --------------------------------------------------------------------------
    def restore(
        self, *, step: Any = None, max_step: int | None = None, **objects: Any
    ) -> tuple[int, dict[str, Any]]:
        """Load the newest good checkpoint into `objects` (anything with `load_state_dict`)
        and the TrainStep `step`; -> (optimizer steps done, the loop's extra state).
        (0, {}) if none, or when checkpointing is off and the task cannot be asked to stop
        (a stopped task resumes from the checkpoint it stopped at whatever the interval).
        `max_step`: the schedule's length."""
        self.max_step = max_step
        if not self.enabled and self.stop_file is None:
            return 0, {}
        latest = self._agreed_latest(max_step)
        if latest is None:
            return 0, {}
        n, path = latest
        state, unreadable = None, None
        try:
            state = load_state(path, self.trust_group)
        except Exception as exc:  # noqa: BLE001 - verified, yet unreadable: start over
            unreadable = exc
        if self._any_rank(unreadable is not None):  # the gang starts over together
            if self.writer:
                move_aside(path, f"unreadable ({unreadable or 'on another rank'})", self.logger)
            return 0, {}
        assert state is not None
        try:
            self._load(n, state, step, objects, path)
        except Exception as exc:  # verified, yet not this model's (a forged proof): never again
            if self.writer:
                move_aside(path, f"does not fit this task ({exc})", self.logger)
            raise RuntimeError(
                f"checkpoint {path} could not be restored ({exc}); it was moved aside, a retry "
                f"starts without it"
            ) from exc
        self.logger.info("resumed from checkpoint %s (step %d)", path, n)
        self._last_save = time.monotonic()
        return n, state.get("extra", {})

    def _agreed_latest(self, max_step: int | None) -> tuple[int, Path] | None:
        """`latest`, as rank 0 finds it on a gang (the ranks must load the same checkpoint:
        a sharded load is a collective); rank 0 alone verifies and moves aside."""
        if not self.collective:
            return self.latest(max_step)
        found = self.latest(max_step) if self.writer else None
        n = rank_zero_int(found[0] if found else -1)
        if n < 0:
            return None
        return found if found is not None else (n, self.folder / f"step-{n}")

    def _any_rank(self, flag: bool) -> bool:
        """`flag` on any rank of the gang (an all-reduce; the flag itself on one process)."""
        return any_rank(flag) if self.collective else flag

    @staticmethod
    def _load(
        n: int, state: dict[str, Any], step: Any, objects: dict[str, Any], path: Path
    ) -> None:
        """Put a loaded checkpoint into the objects, the TrainStep and torch's RNG."""
        import torch

        if "shard_index" in state:  # every rank reads its shards (a collective)
            _load_shards(state, objects, path)
        for name, obj in objects.items():
            if obj is not None and name in state:
                obj.load_state_dict(state[name])
        if step is not None:
            step.step = int(state["train_step"])
            step.metrics.rows = list(state.get("metric_rows", []))
            if state.get("scaler") is not None and step.scaler.is_enabled():
                step.scaler.load_state_dict(state["scaler"])
            tracker = getattr(step.metrics, "tracker", None)
            if tracker is not None:
                tracker.start_step = n
        torch.set_rng_state(state["torch_rng"])
        if state.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])

    # -- save -----------------------------------------------------------------------------
    def due(self, n: int) -> bool:
        if self.every_steps > 0 and n % self.every_steps == 0:
            return True
        return self.every_s > 0 and time.monotonic() - self._last_save >= self.every_s

    def maybe_save(
        self,
        n: int,
        objects: Callable[[], dict[str, Any]],
        *,
        step: Any = None,
        extra: Callable[[], dict[str, Any]] | None = None,
    ) -> bool:
        """Save after optimizer step `n` when due (`objects()` / `extra()` are only built then).

        `collective`: every rank calls this; each builds `objects()`' state when due, the
        writer saves it (`ShardedState` objects: each rank writes its own shards). When the
        orchestrator asked the task to stop (`stop_file`) and steps remain, the checkpoint is written whether due or not and every rank raises
        `StoppedAtCheckpoint` (rank 0 decides for the gang, so all stop at the same step)."""
        from pita.core.errors import StoppedAtCheckpoint
        from pita.training.shards import ShardedState

        if not self._stepped and self.writer:  # the time a start or a resize costs ends here
            self.logger.info("%s: the first optimizer step of this attempt", FIRST_STEP.format(n))
        self._stepped = True
        if self.collective:
            due, stop = self._decide_on_every_rank(n)
            if not (due or stop):
                return False
            built = {k: v for k, v in objects().items() if v is not None}
            if any(isinstance(v, ShardedState) for v in built.values()):  # every rank writes
                self.save(n, built, step=step, extra=extra() if extra and self.writer else {})
            else:  # every rank builds the state (FSDP2 gathers: a collective), rank 0 writes
                state = {k: v.state_dict() for k, v in built.items()}
                if self.writer:
                    self.save(
                        n,
                        {k: _Built(v) for k, v in state.items()},
                        step=step,
                        extra=extra() if extra else {},
                    )
        else:
            due, stop = self.due(n), self._stop_asked(n)
            if not self.writer or not (due or stop):
                return False
            self.save(n, objects(), step=step, extra=extra() if extra else {})
        if stop:
            self.logger.info("stopping at the checkpoint of step %d, as the run asked", n)
            raise StoppedAtCheckpoint(n)
        return self.writer

    def _stop_asked(self, n: int) -> bool:
        """The stop request exists and step `n` is not the schedule's last (a finished
        schedule just finishes)."""
        if self.stop_file is None or (self.max_step is not None and n >= self.max_step):
            return False
        return os.path.exists(self.stop_file)

    def _decide_on_every_rank(self, n: int) -> tuple[bool, bool]:
        """(`due(n)`, stop asked) as rank 0 sees them: a time-based interval or the stop
        request may differ between ranks, so rank 0's answer is broadcast (one tiny
        collective per step; none when the interval counts steps only and no stop can come)."""
        if self.every_s <= 0 and self.stop_file is None:
            return self.due(n), False  # steps only: the same on every rank
        due, stop = rank_zero_says(self.due(n), self._stop_asked(n))
        return due, stop

    def save(
        self,
        n: int,
        objects: dict[str, Any],
        *,
        step: Any = None,
        extra: dict[str, Any] | None = None,
    ) -> Path | None:
        """Write checkpoint `step-<n>/` (the writer; with `ShardedState` objects every rank
        calls this and writes its shards) and keep only it; -> its folder (None off rank 0)."""
        from pita.training.shards import ShardedState

        if any(isinstance(v, ShardedState) for v in objects.values()):
            return self._save_sharded(n, objects, step=step, extra=extra)
        state = self._state(objects, step, extra)
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.folder / f".step-{n}.{os.getpid()}.tmp"
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            save_state(tmp, state)
            return self._commit(tmp, n, FORMAT)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _save_sharded(
        self, n: int, objects: dict[str, Any], *, step: Any, extra: dict[str, Any] | None
    ) -> Path | None:
        """Every rank writes the shards it holds of the `ShardedState` objects into
        `shards/` of the temporary folder (DCP, safetensors, no `.metadata`); then rank 0
        writes the rest (`state.json`, the shards' index) and the proof over every file,
        and renames the folder. Collectives: every rank calls this at the same step."""
        from pita.training.shards import SHARDS, ShardedState, barrier, index_of, write_shards

        tensors: dict[str, Any] = {}
        rests: dict[str, Any] = {}
        for name, obj in objects.items():
            if isinstance(obj, ShardedState):
                mine, rests[name] = obj.tensors()
                tensors.update({f"{name}/{k}": v for k, v in mine.items()})
        tmp = self.folder / f".step-{n}.shards.tmp"  # one name for the gang (rank 0's pid differs)
        if self.writer:
            self.folder.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / SHARDS).mkdir(parents=True)
        barrier()
        final = None
        try:
            write_shards(tensors, tmp / SHARDS)
            if self.writer:
                rest = {k: v for k, v in objects.items() if not isinstance(v, ShardedState)}
                state = self._state(rest, step, extra)
                state.update(sharded=rests, shard_index=index_of(tensors))
                save_state(tmp, state)
                final = self._commit(tmp, n, FORMAT_SHARDED)
        except BaseException:
            if self.writer:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        barrier()  # the checkpoint is committed before any rank moves on (or stops)
        return final

    def _state(
        self, objects: dict[str, Any], step: Any, extra: dict[str, Any] | None
    ) -> dict[str, Any]:
        """What rank 0 writes: the objects' state, torch's RNG streams, the loop's extra
        state and the TrainStep's counter, metric rows and GradScaler."""
        import torch

        if step is not None and hasattr(step, "flush"):
            step.flush()  # steps not read back yet (training.sync_every) belong in the checkpoint
        state: dict[str, Any] = {
            name: obj.state_dict() for name, obj in objects.items() if obj is not None
        }
        state["torch_rng"] = torch.get_rng_state()
        state["cuda_rng"] = (
            torch.cuda.get_rng_state_all()
            if torch.cuda.is_available() and torch.cuda.is_initialized()
            else None
        )
        state["extra"] = extra or {}
        if step is not None:
            state["train_step"] = step.step
            state["metric_rows"] = step.metrics.rows
            state["scaler"] = step.scaler.state_dict() if step.scaler.is_enabled() else None
        return state

    def _commit(self, tmp: Path, n: int, fmt: str) -> Path:
        """The proof over every file of the finished `tmp`, then `tmp` renamed `step-<n>`
        and the older checkpoints removed."""
        from pita.core.paths import follow_umask

        final = self.folder / f"step-{n}"
        write_manifest(tmp, MANIFEST, n, self.identity, format=fmt)
        follow_umask(tmp)  # safetensors writes 0600: a teammate's resume must read it
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        for p in self.folder.iterdir():  # keep only the newest
            m = _STEP_RE.match(p.name)
            if m and int(m.group(1)) != n:
                shutil.rmtree(p, ignore_errors=True)
        self._last_save = time.monotonic()
        self.saved.append(n)
        self.logger.info("checkpoint: step %d -> %s", n, final)
        return final


# --- TRL / transformers Trainer -------------------------------------------------------------


COMPLETE = (
    "pita_complete.json"  # the proof, written atomically once a Trainer checkpoint is complete
)
TRAIN_LOG = "pita_train_log.jsonl"  # the task's train_log.jsonl up to the checkpoint's step
METRIC_ROWS = "pita_metric_rows.json"  # the TrainingMetrics rows up to the checkpoint's step
LOOP_STATE = "pita_loop_state.json"  # the Trainer's running loss sums (for train_loss, logs)
_NOT_KEPT = ("training_args.bin",)  # a full pickle pita never loads: not kept in a checkpoint
_PICKLES = (".pt", ".pth", ".bin")


@dataclass(frozen=True)
class CheckpointPlan:
    """How a task checkpoints, as values: its folder, how often (steps, minutes; 0 = off),
    what its checkpoints must carry (`identity`), whose files count as its own
    (`trust_group`) and the state's format (`by_name`: a gang strategy's full state keyed by
    parameter name, so k ranks resume on any k). A stage builds it once from its context
    (`pita.runtime.kit.checkpoint_plan`); its loop and its Trainer take it from there."""

    folder: Path
    every_steps: int = 0
    every_minutes: float = 0.0
    identity: Mapping[str, str] = field(default_factory=dict)
    trust_group: bool = False
    by_name: bool = False
    stop_file: Path | None = None  # the run asks the task to checkpoint and stop (growth)
    sharded: bool = False  # FSDP2: each rank writes its own shards (`pita.training.shards`)

    def checkpointer(
        self, logger: logging.Logger | None = None, *, writer: bool = True, collective: bool = False
    ) -> Checkpointer:
        """A hand-written loop's `Checkpointer` (`writer`: rank 0 of a gang writes, every
        rank restores; `collective`: a gang's ranks all build the state when a save is due).
        A sharded plan on a torch without the safetensors storage says once that the gang
        gathers instead."""
        if self.sharded and writer and not self.shards:
            (logger or log).info(
                "checkpoints: this torch has no safetensors storage for DCP "
                "(torch.distributed.checkpoint.hf_storage): the gang gathers the state and "
                "rank 0 writes it"
            )
        return Checkpointer(
            self.folder,
            self.every_steps,
            self.every_minutes,
            writer=writer,
            logger=logger,
            identity=dict(self.identity),
            trust_group=self.trust_group,
            collective=collective,
            stop_file=self.stop_file,
        )

    @property
    def shards(self) -> bool:
        """Each rank writes its shards: a sharded plan, and torch has the storage for it."""
        from pita.training.shards import hf_storage

        return self.sharded and hf_storage() is not None

    def objects(self, model: Any, optimizer: Any) -> tuple[Any, Any]:
        """What the `Checkpointer` saves and restores for a model and its optimizer: under
        FSDP2 (`shards`) the shards each rank holds (`pita.training.shards.ShardedState`),
        under another gang strategy their full state by parameter name
        (`pita.training.ddp.FullState`), whatever k (1 included), else the objects
        themselves (a one-process task's format)."""
        if not self.by_name:
            return model, optimizer
        if self.shards:
            from pita.training.shards import ShardedState

            return ShardedState(model), ShardedState(model, optimizer)
        from pita.training.ddp import FullState

        return FullState(model), FullState(model, optimizer)

    def trl_kwargs(self) -> dict[str, Any]:
        """TrainingArguments checkpoint fields (`trl_checkpoint_kwargs`); with a stop channel
        the Trainer can save when asked even with checkpoints off (`stop_callback`)."""
        return trl_checkpoint_kwargs(
            self.folder, self.every_steps, self.every_minutes, on_request=self.stop_file is not None
        )

    @property
    def on_request_only(self) -> bool:
        """Checkpoints off, but the run may ask the task to stop at one (growth)."""
        return self.stop_file is not None and self.every_steps <= 0 and self.every_minutes <= 0

    def last_trl(
        self, max_step: int | None = None, logger: logging.Logger | None = None
    ) -> str | None:
        """The newest Trainer checkpoint whose proof verifies (`last_trl_checkpoint`)."""
        return last_trl_checkpoint(
            self.folder, dict(self.identity), max_step, logger, trust_group=self.trust_group
        )


def trl_checkpoint_kwargs(
    folder: Path | str, every: int, minutes: float, on_request: bool = False
) -> dict[str, Any]:
    """TrainingArguments fields for checkpoints every `every` steps (or `minutes`, or only
    when the run asks: `on_request`) into `folder`; none when all are off. The Trainer keeps
    every checkpoint (`save_total_limit=None`): `checkpoint_commit_callback` marks a finished
    one and only then deletes the older ones, so a kill mid-save leaves a usable checkpoint."""
    if every <= 0 and minutes <= 0 and not on_request:
        return {"save_strategy": "no"}
    kwargs: dict[str, Any] = {
        "output_dir": str(folder),
        "save_total_limit": None,
        "save_only_model": False,
    }
    if every > 0:
        kwargs.update(save_strategy="steps", save_steps=every)
    else:  # time or request only: TimeCheckpointCallback / StopAtCheckpoint ask for the saves
        kwargs.update(save_strategy="steps", save_steps=10**9)
    return kwargs


def _trl_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    if not folder.is_dir():
        return []
    return sorted(
        (int(m.group(1)), p)
        for p in folder.iterdir()
        if (m := re.match(r"^checkpoint-(\d+)$", p.name))
    )


def _pickles_load_safely(folder: Path) -> str | None:
    """Why a torch pickle in a Trainer checkpoint would not load with `weights_only=True`
    (transformers' own allow-list for numpy RNG states), or None. Checked before the
    Trainer sees the folder: a planted pickle is refused here, it never runs. DCP files
    (accelerate's FSDP `SHARDED_STATE_DICT`: `.metadata` + `*.distcp`) are refused
    outright: pita's TRL stages save FSDP's full state (`trl_common.fsdp_kwargs`)."""
    import torch
    from transformers.trainer_pt_utils import safe_globals

    for p in sorted(folder.rglob("*")):
        if p.name == ".metadata" or p.suffix == ".distcp":  # accelerate's SHARDED_STATE_DICT
            return (
                f"{p.relative_to(folder)} is a torch.distributed.checkpoint file (its .metadata "
                "is a pickle DCP reads with pickle.load), never read"
            )
        if p.suffix in _PICKLES and p.is_file():
            try:
                with safe_globals():
                    # mmap: the storages are mapped, not read (optimizer.pt of a large model)
                    torch.load(p, map_location="cpu", weights_only=True, mmap=True)
            except Exception as exc:  # noqa: BLE001 - any failure: not a checkpoint to trust
                # torch's message advises weights_only=False: keep only what it refused
                lines = [ln.strip() for ln in str(exc).splitlines() if "Unpickler" in ln]
                what = lines[0].split(". ")[0][:200] if lines else type(exc).__name__
                return f"{p.name} does not load as plain tensors, never unpickled ({what})"
    return None


def last_trl_checkpoint(
    folder: Path | str,
    identity: dict[str, Any] | None = None,
    max_step: int | None = None,
    logger: logging.Logger | None = None,
    trust_group: bool = False,
) -> str | None:
    """The newest Trainer checkpoint in `folder` whose proof verifies (see the module);
    folders a kill left half-written (no marker, newer than the newest committed one) are
    removed, bad ones moved aside with a WARNING."""
    logger = logger or log
    folder = Path(folder)
    if not _usable_folder(folder, logger, True, trust_group):
        return None
    found = _trl_checkpoints(folder)
    committed = [n for n, p in found if os.path.lexists(p / COMPLETE)]
    newest = max(committed, default=-1)
    for n, p in reversed(found):
        if n > newest:  # half-written by a dead attempt: the Trainer would trip over it
            shutil.rmtree(p, ignore_errors=True)
            continue
        why = check_manifest(p, COMPLETE, n, dict(identity or {}), max_step, trust_group)
        why = why or _pickles_load_safely(p)
        if why is None:
            return str(p)
        move_aside(p, why, logger)
    return None


def restore_trl_logs(checkpoint: Path | str, train_log: Path, metrics: Any = None) -> None:
    """Replay a checkpoint's `train_log.jsonl` and metric rows into the resumed attempt,
    so its log holds every step (the Trainer's own `log_history` is in trainer_state.json)."""
    checkpoint = Path(checkpoint)
    if (checkpoint / TRAIN_LOG).is_file():
        shutil.copyfile(checkpoint / TRAIN_LOG, train_log)
    if metrics is not None and (checkpoint / METRIC_ROWS).is_file():
        metrics.rows = list(json.loads((checkpoint / METRIC_ROWS).read_text()))


# TRL's own running counters that its checkpoints lack (DPO's logged num_tokens is cumulative)
_COUNTERS = ("_total_train_tokens",)


def _loop_state(trainer: Any) -> dict[str, Any] | None:
    """The Trainer's running sums, which `train()` resets and a checkpoint lacks, as the
    gang's (so a resume on any k logs what the uninterrupted run logs): the sum behind
    `train_loss`; the loss not logged yet, averaged over the ranks as the Trainer's own log
    does (each rank holds its share's: rank 0's alone is not the gang's); the step of the
    last log; TRL's per-step metrics not logged yet (`_metrics["train"]`, each already the
    gang's: TRL gathers them), which the next log averages. Called on every rank of a gang
    (the mean is a collective)."""
    try:
        from transformers.trainer_pt_utils import nested_gather

        pending = nested_gather(trainer._tr_loss.detach().clone(), trainer.args.parallel_mode)
        state = {
            "total_loss_scalar": float(trainer._total_loss_scalar),
            "tr_loss": float(pending.mean().item()),
            "globalstep_last_logged": int(trainer._globalstep_last_logged),
        }
    except (AttributeError, ImportError):  # another transformers: resumed part only
        return None
    counters = {k: getattr(trainer, k) for k in _COUNTERS if hasattr(trainer, k)}
    metrics = getattr(trainer, "_metrics", None)
    unlogged = metrics.get("train", {}) if isinstance(metrics, dict) else {}
    return {**state, "counters": counters, "metrics": {k: list(v) for k, v in unlogged.items()}}


def resume_loop_callback(trainer: Any, checkpoint: Path | str):
    """A TrainerCallback giving a resumed `train()` the loss sums and TRL's unlogged
    metrics of the checkpoint (it starts them from zero), so `train_loss` and the first log
    after the resume are those of the uninterrupted run, over every step, on any k."""
    import torch
    from transformers import TrainerCallback

    path = Path(checkpoint) / LOOP_STATE
    saved = json.loads(path.read_text()) if path.is_file() else None

    class ResumeLoop(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            if not saved or not hasattr(trainer, "_tr_loss"):
                return
            trainer._total_loss_scalar = float(saved["total_loss_scalar"])
            trainer._tr_loss = torch.full_like(trainer._tr_loss, float(saved["tr_loss"]))
            trainer._globalstep_last_logged = int(saved["globalstep_last_logged"])
            trainer._initial_global_step = 0  # train_loss: the mean over every step
            for key, value in (saved.get("counters") or {}).items():
                if key in _COUNTERS:
                    setattr(trainer, key, value)
            metrics = getattr(trainer, "_metrics", None)
            if isinstance(metrics, dict) and "train" in metrics:  # TRL's, not logged yet
                metrics["train"].update({k: list(v) for k, v in saved.get("metrics", {}).items()})

    return ResumeLoop()


def resume_guard(checkpoint: str | None, logger: logging.Logger):
    """A TrainerCallback and context manager around the resumed `train()`: if it fails
    before training begins (a checkpoint with a forged proof that is not this model's, or
    that the Trainer cannot load), the checkpoint is moved aside, so the retry starts
    without it instead of failing on it for ever. Out-of-memory is not its fault."""
    from transformers import TrainerCallback

    class ResumeGuard(TrainerCallback):
        began = False

        def on_train_begin(self, args, state, control, **kwargs):
            self.began = True

        def __enter__(self):
            return self

        def __exit__(self, kind, exc, _tb):
            oom = kind is not None and "out of memory" in str(exc).lower()
            if checkpoint and isinstance(exc, Exception) and not self.began and not oom:
                first = (str(exc).strip().splitlines() or [kind.__name__])[0][:200]
                move_aside(
                    Path(checkpoint), f"the Trainer could not resume from it ({first})", logger
                )
            return False

    return ResumeGuard()


def finish_from_checkpoint(trainer: Any, checkpoint: Path | str) -> None:
    """A checkpoint at the schedule's last step: load its model and Trainer state and log
    the end-of-training line `train()` would have (train_loss over every step), without
    `train()`, which would run one optimizer step past `max_steps`."""
    from transformers import TrainerState

    checkpoint = Path(checkpoint)
    trainer._load_from_checkpoint(str(checkpoint))
    trainer.state = TrainerState.load_from_json(str(checkpoint / "trainer_state.json"))
    path = checkpoint / LOOP_STATE
    saved = json.loads(path.read_text()) if path.is_file() else None
    steps = max(trainer.state.global_step, 1)
    end: dict[str, float] = {"train_runtime": 0.0, "total_flos": trainer.state.total_flos}
    if saved:
        end["train_loss"] = (saved["total_loss_scalar"] + saved["tr_loss"]) / steps
    trainer.log(end)


def checkpoint_commit_callback(
    identity: dict[str, Any] | None = None,
    train_log: Path | None = None,
    metrics: Any = None,
    trainer: Any = None,
):
    """A TrainerCallback: after the Trainer finished writing checkpoint-N, add the task's
    train log, metric rows and the Trainer's loss sums so far (`_loop_state`: every rank
    takes part, so every rank must save at the same steps), drop `training_args.bin` (a
    pickle), write the proof atomically, then delete every older checkpoint (only the
    newest complete one is kept)."""
    from transformers import TrainerCallback

    from pita.core.paths import atomic_write_json, follow_umask

    class CheckpointCommit(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            # every rank: the gang's mean of the loss not logged yet is a collective
            loop = _loop_state(trainer) if trainer is not None else None
            if not state.is_world_process_zero:  # a gang: rank 0 commits for all
                return
            folder = Path(args.output_dir)
            current = folder / f"checkpoint-{state.global_step}"
            if not current.is_dir():
                return
            for name in _NOT_KEPT:
                (current / name).unlink(missing_ok=True)
            if train_log is not None and train_log.is_file():
                shutil.copyfile(train_log, current / TRAIN_LOG)
            if metrics is not None:
                atomic_write_json(current / METRIC_ROWS, metrics.rows)
            if loop is not None:
                atomic_write_json(current / LOOP_STATE, loop)
            follow_umask(current)
            write_manifest(current, COMPLETE, state.global_step, dict(identity or {}))
            for n, p in _trl_checkpoints(folder):
                if n < state.global_step:
                    shutil.rmtree(p, ignore_errors=True)

    return CheckpointCommit()


def time_checkpoint_callback(minutes: float):
    """A TrainerCallback that requests a save when `minutes` passed since the last one, by
    rank 0's clock on a gang (broadcast: the ranks' clocks differ, and every rank takes part
    in a save, `checkpoint_commit_callback`)."""
    from transformers import TrainerCallback

    class TimeCheckpointCallback(TrainerCallback):
        last = time.monotonic()

        def on_step_end(self, args, state, control, **kwargs):
            (due,) = rank_zero_says(minutes > 0 and time.monotonic() - self.last >= minutes * 60)
            if due:
                control.should_save = True
                self.last = time.monotonic()

    return TimeCheckpointCallback()


def stop_callback(stop_file: Path | str | None, on_request_only: bool = False):
    """A TrainerCallback honouring the run's request to stop at a checkpoint (the
    `Checkpointer.stop_file` of the hand-written loops): after a step, when the request
    exists (rank 0 decides for the gang) and steps remain, the Trainer saves a checkpoint
    and stops; `stopped_at` is that step (the stage then raises `StoppedAtCheckpoint`).
    `on_request_only` (checkpoints off: `CheckpointPlan.on_request_only`): no other save,
    not even the one the Trainer makes at the last step."""
    from transformers import TrainerCallback

    class StopAtCheckpoint(TrainerCallback):
        stopped_at: int | None = None

        def on_step_end(self, args, state, control, **kwargs):
            last = state.max_steps > 0 and state.global_step >= state.max_steps
            asked = stop_file is not None and os.path.exists(stop_file)
            (stop,) = rank_zero_says(not last and asked)
            if stop:
                control.should_save = True
                control.should_training_stop = True
                self.stopped_at = int(state.global_step)
            elif last and on_request_only:
                control.should_save = False

    return StopAtCheckpoint()
