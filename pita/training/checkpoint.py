"""Checkpoints inside a training task, so a retry or a resumed run continues mid-task.

A dead attempt's temporary folder is renamed `tasks/<id>.attemptN.failed/`, so the
checkpoints live beside it, in `tasks/<id>.checkpoints/` (`TaskPaths.checkpoints`), which
every attempt of the task sees; the worker removes it once the task is committed.

Hand-written loops (pretrain, value training) use `Checkpointer` (a stage builds it from
its context with `pita.runtime.kit.checkpointer(ctx)`: the task's folder and
`training.checkpoint_every*`):

    ckpt = Checkpointer(folder, every_steps, every_minutes, logger=log)
    start, extra = ckpt.restore(model=model, optimizer=optim, scheduler=sched, step=train_step)
    for i in range(start, steps):
        ...
        ckpt.maybe_save(i + 1, lambda: dict(model=model, ...), extra=lambda: {"rng": rng.getstate()})

A checkpoint is one `step-<N>.pt` (model, optimizer, scheduler, GradScaler, the
TrainStep's counter and metric rows, torch's RNG state, and the loop's own state such as a
`random.Random` or a shuffled order), written to a temporary file and `os.replace`d, so a
kill mid-write leaves the previous checkpoint intact. Only the newest is kept. With the
RNG streams restored the continued run computes what the uninterrupted one would have.

TRL stages use the Trainer's own checkpoints (`resume_from_checkpoint`) in the same folder
(`trl_checkpoint_kwargs(folder, ...)`, `last_trl_checkpoint(folder)`,
`checkpoint_commit_callback`, `time_checkpoint_callback`). The Trainer writes a checkpoint's files one by one, so a
checkpoint counts only once `pita_complete.json` was written after it (atomically).
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_STEP_RE = re.compile(r"^step-(\d+)\.pt$")


class Checkpointer:
    def __init__(
        self,
        folder: Path | str,
        every_steps: int = 0,
        every_minutes: float = 0.0,
        *,
        writer: bool = True,
        logger: logging.Logger | None = None,
    ):
        self.folder = Path(folder)
        self.every_steps = int(every_steps)
        self.every_s = float(every_minutes) * 60.0
        self.writer = writer  # rank 0 of a data-parallel gang writes; every rank restores
        self.logger = logger or log
        self._last_save = time.monotonic()
        self.saved: list[int] = []

    @property
    def enabled(self) -> bool:
        return self.every_steps > 0 or self.every_s > 0

    def latest(self) -> tuple[int, Path] | None:
        if not self.folder.is_dir():
            return None
        found = [
            (int(m.group(1)), p) for p in self.folder.iterdir() if (m := _STEP_RE.match(p.name))
        ]
        return max(found) if found else None

    # -- restore --------------------------------------------------------------------------
    def restore(self, *, step: Any = None, **objects: Any) -> tuple[int, dict[str, Any]]:
        """Load the newest checkpoint into `objects` (anything with `load_state_dict`) and the
        TrainStep `step`; -> (optimizer steps done, the loop's extra state). (0, {}) if none."""
        latest = self.latest()
        if latest is None:
            return 0, {}
        import torch

        n, path = latest
        state = torch.load(path, map_location="cpu", weights_only=False)
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
        self.logger.info("resumed from checkpoint %s (step %d)", path, n)
        self._last_save = time.monotonic()
        return n, state.get("extra", {})

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
        """Save after optimizer step `n` when due (`objects()` / `extra()` are only built then)."""
        if not self.writer or not self.due(n):
            return False
        self.save(n, objects(), step=step, extra=extra() if extra else {})
        return True

    def save(
        self,
        n: int,
        objects: dict[str, Any],
        *,
        step: Any = None,
        extra: dict[str, Any] | None = None,
    ) -> Path:
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
        self.folder.mkdir(parents=True, exist_ok=True)
        final = self.folder / f"step-{n}.pt"
        tmp = self.folder / f".step-{n}.pt.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        for p in self.folder.iterdir():  # keep only the newest
            m = _STEP_RE.match(p.name)
            if m and int(m.group(1)) != n:
                p.unlink(missing_ok=True)
        self._last_save = time.monotonic()
        self.saved.append(n)
        self.logger.info("checkpoint: step %d -> %s", n, final)
        return final


# --- TRL / transformers Trainer -------------------------------------------------------------


COMPLETE = "pita_complete.json"  # written atomically after a Trainer checkpoint is complete


def trl_checkpoint_kwargs(folder: Path | str, every: int, minutes: float) -> dict[str, Any]:
    """TrainingArguments fields for checkpoints every `every` steps (or `minutes`) into
    `folder`; none when both are off. The Trainer keeps every checkpoint
    (`save_total_limit=None`): `checkpoint_commit_callback` marks a finished one and only
    then deletes the older ones, so a kill mid-save leaves a usable checkpoint."""
    if every <= 0 and minutes <= 0:
        return {"save_strategy": "no"}
    kwargs: dict[str, Any] = {
        "output_dir": str(folder),
        "save_total_limit": None,
        "save_only_model": False,
    }
    if every > 0:
        kwargs.update(save_strategy="steps", save_steps=every)
    else:  # time only: TimeCheckpointCallback asks for the saves
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


def last_trl_checkpoint(folder: Path | str) -> str | None:
    """The newest committed `checkpoint-N/` in `folder` (one with the marker); folders a
    kill left half-written are removed."""
    import shutil

    found = _trl_checkpoints(Path(folder))
    good = [(n, p) for n, p in found if (p / COMPLETE).is_file()]
    newest = max(good)[0] if good else -1
    for n, p in found:
        if n > newest:  # half-written by a dead attempt: the Trainer would trip over it
            shutil.rmtree(p, ignore_errors=True)
    return str(max(good)[1]) if good else None


def checkpoint_commit_callback():
    """A TrainerCallback: after the Trainer finished writing checkpoint-N, write the marker
    atomically, then delete every older checkpoint (only the newest complete one is kept)."""
    import shutil

    from transformers import TrainerCallback

    from pita.core.paths import atomic_write_json

    class CheckpointCommit(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            folder = Path(args.output_dir)
            current = folder / f"checkpoint-{state.global_step}"
            if not current.is_dir():
                return
            atomic_write_json(current / COMPLETE, {"step": state.global_step})
            for n, p in _trl_checkpoints(folder):
                if n < state.global_step:
                    shutil.rmtree(p, ignore_errors=True)

    return CheckpointCommit()


def time_checkpoint_callback(minutes: float):
    """A TrainerCallback that requests a save when `minutes` passed since the last one."""
    from transformers import TrainerCallback

    class TimeCheckpointCallback(TrainerCallback):
        last = time.monotonic()

        def on_step_end(self, args, state, control, **kwargs):
            if minutes > 0 and time.monotonic() - self.last >= minutes * 60:
                control.should_save = True
                self.last = time.monotonic()

    return TimeCheckpointCallback()
