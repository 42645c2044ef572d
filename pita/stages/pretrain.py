"""pretrain: train the reference policy π_ref on an offline task (goal-walk, star graph).

The tiny family's π_ref is built here from scratch (`model.reference_arch`, the task's own
number tokenizer). A hub or local family (gpt2, `model=local`) is *fine-tuned* from its
reference checkpoint on the task rendered as text in its own tokenizer, as the official
star-graph code fine-tunes text-pretrained GPT-2 (`pretrain.lr_schedule=official`: warmup
max(100, 1 %) then cosine to 0.1·lr, with `pretrain.weight_decay`).

Teacher forcing on the target tokens only (the prompt positions carry label -100), AdamW
with linear warmup then cosine decay, fresh examples every step from the task's
`pretrain_batch` (goal-walk: random walks that ignore the goal; star graph: the true
path). One pretrain task per (dataset, family) is shared by every chain using them. The
model and its tokenizer are written with `save_pretrained` into `model/`, next to
`training_metrics.png` and `performance_summary.txt`.

Training mechanics come from `pita.training`: precision (`training.mixed_precision` /
`precision_type`), exact gradient accumulation, clipping, `system.clear_cache_interval`,
`training.compile` and `training.gradient_checkpointing`, and DDP or FSDP2 over the task's
gang with `training.parallel_strategy=data_parallel | fsdp`. The tiny policy trains on its whole batch
at once (`training.micro_batch_size` is sized for hub models and would only slow it down);
it is cut into micro-batches when `training.accumulation_steps` is set or an OOM retry
halves the task's `batch_scale`. With `training.checkpoint_every` the loop checkpoints
(model, optimizer, schedule, RNG streams) and a retried task continues from there.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pita.core.paths import Artifact
from pita.runtime.context import StageContext

if TYPE_CHECKING:
    from pita.models.catalog import Family


def pad_right(rows: list[list[int]], labels: list[list[int]], pad_id: int):
    """Right-padded input ids, attention mask and labels (-100 where no loss), built with
    one tensor constructor each (no per-row tensor: collation stays off the hot path)."""
    import torch

    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [pad_id] * (width - len(r)) for r in rows], dtype=torch.long)
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], dtype=torch.long)
    lab = torch.tensor([y + [-100] * (width - len(y)) for y in labels], dtype=torch.long)
    return ids, mask, lab


def teacher_forcing_batch(pairs: list[tuple[list[int], list[int]]], pad_id: int):
    """(prompt, target) pairs -> tensors whose loss covers the target tokens only."""
    rows = [list(p) + list(t) for p, t in pairs]
    labels = [[-100] * len(p) + list(t) for p, t in pairs]
    return pad_right(rows, labels, pad_id)


def prefetch(batches: Iterator, depth: int = 2) -> Iterator:
    """Produce the next batches in a thread while the device trains on this one. The one
    producer keeps the exact order (and random stream) of the plain loop."""
    import queue
    import threading

    q: queue.Queue = queue.Queue(maxsize=depth)
    done = object()

    def produce() -> None:
        try:
            for item in batches:
                q.put(item)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the training thread
            q.put(exc)
        q.put(done)

    threading.Thread(target=produce, name="pita-prefetch", daemon=True).start()
    while (item := q.get()) is not done:
        if isinstance(item, BaseException):
            raise item
        yield item


def official_schedule(optim, steps: int):
    """The official star-graph pretraining schedule (Next-Token-Failures `get_lr`): linear
    warmup over max(100, 1 % of the steps), cosine decay to 0.1·lr at the last step."""
    import math

    import torch

    warmup = max(100, int(0.01 * steps))

    def factor(step: int) -> float:
        if step < warmup:
            return step / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return torch.optim.lr_scheduler.LambdaLR(optim, factor)


def _family_policy(
    family: Family,
    name: str,
    family_cfg: Mapping[str, Any],
    dataset_cfg: Mapping[str, Any],
    attn_impl: str,
) -> tuple[Any, Any]:
    """(the family's reference as a trainable fp32 causal LM, the task in its tokenizer):
    `family` is alias `name` resolved with the chain's `model.*` (`family_cfg`),
    `dataset_cfg` the chain's `dataset.*`."""
    from pita.datasets import build_task
    from pita.models.loading import load_tokenizer
    from pita.models.placement import load_stage_lm

    tok = load_tokenizer(family.reference, trust_remote_code=family.trust_remote_code)
    task = build_task(dataset_cfg, tokenizer=tok)
    model = load_stage_lm(
        family.reference,
        family=name,
        family_cfg=family_cfg,
        device="cpu",  # moved to the training device by the caller
        attn_impl=attn_impl,
        trainable=True,
    )
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tok.pad_token_id
    return model, task


def pretrain(ctx: StageContext) -> dict:
    """Train the reference policy π_ref: the tiny Llama from scratch, or fine-tune a hub /
    local family's reference on the offline task (see the module docstring).

    Reads: the task's pretraining batches (teacher-forced correct responses),
    `model.reference_arch`, `pretrain.*`, `training.*`. Writes: `model/` (save_pretrained
    + the task's tokenizer), training_metrics.png, performance_summary.txt. Runs DDP over
    the task's gang with `training.parallel_strategy=data_parallel`.
    """
    from pita.runtime.gang import run_stage

    return run_stage(ctx, _pretrain)  # one process, or one per GPU of the gang (data_parallel)


def _pretrain(ctx: StageContext, dist=None) -> dict:
    """The loop, on one process (`dist` None) or on one rank of a DDP / FSDP2 gang: the
    context unpacked once into a `_Job` of values, then `_train`."""
    from pita.models.catalog import resolve_family
    from pita.runtime.kit import checkpoint_plan, task_tracker
    from pita.training.precision import training_device

    job = _Job(
        training=ctx.training,
        pretrain=ctx.pretrain,
        batch_scale=ctx.task.batch_scale,
        seed=ctx.seed,
        family=resolve_family(ctx.task.family, ctx.cfg.model),
        family_name=ctx.task.family,
        model_cfg=ctx.cfg.model,
        dataset_cfg=ctx.cfg.dataset,
        attn_impl=ctx.system.attn_impl,
        device=training_device(ctx.system.gpu_mode, ctx.device).device,  # system.gpu_mode
        clear_cache_interval=ctx.system.clear_cache_interval,
        logger=ctx.logger,
        report_progress=ctx.report_progress,
        out_dir=ctx.out_dir,
        title=ctx.task.id,
        checkpoints=checkpoint_plan(ctx),
        tracker=task_tracker(ctx),  # a tracker that writes nothing off rank 0
    )
    return _train(job, dist)


@dataclass
class _Job:
    """What pretrain needs of its context, as values (`_pretrain` unpacks it)."""

    training: Any  # training.*
    pretrain: Any  # pretrain.*
    batch_scale: float  # halved by each OOM retry
    seed: int
    family: Family  # the chain's model family, resolved
    family_name: str
    model_cfg: Any  # model.*
    dataset_cfg: Any  # dataset.*
    attn_impl: str
    device: str  # where it trains ("cuda:r" or "cpu")
    clear_cache_interval: int
    logger: Any
    report_progress: Callable[..., None]
    out_dir: Path
    title: str  # the task id
    checkpoints: Any  # pita.training.checkpoint.CheckpointPlan
    tracker: Any  # the task's tracker (pita.training.tracking.Tracker)


@dataclass
class _Run:
    """One pretraining run's pieces, built by `_setup`."""

    job: _Job
    dist: Any  # pita.training.ddp.DistContext, or None on one process
    task: Any  # the offline task (its batches, its tokenizer)
    model: Any
    net: Any  # what the loss runs through: the model, DDP- or FSDP2-wrapped on a gang
    step: Any  # pita.training.loop.TrainStep
    rng: random.Random  # the data stream: the same on every rank, then sharded
    world: int
    micro: int
    n_micro: int
    checkpointing: bool
    ckpt: Any = None  # its Checkpointer
    saved: tuple = ()  # what the checkpointer saves: (model, optimizer, scheduler)
    start: int = 0  # the first step (after a restored checkpoint)


def _train(job: _Job, dist: Any) -> dict:
    run = _setup(job, dist)
    _restore(run)
    _loop(run)
    return _finish(run)


def _reference_model(job: _Job) -> tuple[Any, Any]:
    """(π_ref to train, the offline task): the tiny Llama built from scratch in the task's
    tokenizer, or the family's reference in its own."""
    from pita.datasets import build_task
    from pita.models.tiny import build_tiny_llama

    if not job.family.is_builtin:
        model, task = _family_policy(
            job.family, job.family_name, job.model_cfg, job.dataset_cfg, job.attn_impl
        )
        job.logger.info(
            "pretrain: fine-tuning the family's reference %s on %s rendered as text in its "
            "tokenizer",
            job.family.reference,
            task.name,
        )
        return model, task
    task = build_task(job.dataset_cfg)
    tok = task.tokenizer
    arch = job.model_cfg["reference_arch"]
    sample = task.pretrain_batch(random.Random(0), 1)[0]
    model = build_tiny_llama(
        len(tok),
        n_layer=arch["n_layer"],
        d_model=arch["d_model"],
        n_head=arch["n_head"],
        max_position=max(64, 2 * (len(sample[0]) + task.max_new_tokens)),
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        seed=job.seed,
        attn_impl=job.attn_impl,
    )
    return model, task


def _optimizer(job: _Job, model: Any) -> tuple[Any, Any]:
    """AdamW and its schedule (`pretrain.lr_schedule`: cosine with warmup, or official)."""
    import torch
    from transformers import get_cosine_schedule_with_warmup

    pcfg, wd = job.pretrain, job.pretrain.weight_decay
    optim = torch.optim.AdamW(
        model.parameters(), lr=pcfg.lr, weight_decay=job.training.weight_decay if wd is None else wd
    )
    sched = (
        official_schedule(optim, pcfg.steps)
        if pcfg.lr_schedule == "official"
        else get_cosine_schedule_with_warmup(optim, pcfg.warmup_steps, pcfg.steps)
    )
    return optim, sched


def _setup(job: _Job, dist: Any) -> _Run:
    """The model on its device under the gang, its optimizer and `TrainStep`."""
    import torch

    from pita.training.ddp import apply_gang
    from pita.training.loop import (
        TrainStep,
        compile_model,
        enable_gradient_checkpointing,
        micro_batch_plan,
    )
    from pita.training.precision import training_precision

    tr, world = job.training, dist.world_size if dist else 1
    # pretrain.batch_size is the effective batch over all ranks; each rank cuts its share
    # into micro-batches whose gradients add up to those of the whole share.
    per_rank = -(-job.pretrain.batch_size // world)
    micro, n_micro = micro_batch_plan(per_rank, tr, job.batch_scale, whole_batch=True)
    torch.manual_seed(job.seed)
    rng = random.Random(job.seed)  # the same stream on every rank: same batches, then sharded
    model, task = _reference_model(job)
    device = torch.device(job.device)
    model.to(device).train()
    checkpointing = enable_gradient_checkpointing(model, tr.gradient_checkpointing, job.logger)
    compiled = compile_model(model, tr.compile, tr.compile_mode, logger=job.logger)
    precision = training_precision(tr, device, logger=job.logger)
    # DDP all-reduces the gradients; FSDP2 shards the model in place (the optimizer comes after)
    net = apply_gang(model, dist, precision)
    optim, sched = _optimizer(job, model)
    # Figures are read back every 50 steps (the log interval), not every step: no host sync.
    step = TrainStep(
        net,
        optim,
        precision,
        scheduler=sched,
        max_grad_norm=tr.max_grad_norm,
        clear_cache_interval=job.clear_cache_interval,
        device=device,
        compile_status=compiled,
        logger=job.logger,
        sync_every=50,
        tracker=job.tracker,
    )
    job.logger.info(
        "pretrain: effective batch %d = micro %d x %d accumulation x %d rank(s), %s",
        per_rank * world,
        micro,
        n_micro,
        world,
        step.precision.name,
    )
    run = _Run(job, dist, task, model, net, step, rng, world, micro, n_micro, checkpointing)
    run.saved = (model, optim, sched)
    return run


def _restore(run: _Run) -> None:
    """In-task checkpoints (training.checkpoint_every): a retry continues where the dead
    attempt stopped (a gang's: full state by name, or each rank's shards)."""
    dist, (model, optim, sched) = run.dist, run.saved
    plan = run.job.checkpoints
    run.ckpt = plan.checkpointer(
        run.job.logger, writer=dist is None or dist.is_main, collective=dist is not None
    )
    saved_model, saved_optim = plan.objects(model, optim)
    run.saved = (saved_model, saved_optim, sched)
    run.start, extra = run.ckpt.restore(
        model=saved_model,
        optimizer=saved_optim,
        scheduler=sched,
        step=run.step,
        max_step=run.job.pretrain.steps,
    )
    if "rng" in extra:
        run.rng.setstate(extra["rng"])


def _batches(run: _Run, cuda: bool) -> Iterator[tuple]:
    """Collated CPU batches (pinned on CUDA) and their token counts, in step order, with
    the data RNG's state after each (prefetching runs ahead: a checkpoint needs the
    state that belongs to its step)."""
    pcfg, rng, pad = run.job.pretrain, run.rng, run.task.tokenizer.pad_token_id
    for _ in range(run.start, pcfg.steps):
        pairs = run.task.pretrain_batch(rng, pcfg.batch_size)
        rng_after = rng.getstate()
        n_tokens = sum(len(p) + len(t) for p, t in pairs)  # throughput counts the whole batch
        n_targets = sum(len(t) for _, t in pairs)  # the loss positions of the whole batch
        if run.dist is not None:
            pairs = [pairs[j] for j in run.dist.shard(len(pairs))]
        ids, mask, labels = teacher_forcing_batch(pairs, pad)
        # loss positions per micro-batch, counted on the host before the copy
        counts = [int((lab[:, 1:] != -100).sum()) for lab in labels.split(run.micro)]
        if cuda:
            ids, mask, labels = ids.pin_memory(), mask.pin_memory(), labels.pin_memory()
        yield ids, mask, labels, counts, n_tokens, n_targets, rng_after


def _loop(run: _Run) -> None:
    """The steps from `run.start`: each batch's micro-batches, their gradients weighted by
    their share of the batch's target tokens; a log line every 50 steps; checkpoints."""
    from pita.training.loop import split_batch, token_weights

    job, step, net = run.job, run.step, run.net
    pcfg, device = job.pretrain, step.device
    cuda = device.type == "cuda"
    stream = prefetch(_batches(run, cuda)) if cuda else _batches(run, cuda)
    saved_model, saved_optim, sched = run.saved
    detail = ""  # the last logged loss, shown with every step's progress
    for i, (ids, mask, labels, counts, n_tokens, n_targets, rng_after) in enumerate(
        stream, start=run.start
    ):
        batch = {
            "input_ids": ids.to(device, non_blocking=True),
            "attention_mask": mask.to(device, non_blocking=True),
            "labels": labels.to(device, non_blocking=True),
        }
        # The model's loss is a mean over a micro-batch's target tokens: weight each by its
        # share of the batch's tokens, so the accumulated gradient is the whole batch's.
        step.run(
            split_batch(batch, run.micro),
            lambda mb: net(**mb).loss,
            weights=token_weights(counts, total=n_targets, world_size=run.world),
            samples=pcfg.batch_size,
            tokens=n_tokens,
        )
        if (i + 1) % 50 == 0 or i == pcfg.steps - 1:
            last = step.metrics_rows()[-1]
            job.logger.info(
                "step %d/%d loss %.4f lr %.2e", i + 1, pcfg.steps, last["loss"], step.lr()
            )
            detail = f"loss {last['loss']:.4f}"
        job.report_progress(i + 1, pcfg.steps, "step", detail)
        run.ckpt.maybe_save(
            i + 1,
            lambda: {"model": saved_model, "optimizer": saved_optim, "scheduler": sched},
            step=step,
            extra=partial(dict, rng=rng_after),  # the data RNG's state after this step
        )


def _finish(run: _Run) -> dict:
    """Rank 0 writes the model (FSDP2: each rank its shards, merged by file), the tokenizer
    and the report; the result."""
    from pita.training.ddp import full_state_dict
    from pita.training.report import write_training_report
    from pita.training.shards import save_consolidated, save_hf_config, sharded_model

    job, model, dist = run.job, run.model, run.dist
    folder = job.out_dir / Artifact.MODEL
    consolidated = sharded_model(dist)  # FSDP2: each rank writes its shards, merged by file
    if consolidated:
        save_consolidated(model, folder, dist.rank)
    state = full_state_dict(model, dist) if dist is not None and not consolidated else None
    if dist is not None and not dist.is_main:
        return {}  # rank 0 writes the model and the report
    model.eval()
    if consolidated:
        save_hf_config(model, folder)
    else:
        model.save_pretrained(folder, state_dict=state)
    run.task.save_tokenizer(str(folder))
    perf = write_training_report(
        job.out_dir,
        run.step,
        micro_batch=run.micro,
        accumulation_steps=run.n_micro,
        world_size=run.world,
        gradient_checkpointing=run.checkpointing,
        title=job.title,
    )
    run.step.flush()
    losses = run.step.metrics.series("loss")[1][-20:]
    shown = ("precision", "compile", "effective_batch", "samples_per_s", "tokens_per_s")
    return {
        "steps": job.pretrain.steps,
        "final_loss": sum(losses) / len(losses),
        "parameters": sum(p.numel() for p in model.parameters()),
        **{k: perf[k] for k in (*shown, "peak_memory_mb")},
    }
