"""A stage's context unpacked into the values `pita.training` takes: the one place that
reads a task's folders, identity and tracker for it.

`pita.training` takes values (a model, a folder, a logger config, a run dir, a name) and
knows no task. A stage function (the only code that holds a `StageContext`) unpacks its
context once, here, and hands the values on, as a torchtune recipe hands its builders
config sections, never the whole config:

- `checkpoint_plan(ctx)`: a `CheckpointPlan` (pita/training/checkpoint.py): the task's
  `tasks/<id>.checkpoints/` folder (seen by every attempt), `training.checkpoint_every`
  steps / `checkpoint_every_minutes`, the identity its checkpoints carry, `system.trust_group`
  and the state's format (by parameter name under a gang strategy; then also the run's stop
  request, `TaskPaths.stop_request`). A loop builds its
  `Checkpointer` from it, a TRL Trainer its arguments and the checkpoint it resumes from.
- `checkpoint_identity(ctx)`: what a checkpoint must have been written by (task id, hashes
  of the resolved config and of the inputs' manifests): one from another run is refused.
- `task_tracker(ctx)`: the task's `logger.backend` (TRL's logs reach the task's tracker
  through a callback, TRL reports to nothing itself).

The precision and the optimizer step take values already
(`pita.training.precision.training_precision(ctx.training, device)`,
`pita.training.loop.TrainStep`). The per-rank DDP glue (how many ranks, a context per
rank) is `pita/runtime/gang.py`. Torch is imported inside the functions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pita.runtime.context import StageContext

if TYPE_CHECKING:  # torch-heavy; imported only for type hints
    from pita.training.checkpoint import CheckpointPlan
    from pita.training.tracking import Tracker


# --- checkpoints ----------------------------------------------------------------------------


def checkpoint_plan(ctx: StageContext) -> CheckpointPlan:
    """How this task checkpoints, as values (see `CheckpointPlan`): its folder
    (`TaskPaths.checkpoints`), `training.checkpoint_every` / `checkpoint_every_minutes`, its
    `checkpoint_identity`, `system.trust_group`, and the state by parameter name when the
    task runs under a gang strategy (its `Gang`, whatever its world), as each rank's
    shards under FSDP."""
    from pita.core.parallel import Strategy
    from pita.core.paths import TaskPaths
    from pita.training.checkpoint import CheckpointPlan

    by_name = ctx.task.gang.ranked
    return CheckpointPlan(
        TaskPaths(ctx.run_dir, ctx.task.id).checkpoints,
        ctx.training.checkpoint_every,
        ctx.training.checkpoint_every_minutes,
        identity=checkpoint_identity(ctx),
        trust_group=ctx.system.trust_group,
        by_name=by_name,
        sharded=ctx.task.gang.strategy is Strategy.FSDP,  # each rank writes its shards
        # a gang strategy's task (its checkpoints resume on any k) honours the run's request
        # to stop at a checkpoint (it restarts on a larger gang, pita/core/growth.py)
        stop_file=TaskPaths(ctx.run_dir, ctx.task.id).stop_request if by_name else None,
    )


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
