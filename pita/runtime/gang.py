"""A stage on a task's gang: the task's `Gang` (pita/core/parallel.py) run as k ranks.

`pita.training.ddp.launch_ranks` starts k local ranks through torch's `elastic_launch` and
knows ranks and tensors; this module knows the task: how many ranks it gets
(`gang_world_size`, from the task's gang and `system.gpu_mode`) and how a stage body runs
on each of them (`run_stage`), with a per-rank `StageContext` whose logger and heartbeat
reach the task's own. Nothing here reads `training.parallel_strategy`: the planner decided.

A stage opts in by calling `run_stage(ctx, body, *args)`; `body(ctx, dist, *args)` is a
module-level function that runs on every rank (or once, with `dist=None`, on one device):

    def train(ctx):                      # the stage function the planner names
        items = read_items(ctx)          # read once, in the worker; pickled to the ranks
        return run_stage(ctx, _train, items)

    def _train(ctx, dist, items):        # dist: pita.training.ddp.DistContext or None
        model = apply_gang(model, dist, precision)   # DDP / FSDP2 / the model itself
        ...                              # each rank trains on dist.shard(batch)
        if dist is not None and not dist.is_main:
            return {}                    # rank 0 writes ctx.out_dir and the result
        ...

Inside a rank: `dist.rank`, `dist.world_size`, `dist.device`, `dist.gang` (the task's gang
on this world), the default process group is initialised (gloo on CPU, NCCL on CUDA), and
`ctx.logger` / `ctx.heartbeat` forward to the worker's task log (rank 0 at INFO, the others
at WARNING, tagged "[rank r]").
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from functools import partial
from typing import Any, cast

from omegaconf import OmegaConf

from pita.core.parallel import Gang, Strategy
from pita.runtime.context import ModelCache, StageContext

_WHAT = {Strategy.DDP: "DDP", Strategy.FSDP: "FSDP2 (fully_shard)"}


def _why(planned: Gang, gang: Gang) -> str:
    """The strategy's config name, and why when the planner chose it over the config's."""
    if planned.asked is None or planned.asked is gang.strategy:
        return gang.strategy.key
    why = f"the planner's choice; training.parallel_strategy={planned.asked.key}"
    return f"{gang.strategy.key} ({why})"


def gang_world_size(ctx: StageContext) -> int:
    """Ranks for this task: its gang's (`ctx.task.gang`, set by the planner, the sizer and a
    resize); 1 under no gang strategy.

    On CUDA: the GPUs pinned to the task (as `system.gpu_mode` allows). Off CUDA (a `fake:`
    or CPU gang, tests): `gang.world` gloo processes simulate the gang's devices.
    """
    from pita.training.precision import training_device

    gang = ctx.task.gang
    if not gang.ranked:
        return 1
    gpu_mode = str(ctx.system.gpu_mode)
    if gpu_mode in ("cpu", "single_gpu"):
        return 1
    choice = training_device(gpu_mode, ctx.device)
    if choice.device != "cpu":
        return choice.n_devices
    return gang.world


_STOPPED = "__pita_stopped_at_step__"  # a rank's return value: it stopped at a checkpoint


class _QueueLogHandler(logging.Handler):
    """A rank's log records, sent to the caller (rank 0 unprefixed, the others tagged)."""

    def __init__(self, dist: Any):
        super().__init__()
        self.dist = dist

    def emit(self, record: logging.LogRecord) -> None:
        try:
            prefix = "" if self.dist.is_main else f"[rank {self.dist.rank}] "
            self.dist.log(prefix + record.getMessage(), record.levelno)
        except Exception:  # noqa: BLE001 - logging must never break training
            self.handleError(record)


def _stage_rank(dist: Any, body: Callable[..., Any], snapshot: dict[str, Any], args: tuple) -> Any:
    """One rank of `run_stage`: rebuild a StageContext whose log and heartbeat go to the caller."""
    from pathlib import Path

    from omegaconf import OmegaConf

    from pita.core.tasks import TaskSpec

    dist.gang = Gang.from_dict(snapshot["gang"])
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
        on_step=dist.step,  # every rank: the gang's stall watch (pita.training.ddp.StallRule)
    )
    from pita.core.errors import StoppedAtCheckpoint
    from pita.core.schema import recording_reads

    with recording_reads() as reads:  # returned: the task's manifest lists every rank's reads
        try:
            result = body(ctx, dist, *args)
        except StoppedAtCheckpoint as stop:  # every rank stops at the same step: no failure
            result = {_STOPPED: stop.step}
    return result, reads


