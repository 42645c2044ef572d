"""Training objects built from a stage's context: the one place that reads a task's
`training.*` / `system.*` keys, its folders and its logger for `pita.training`.

`pita.training` takes values (a model, a folder, a logger config, a run dir, a name) and
knows no task; a stage asks this module for the task's instances:

- `checkpoint_dir(ctx)`: `tasks/<id>.checkpoints/`, seen by every attempt of the task.
- `checkpointer(ctx)`: a `Checkpointer` on that folder, every `training.checkpoint_every`
  steps / `checkpoint_every_minutes`, whose checkpoints carry `checkpoint_identity(ctx)`.
- `trl_checkpoint_kwargs(ctx)`, `last_trl_checkpoint(ctx)`: the same for a TRL Trainer.
- `checkpoint_identity(ctx)`: what a checkpoint must have been written by (task id, hashes
  of the resolved config and of the inputs' manifests): one from another run is refused.
- `task_tracker(ctx)`: the task's `logger.backend` (TRL's logs reach
  the task's tracker through a callback, TRL reports to nothing itself).
- `precision_for(ctx)`: `choose_precision` from `training.*`, logged to the task log.
- `train_step(ctx, model, optimizer, ...)`: a `TrainStep` from `training.*` / `system.*`
  whose metrics also go to the task's tracker (rank 0 of a gang only).

The per-rank DDP glue (how many ranks, a context per rank) is `pita/runtime/gang.py`.
Torch is imported inside the functions.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pita.runtime.context import StageContext

if TYPE_CHECKING:  # torch-heavy; imported only for type hints
    from pita.training.checkpoint import Checkpointer
    from pita.training.loop import CompileStatus, TrainStep
    from pita.training.precision import Precision
    from pita.training.tracking import Tracker


# --- checkpoints ----------------------------------------------------------------------------


def checkpoint_dir(ctx: StageContext) -> Path:
    """The task's checkpoint folder, `tasks/<id>.checkpoints/` (`TaskPaths.checkpoints`)."""
    from pita.core.paths import TaskPaths

    return TaskPaths(ctx.run_dir, ctx.task.id).checkpoints


def checkpoint_every(ctx: StageContext) -> tuple[int, float]:
    """(`training.checkpoint_every` steps, `training.checkpoint_every_minutes`); 0 = off."""
    return ctx.training.checkpoint_every, ctx.training.checkpoint_every_minutes


