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
from collections.abc import Iterator, Mapping
from functools import partial
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
    """The loop, on one process (`dist` None) or on one rank of a DDP gang."""
    import torch
    from transformers import get_cosine_schedule_with_warmup

    from pita.datasets import build_task
    from pita.models.catalog import resolve_family
    from pita.models.tiny import build_tiny_llama
    from pita.runtime.kit import checkpoint_plan, task_tracker
    from pita.training.ddp import apply_gang, full_state_dict
    from pita.training.loop import (
        TrainStep,
        compile_model,
        enable_gradient_checkpointing,
        micro_batch_plan,
        split_batch,
        token_weights,
    )
    from pita.training.precision import training_device, training_precision
    from pita.training.report import write_training_report
    from pita.training.shards import save_consolidated, save_hf_config, sharded_model

    tr, pcfg = ctx.training, ctx.pretrain
    world = dist.world_size if dist else 1
    # pretrain.batch_size is the effective batch over all ranks; each rank cuts its share
    # into micro-batches whose gradients add up to those of the whole share.
    per_rank = -(-pcfg.batch_size // world)
    micro, n_micro = micro_batch_plan(per_rank, tr, ctx.task.batch_scale, whole_batch=True)

    torch.manual_seed(ctx.seed)
    rng = random.Random(ctx.seed)  # the same stream on every rank: same batches, then sharded
    family = resolve_family(ctx.task.family, ctx.cfg.model)
    if family.is_builtin:
        task = build_task(ctx.cfg.dataset)
        tok = task.tokenizer
        arch = ctx.cfg.model["reference_arch"]
        sample = task.pretrain_batch(random.Random(0), 1)[0]
        model = build_tiny_llama(
            len(tok),
            n_layer=arch["n_layer"],
            d_model=arch["d_model"],
            n_head=arch["n_head"],
            max_position=max(64, 2 * (len(sample[0]) + task.max_new_tokens)),
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
            seed=ctx.seed,
            attn_impl=ctx.system.attn_impl,
        )
    else:
        model, task = _family_policy(
            family, ctx.task.family, ctx.cfg.model, ctx.cfg.dataset, ctx.system.attn_impl
        )
        tok = task.tokenizer
        ctx.logger.info(
            "pretrain: fine-tuning the family's reference %s on %s rendered as text in its "
            "tokenizer",
            family.reference,
            task.name,
        )
    device = torch.device(
        training_device(ctx.system.gpu_mode, ctx.device).device
    )  # system.gpu_mode
    model.to(device).train()
    checkpointing = enable_gradient_checkpointing(model, tr.gradient_checkpointing, ctx.logger)
    compiled = compile_model(model, tr.compile, tr.compile_mode, logger=ctx.logger)
    precision = training_precision(tr, device, logger=ctx.logger)
    # DDP all-reduces the gradients; FSDP2 shards the model in place (the optimizer comes after)
    net = apply_gang(model, dist, precision)
    wd = pcfg.weight_decay
    optim = torch.optim.AdamW(
        model.parameters(), lr=pcfg.lr, weight_decay=tr.weight_decay if wd is None else wd
    )
    sched = (
        official_schedule(optim, pcfg.steps)
        if pcfg.lr_schedule == "official"
        else get_cosine_schedule_with_warmup(optim, pcfg.warmup_steps, pcfg.steps)
    )
    # Figures are read back every 50 steps (the log interval), not every step: no host sync.
    step = TrainStep(
        net,
        optim,
        precision,
        scheduler=sched,
        max_grad_norm=tr.max_grad_norm,
        clear_cache_interval=ctx.system.clear_cache_interval,
        device=device,
        compile_status=compiled,
        logger=ctx.logger,
        sync_every=50,
        tracker=task_tracker(ctx),  # a tracker that writes nothing off rank 0
    )
    ctx.logger.info(
        "pretrain: effective batch %d = micro %d x %d accumulation x %d rank(s), %s",
        per_rank * world,
        micro,
        n_micro,
        world,
        step.precision.name,
    )
    cuda = device.type == "cuda"

    # In-task checkpoints (training.checkpoint_every): a retry continues where the dead attempt stopped.
    plan = checkpoint_plan(ctx)
    ckpt = plan.checkpointer(
        ctx.logger, writer=dist is None or dist.is_main, collective=dist is not None
    )
    saved_model, saved_optim = plan.objects(model, optim)  # a gang: full state by name
    start, extra = ckpt.restore(
        model=saved_model, optimizer=saved_optim, scheduler=sched, step=step, max_step=pcfg.steps
    )
    if "rng" in extra:
        rng.setstate(extra["rng"])

    def batches() -> Iterator[tuple]:
        """Collated CPU batches (pinned on CUDA) and their token counts, in step order, with
        the data RNG's state after each (prefetching runs ahead: a checkpoint needs the
        state that belongs to its step)."""
        for _ in range(start, pcfg.steps):
            pairs = task.pretrain_batch(rng, pcfg.batch_size)
            rng_after = rng.getstate()
            n_tokens = sum(len(p) + len(t) for p, t in pairs)  # throughput counts the whole batch
            n_targets = sum(len(t) for _, t in pairs)  # the loss positions of the whole batch
            if dist is not None:
                pairs = [pairs[j] for j in dist.shard(len(pairs))]
            ids, mask, labels = teacher_forcing_batch(pairs, tok.pad_token_id)
            # loss positions per micro-batch, counted on the host before the copy
            counts = [int((lab[:, 1:] != -100).sum()) for lab in labels.split(micro)]
            if cuda:
                ids, mask, labels = ids.pin_memory(), mask.pin_memory(), labels.pin_memory()
            yield ids, mask, labels, counts, n_tokens, n_targets, rng_after

    stream = prefetch(batches()) if cuda else batches()
    detail = ""  # the last logged loss, shown with every step's progress
    for i, (ids, mask, labels, counts, n_tokens, n_targets, rng_after) in enumerate(
        stream, start=start
    ):
        batch = {
            "input_ids": ids.to(device, non_blocking=True),
            "attention_mask": mask.to(device, non_blocking=True),
            "labels": labels.to(device, non_blocking=True),
        }
        micro_batches = split_batch(batch, micro)
        # The model's loss is a mean over a micro-batch's target tokens: weight each by its
        # share of the batch's tokens, so the accumulated gradient is the whole batch's.
        step.run(
            micro_batches,
            lambda mb: net(**mb).loss,
            weights=token_weights(counts, total=n_targets, world_size=world),
            samples=pcfg.batch_size,
            tokens=n_tokens,
        )
        if (i + 1) % 50 == 0 or i == pcfg.steps - 1:
            last = step.metrics_rows()[-1]
            ctx.logger.info(
                "step %d/%d loss %.4f lr %.2e", i + 1, pcfg.steps, last["loss"], step.lr()
            )
            detail = f"loss {last['loss']:.4f}"
        ctx.report_progress(i + 1, pcfg.steps, "step", detail)
        ckpt.maybe_save(
            i + 1,
            lambda: {"model": saved_model, "optimizer": saved_optim, "scheduler": sched},
            step=step,
            extra=partial(dict, rng=rng_after),  # the data RNG's state after this step
        )

    consolidated = sharded_model(dist)  # FSDP2: each rank writes its shards, merged by file
    if consolidated:
        save_consolidated(model, ctx.out_dir / Artifact.MODEL, dist.rank)
    state = full_state_dict(model, dist) if dist is not None and not consolidated else None
    if dist is not None and not dist.is_main:
        return {}  # rank 0 writes the model and the report
    model.eval()
    if consolidated:
        save_hf_config(model, ctx.out_dir / Artifact.MODEL)
    else:
        model.save_pretrained(ctx.out_dir / Artifact.MODEL, state_dict=state)
    task.save_tokenizer(str(ctx.out_dir / Artifact.MODEL))
    perf = write_training_report(
        ctx.out_dir,
        step,
        micro_batch=micro,
        accumulation_steps=n_micro,
        world_size=world,
        gradient_checkpointing=checkpointing,
        title=ctx.task.id,
    )
    step.flush()
    losses = step.metrics.series("loss")[1][-20:]
    return {
        "steps": pcfg.steps,
        "final_loss": sum(losses) / len(losses),
        "parameters": sum(p.numel() for p in model.parameters()),
        **{
            k: perf[k]
            for k in (
                "precision",
                "compile",
                "effective_batch",
                "samples_per_s",
                "tokens_per_s",
                "peak_memory_mb",
            )
        },
    }
