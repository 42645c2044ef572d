"""The per-rank glue of `training.parallel_strategy=data_parallel`: a stage on a task's gang.

`pita.training.ddp` starts k local processes and knows ranks and tensors; this module knows
the task: how many ranks it gets (`data_parallel_world_size`, from `training.*`,
`system.gpu_mode` and the gang) and how a stage body runs on each of them (`run_stage`),
with a per-rank `StageContext` whose logger and heartbeat reach the task's own.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from typing import Any

from pita.runtime.context import ModelCache, StageContext


def data_parallel_world_size(ctx: StageContext) -> int:
    """Ranks for this task: 1 unless `training.parallel_strategy=data_parallel` on a gang.

    On CUDA: the GPUs pinned to the task (as `system.gpu_mode` allows). Off CUDA (a `fake:`
    or CPU gang, tests): `task.gpus` gloo processes simulate the gang's devices.
    """
    from pita.training.precision import training_device

    if str(ctx.training.parallel_strategy) != "data_parallel":
        return 1
    gpu_mode = str(ctx.system.gpu_mode)
    if gpu_mode in ("cpu", "single_gpu"):
        return 1
    choice = training_device(gpu_mode, ctx.device)
    if choice.device != "cpu":
        return choice.n_devices
    return max(1, int(ctx.task.gpus))


class _QueueLogHandler(logging.Handler):
    """A rank's log records, sent to the parent (rank 0 unprefixed, the others tagged)."""

    def __init__(self, dist: Any):
        super().__init__()
        self.dist = dist

    def emit(self, record: logging.LogRecord) -> None:
        try:
            prefix = "" if self.dist.is_main else f"[rank {self.dist.rank}] "
            self.dist.log(prefix + record.getMessage(), record.levelno)
        except Exception:  # noqa: BLE001 - logging must never break training
            self.handleError(record)


def _stage_rank(dist: Any, body: Callable[..., Any], snapshot: dict[str, Any]) -> Any:
    """One rank of `run_stage`: rebuild a StageContext whose log and heartbeat go to the parent."""
    from pathlib import Path

    from omegaconf import OmegaConf

    from pita.core.tasks import TaskSpec

    logger = logging.getLogger(f"pita.task.{snapshot['task']['id']}.rank{dist.rank}")
    logger.handlers.clear()
    logger.propagate = False
    logger.setLevel(logging.INFO if dist.is_main else logging.WARNING)  # rank 0 speaks for all
    logger.addHandler(_QueueLogHandler(dist))
    heartbeat = (lambda msg: dist.send("heartbeat", msg)) if dist.is_main else (lambda msg: None)
    ctx = StageContext(
        task=TaskSpec.from_dict(snapshot["task"]),
        cfg=OmegaConf.create(snapshot["cfg"]),
        run_dir=Path(snapshot["run_dir"]),
        out_dir=Path(snapshot["out_dir"]),
        logger=logger,
        device=dist.device,
        models=ModelCache(1),
        heartbeat=heartbeat,
    )
    return body(ctx, dist)


def run_stage(ctx: StageContext, body: Callable[..., Any], world_size: int | None = None) -> Any:
    """`body(ctx, dist)` on this process (dist=None), or on every rank of the task's gang
    when `training.parallel_strategy=data_parallel`; returns rank 0's result.

    Each rank gets its own StageContext (same task, config and out_dir; device cuda:r or
    cpu); only rank 0 should write into `ctx.out_dir`. `body` must be a module-level
    function (it is pickled).
    """
    import torch
    from omegaconf import OmegaConf

    from pita.training.ddp import DataParallelError, run_data_parallel

    world = data_parallel_world_size(ctx) if world_size is None else world_size
    if world <= 1:
        return body(ctx, None)
    ctx.logger.info("training.parallel_strategy=data_parallel: DDP over %d ranks", world)
    snapshot = {
        "task": ctx.task.to_dict(),
        "cfg": OmegaConf.to_container(ctx.cfg, resolve=True),
        "run_dir": str(ctx.run_dir),
        "out_dir": str(ctx.out_dir),
    }

    def on_message(kind: str, rank: int, payload: Any) -> None:
        if kind == "log":
            level, message = payload
            ctx.logger.log(level, message)
        elif kind == "heartbeat":
            ctx.heartbeat(payload)

    device_type = torch.device(ctx.device).type
    try:
        return run_data_parallel(
            _stage_rank,
            world,
            args=(body, snapshot),
            device_type=device_type,
            on_message=on_message,
        )[0]
    except DataParallelError:
        ctx.logger.error("data parallel task failed:\n%s", traceback.format_exc(limit=3))
        raise