def checkpoint_identity(ctx: StageContext) -> dict[str, str]:
    """What a checkpoint of this task must carry to be restored: the task id, a sha256 of
    the task's resolved config (without the keys that do not change its result:
    `schema.result_config`, from each field's `affects`) and one of its
    inputs' committed manifests. A checkpoint copied from a run with another seed, config
    or inputs differs in one of them."""
    import hashlib
    import json

    from omegaconf import OmegaConf

    from pita.core.paths import TaskPaths, file_sha256
    from pita.core.schema import result_config

    cfg = result_config(OmegaConf.to_container(ctx.cfg, resolve=True))  # type: ignore[arg-type]
    inputs: dict[str, str] = {}
    for ref in ctx.task.inputs.values():
        for task_id in ref if isinstance(ref, list) else [ref]:
            manifest = TaskPaths(ctx.run_dir, task_id).manifest
            inputs[task_id] = file_sha256(manifest) if manifest.is_file() else "absent"

    def digest(obj: Any) -> str:
        text = json.dumps(obj, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()

    return {
        "task_id": ctx.task.id,
        "config_sha256": digest(cfg),
        "inputs_sha256": digest(inputs),
    }


def checkpointer(
    ctx: StageContext, *, writer: bool = True, collective: bool = False
) -> Checkpointer:
    """The task's `Checkpointer` (`writer`: rank 0 of a gang writes, every rank restores;
    `collective`: a gang's ranks all build the state when a save is due). A task under a
    gang strategy (its checkpoints resume on any k) honours the run's request to stop at a
    checkpoint (`TaskPaths.stop_request`: it restarts on a larger gang, pita/core/growth.py)."""
    from pita.core.paths import TaskPaths
    from pita.runtime.gang import GANG_STRATEGIES, parallel_strategy
    from pita.training.checkpoint import Checkpointer

    every, minutes = checkpoint_every(ctx)
    growable = parallel_strategy(ctx) in GANG_STRATEGIES
    return Checkpointer(
        checkpoint_dir(ctx),
        every,
        minutes,
        writer=writer,
        logger=ctx.logger,
        identity=checkpoint_identity(ctx),
        trust_group=trust_group(ctx),
        collective=collective,
        stop_file=TaskPaths(ctx.run_dir, ctx.task.id).stop_request if growable else None,
    )


def trl_checkpoint_kwargs(ctx: StageContext) -> dict[str, Any]:
    """TrainingArguments checkpoint fields for the task (see the training module's own)."""
    from pita.training import checkpoint

    return checkpoint.trl_checkpoint_kwargs(checkpoint_dir(ctx), *checkpoint_every(ctx))


def trust_group(ctx: StageContext) -> bool:
    """`system.trust_group`: a teammate's (same group) checkpoints count as yours."""
    return ctx.system.trust_group


def last_trl_checkpoint(
    ctx: StageContext, max_step: int | None = None, identity: dict[str, str] | None = None
) -> str | None:
    """The newest Trainer checkpoint of the task whose proof verifies (half-written ones
    removed; foreign, corrupt or past `max_step` ones moved aside with a WARNING).
    `identity`: the task's `checkpoint_identity`, when the caller has it already."""
    from pita.training import checkpoint

    return checkpoint.last_trl_checkpoint(
        checkpoint_dir(ctx),
        identity if identity is not None else checkpoint_identity(ctx),
        max_step,
        ctx.logger,
        trust_group=trust_group(ctx),
    )


# --- tracking -------------------------------------------------------------------------------


def task_tracker(ctx: StageContext) -> Tracker:
    """The tracker of a stage's task (`logger.backend`, named by the task id; one W&B /
    MLflow run per task). Its failures are WARNINGs in the task log, never the task's.
    Only rank 0 of a gang tracks: the other ranks get a tracker that writes nothing."""
    from pita.training.loop import is_main_rank
    from pita.training.tracking import Tracker, open_tracker

    if not is_main_rank():
        return Tracker()
    return open_tracker(ctx.cfg, ctx.run_dir, ctx.task.id, logger=ctx.logger)


# --- precision and the optimizer step -------------------------------------------------------


def precision_for(
    ctx: StageContext, device: str | None = None, compute_capability: Any = None
) -> Precision:
    """`choose_precision` from the task's `training.*` keys, logged to its task log."""
    from pita.training.precision import choose_precision

    return choose_precision(
        ctx.training.precision_type,
        ctx.training.mixed_precision,
        device or ctx.device,
        compute_capability,
        logger=ctx.logger,
    )


def train_step(
    ctx: StageContext,
    model: Any,
    optimizer: Any,
    *,
    scheduler: Any = None,
    precision: Precision | None = None,
    device: Any = None,
    compile_status: CompileStatus | None = None,
    sync_every: int = 1,
) -> TrainStep:
    """A TrainStep configured from `training.*` / `system.*` of the task; its metrics go
    to the task's `logger.backend` too (rank 0 of a gang only)."""
    from pita.training.loop import TrainStep

    device = device or ctx.device
    if precision is None:
        precision = precision_for(ctx, device)
    return TrainStep(
        model,
        optimizer,
        precision,
        scheduler=scheduler,
        max_grad_norm=ctx.training.max_grad_norm,
        clear_cache_interval=ctx.system.clear_cache_interval,
        device=device,
        compile_status=compile_status,
        logger=ctx.logger,
        sync_every=sync_every,
        tracker=task_tracker(ctx),  # a tracker that writes nothing off rank 0
    )