def stall_rule(ctx: StageContext) -> Any:
    """The gang's `StallRule`: `executor.gang_stall_s` when set, else derived from its own
    step times (pita.training.ddp.StallRule)."""
    from pita.core.schema import ExecutorConfig, settings
    from pita.training.ddp import StallRule

    executor = ctx.cfg.get("executor")
    plain = OmegaConf.to_container(executor, resolve=True) if executor is not None else {}
    assert isinstance(plain, dict), "executor is a mapping"
    return StallRule(after_s=settings(ExecutorConfig, cast("dict[str, Any]", plain)).gang_stall_s)


def _on_message(
    logger: logging.Logger, heartbeat: Callable[[str], None], kind: str, rank: int, payload: Any
) -> None:
    """A rank's message to the task: its log line, its heartbeat."""
    if kind == "log":
        level, message = payload
        logger.log(level, message)
    elif kind == "heartbeat":
        heartbeat(payload)


def run_stage(
    ctx: StageContext, body: Callable[..., Any], *args: Any, world_size: int | None = None
) -> Any:
    """`body(ctx, dist, *args)` on this process (dist=None), or on every rank of the task's
    gang when the task has a gang strategy (`gang_world_size`); returns rank 0's result.

    Each rank gets its own StageContext (same task, config and out_dir; device cuda:r or
    cpu); only rank 0 should write into `ctx.out_dir`. `body` must be a module-level
    function and `args` picklable (they are sent to the ranks once, at their start).
    A failed rank raises `pita.training.ddp.DataParallelError` naming it.
    """
    import torch
    from omegaconf import OmegaConf

    from pita.core.schema import record_read
    from pita.runtime import ray_slot
    from pita.training.ddp import DataParallelError, launch_ranks

    # a Ray gang (pita/runtime/ray_slot.py): its ranks are slot actors, one device each
    launch = ray_slot.launcher() or launch_ranks
    world = gang_world_size(ctx) if world_size is None else world_size
    if launch is not launch_ranks:
        world = ray_slot.gang_size()
    if world <= 1:
        return body(ctx, None, *args)
    planned = ctx.task.gang
    # a caller's `world_size` on a task without a gang strategy (a test's gang): DDP
    gang = Gang(planned.strategy if planned.ranked else Strategy.DDP, world, planned.nodes)
    nodes = len(set(planned.nodes))
    on = f" on {nodes} Ray nodes" if nodes > 1 else ""  # a Ray gang across nodes
    how = (_why(planned, gang), _WHAT[gang.strategy], world, on)
    ctx.logger.info("gang strategy %s: %s over %d ranks%s", *how)
    snapshot = {
        "task": ctx.task.to_dict(),
        "cfg": OmegaConf.to_container(ctx.cfg, resolve=True),
        "run_dir": str(ctx.run_dir),
        "out_dir": str(ctx.out_dir),
        "gang": gang.to_dict(),
    }
    try:
        returned = launch(
            _stage_rank,
            world,
            args=(body, snapshot, tuple(args)),
            device_type=torch.device(ctx.device).type,
            on_message=partial(_on_message, ctx.logger, ctx.heartbeat),
            stall=stall_rule(ctx),
        )
    except DataParallelError:
        ctx.logger.error("k-rank task failed:\n%s", traceback.format_exc(limit=3))
        raise
    for _, reads in returned:  # the keys any rank read: the task read them
        for key, value in reads.items():
            record_read(key, value)
    result = returned[0][0]
    if isinstance(result, dict) and _STOPPED in result:  # the gang stopped at a checkpoint
        from pita.core.errors import StoppedAtCheckpoint

        raise StoppedAtCheckpoint(result[_STOPPED])
    return result
