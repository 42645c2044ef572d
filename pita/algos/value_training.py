"""The value-model trainer that PITA, Q# and Q#-HF share (`train_value`), as a recipe.

A stage turns its records into training items (prompt, response, first trained index,
target, alt) and calls `train_value(ctx, items)`. As in a torchtune recipe, one function
holds the context (`_train_value_rank`): it unpacks it once into values (a `ValueJob`, the
task's `CheckpointPlan`, its tracker) and every piece below takes those values, never `ctx`
(tests/test_builders_take_values.py follows `ctx` from `train_value`). Three parts, in
plain view:

1. `setup`: the data (`split_data` -> `build_targets`: records sharing a (state, action)
   merged into soft targets over unique sequences; a held-out split when
   `holdout_fraction` > 0), the model (`build_model`: round k−1's checkpoint, else a fresh
   guide warm-started from π_ref), the frozen-backbone `probe` (`probe_steps`), the batch
   arithmetic (the whole batch, halved by each OOM retry; `auto`: the batch-size probe),
   `build_optimizer` (AdamW with cosine or `official_schedule`); then the `TrainStep` and
   the in-task checkpoint it resumes from (`_resume`, from the `CheckpointPlan`).
   Everything lives in one `ValueRun`.
2. `train_loop`: one optimizer step per batch of unique sequences, drawn from a shuffled
   order kept on the device, a log window every steps/10 (loss, accuracy, the held-out
   accuracy by response position), a checkpoint when due.
3. `finish`: save `value_model/`, write the training report, return the stage's result.

With `training.parallel_strategy` data_parallel or fsdp on a k-device gang the three parts
run on every rank (`pita.runtime.gang.run_stage`; the items are read once, in the worker,
and sent to the ranks): every rank builds the same model from the same seed, draws the
same shuffled order, and trains on its strided share of each step's batch of unique
sequences, weighted by its share of the batch's weight times k, so the averaged gradients
(DDP all-reduce, FSDP2 reduce-scatter) are those of one process on the whole batch: same
global batch, seeds, data order and number of optimizer steps whatever k is. Rank 0
writes the model, the report and the result.

The numerics are those of the one-function version this replaced (same operations in
the same order, so the same RNG streams): tests/test_value_chains.py and friends pin them.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pita.core.paths import Artifact
from pita.core.schema import TrainingConfig, ValueGuidedConfig
from pita.runtime.context import StageContext

if TYPE_CHECKING:  # torch-heavy; imported only for type hints
    from pita.training.checkpoint import CheckpointPlan
    from pita.training.tracking import Tracker


def build_targets(items: Sequence[tuple], pad_id: int) -> dict:
    """Merge records sharing a (state, action) into soft targets over unique sequences.

    An item is (prompt, response, start, target, alt): response positions >= start are
    trained; `alt` (Bradley–Terry pairs only) is the competing action at the last position.
    A trie numbers every prefix (prompts of different lengths never share a node); each
    trained position adds its item's target to the key (node of state + action, alt).
    Every unique (sequence, alt) then carries, at each position whose key was trained,
    the key's mean target with weight count / (units through the key), so the weights of
    a key sum to its record count: the objective of the records, exactly. Tensors are
    aligned with hidden states: column t scores token t + 1 (and alt[:, t]).
    """
    import torch

    trie: dict[tuple[int, int], int] = {}
    sums: dict[tuple, list[float]] = {}
    counts: dict[tuple, int] = {}
    units: dict[tuple, tuple[list[int], int, Any]] = {}

    def keys(prompt: Sequence[int], response: Sequence[int], alt: Any) -> list[tuple]:
        node = -1 - len(
            prompt
        )  # one root per prompt length: the prompt/response boundary is part of the key
        out: list[tuple[int, int | None]] = []
        for i, tok in enumerate([*prompt, *response]):
            node = trie.setdefault((node, int(tok)), len(trie))
            if i >= len(prompt):
                out.append((node, None))
        if out and alt is not None:
            out[-1] = (out[-1][0], int(alt))
        return out

    for prompt, response, start, target, alt in items:
        ks = keys(prompt, response, alt)
        for key in ks[start:]:
            if key in sums:
                sums[key] = [a + b for a, b in zip(sums[key], target)]
                counts[key] += 1
            else:
                sums[key], counts[key] = list(target), 1
        if ks:
            units.setdefault(ks[-1], ([*prompt, *response], len(prompt), alt))
    seqs = list(units.values())
    through: dict[tuple, int] = {}
    paths = []
    for seq, p, alt in seqs:
        ks = keys(seq[:p], seq[p:], alt)
        paths.append(ks)
        for key in set(ks):
            through[key] = through.get(key, 0) + 1
    width = max(len(s) for s, _, _ in seqs)
    k = len(items[0][3])
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    prompt_len = torch.tensor([p for _, p, _ in seqs], dtype=torch.long)
    alts = torch.zeros((len(seqs), width - 1), dtype=torch.long)
    target = torch.zeros((len(seqs), width - 1, k))
    weight = torch.zeros((len(seqs), width - 1))
    for u, ((seq, p, _), ks) in enumerate(zip(seqs, paths)):
        ids[u, : len(seq)] = torch.tensor(seq)
        for j, key in enumerate(ks):
            if key in counts:
                target[u, p + j - 1] = torch.tensor(sums[key]) / counts[key]
                weight[u, p + j - 1] = counts[key] / through[key]
                alts[u, p + j - 1] = key[1] if key[1] is not None else 0
    return {
        "ids": ids,
        "alt": alts,
        "target": target,
        "weight": weight,
        "prompt_len": prompt_len,
        "records": len(items),
        "unique": len(seqs),
        "states": len(counts),
    }


def _to_device(t, device):
    """A CPU tensor on `device`: pinned and copied asynchronously when that is CUDA."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _hits(score, target, w):
    """Weighted share of positions where σ(score) and the target fall on the same side of
    1/2, as a device tensor (read back with the window's other figures)."""
    hit = ((score > 0) == (target > 0.5)).float()
    return (hit * w).sum() / w.sum().clamp_min(1e-12)


def _fused_adamw(device) -> dict:
    """AdamW's fused CUDA kernel (one launch per step instead of one per parameter)."""
    return {"fused": True} if device.type == "cuda" else {}


def official_schedule(optim: Any, steps: int) -> Any:
    """The Q# star-graph classifier's schedule: linear warmup over max(100, 10 %) of the
    steps (at most all of them), then cosine decay to 0.1·lr."""
    import torch

    warmup = min(steps, max(100, steps // 10))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return torch.optim.lr_scheduler.LambdaLR(optim, factor)


# --- the recipe ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ValueJob:
    """What one value-training run reads, unpacked from the stage's context once
    (`_train_value_rank`): the pieces of the recipe take these values, never the context."""

    task_id: str
    algo: ValueGuidedConfig  # algos.<NAME>
    training: TrainingConfig  # training.*
    seed: int  # the task's seed (StageContext.seed)
    device: Any  # torch.device the run trains on (system.gpu_mode)
    attn_impl: str  # system.attn_impl
    clear_cache_interval: int  # system.clear_cache_interval
    family: Mapping[str, Any]  # the chain's model.* (a fresh guide's architecture and init)
    previous: Path | None  # round k−1's train folder (its value_model/), None in round 0
    batch_scale: float  # the task's batch scale (< 1 after an OOM retry)
    safety_margin: float  # batch_size_safety_margin of the `auto` micro-batch probe
    probe_key: Mapping[str, str]  # the batch-size cache's key for this stage
    logger: logging.Logger  # the task log


@dataclass
class ValueRun:
    """What `setup` builds and `train_loop` / `finish` use: one value-training run."""

    job: ValueJob
    data: dict  # build_targets of the training items
    held: dict | None  # build_targets of the held-out items, if any
    model: Any  # the ValueModel being trained
    init: str  # "previous:<task>" | "reference" | "scratch"
    checkpointing: bool  # gradient checkpointing on
    batch: int  # unique sequences per optimizer step
    micro: int = 0
    n_micro: int = 0
    steps: int = 0
    log_every: int = 1
    tensors: tuple = ()  # ids, alts, target, weight: the whole training set on the device
    loss_fn: Callable[[Any], Any] | None = None
    optim: Any = None
    sched: Any = None
    trainer: Any = None  # pita.training.loop.TrainStep
    ckpt: Any = None  # pita.training.checkpoint.Checkpointer
    saved: tuple = ()  # (model, optimizer) as the checkpointer saves them (CheckpointPlan.objects)
    start: int = 0  # optimizer steps already done (a resumed attempt)
    gen: Any = None  # the torch.Generator of the shuffles
    order: Any = None  # this epoch's shuffled order (on the device)
    cursor: int = 0
    diagnostics: dict = field(default_factory=dict)
    dist: Any = None  # pita.training.ddp.DistContext of a gang's rank, None on one process
    precision: Any = None  # pita.training.precision.Precision, chosen once (a gang: at its wrap)
    net: Any = None  # what the loss runs through: the read-out, DDP- or FSDP2-wrapped on a gang

    @property
    def algo(self) -> ValueGuidedConfig:
        return self.job.algo

    @property
    def device(self) -> Any:
        return self.job.device

    @property
    def world(self) -> int:
        return self.dist.world_size if self.dist is not None else 1

    @property
    def n(self) -> int:
        return self.data["unique"]


def train_value(ctx: StageContext, items: Sequence[tuple]) -> dict:
    """Fit the value model on merged (state, action) targets and save `value_model/`.

    Model: round 0 builds the family's guide (warm-started from π_ref when `warm_start`);
    round k loads round k−1's checkpoint (input "previous"). Steps of
    `algos.<NAME>.batch_size` unique sequences (or `epochs` passes when `steps` is 0),
    AdamW with warmup + cosine decay; `pita.training.loop.TrainStep` does the accumulation
    over micro-batches (`micro_batch_plan`: the whole batch, halved by each OOM retry),
    clipping and the precision (bf16/fp16 autocast on CUDA only, fp32 on CPU).
    """
    from pita.runtime.gang import run_stage

    return run_stage(ctx, _train_value_rank, list(items))


def _train_value_rank(ctx: StageContext, dist: Any, items: Sequence[tuple]) -> dict:
    """`train_value` on one process (`dist` None) or on one rank of the task's gang: the
    recipe's one reader of the context. It unpacks it once (the job, the π_ref it starts
    from, the tracker, the checkpoint plan, the progress callback, the output folder) and
    runs the pieces on those values, in the order the RNG streams expect."""
    import torch

    from pita.runtime.kit import checkpoint_plan, task_tracker
    from pita.training.precision import training_device

    t0 = time.perf_counter()
    algo = ctx.algo_as(ValueGuidedConfig)
    if not items:
        raise ValueError(f"{ctx.task.id}: no training records in {ctx.inputs('data')}")
    job = ValueJob(
        task_id=ctx.task.id,
        algo=algo,
        training=ctx.training,
        seed=ctx.seed,
        device=torch.device(training_device(ctx.system.gpu_mode, ctx.device).device),
        attn_impl=ctx.system.attn_impl,
        clear_cache_interval=ctx.system.clear_cache_interval,
        family=ctx.cfg.model,
        previous=ctx.input("previous") if ctx.has_input("previous") else None,
        batch_scale=ctx.task.batch_scale,
        safety_margin=ctx.batch_size_safety_margin,
        probe_key={"stage": ctx.task.stage, "algo": ctx.task.algo},
        logger=ctx.logger,
    )
    torch.manual_seed(job.seed)
    reference = ctx.load_model(ctx.reference_model())
    run = setup(job, items, reference, dist)
    run.trainer = _train_step(run, task_tracker(ctx))
    _resume(run, checkpoint_plan(ctx))
    train_loop(run, ctx.report_progress)
    return finish(run, ctx.out_dir, t0)


def _readout(model: Any) -> Any:
    """A module whose forward is the value model's training read-out (`action_values`):
    what DDP / FSDP2 wrap, since their hooks run on a module's forward."""
    import torch

    class ValueReadout(torch.nn.Module):
        def __init__(self, inner: Any):
            super().__init__()
            self.inner = inner

        def forward(self, ids: Any, alt: Any = None) -> Any:
            return self.inner.action_values(ids, alt=alt)

    return ValueReadout(model)


def setup(job: ValueJob, items: Sequence[tuple], reference: Any, dist: Any = None) -> ValueRun:
    """Data, model, probe, batch arithmetic and optimizer, in the order the RNG streams
    expect (the caller seeded torch and loaded π_ref, `reference`)."""
    from pita.training.loop import enable_gradient_checkpointing

    algo, log = job.algo, job.logger
    pad_id = int(reference.config.pad_token_id if reference.config.pad_token_id is not None else 0)
    data, held = split_data(items, pad_id, algo.holdout_fraction, job.seed, log)
    model, init = build_model(
        reference,
        algo,
        job.family,
        job.previous,
        seed=job.seed,
        attn_impl=job.attn_impl,
        logger=log,
        task_id=job.task_id,
    )
    model.to(job.device).train()
    diagnostics = probe(model, data, held, job.device, algo.probe_steps, job.seed, log)
    checkpointing = enable_gradient_checkpointing(
        model.backbone, job.training.gradient_checkpointing, log
    )
    n = data["unique"]
    auto = not isinstance(algo.batch_size, int)  # auto: the probe picks the micro-batch
    run = ValueRun(
        job,
        data,
        held,
        model,
        init,
        checkpointing,
        batch=min(n, 256 if auto else int(algo.batch_size)),
        diagnostics=diagnostics,
    )
    run.dist = dist
    _batching(run, auto)
    run.optim, run.sched = build_optimizer(
        run.model.parameters(), algo, job.training, run.steps, job.device
    )
    return run


def split_data(
    items: Sequence[tuple],
    pad_id: int,
    holdout_fraction: float,
    seed: int,
    logger: logging.Logger,
) -> tuple[dict, dict | None]:
    """(training targets, held-out targets or None) in π_ref's padding."""
    from pita.algos import value_diagnostics

    items, held_items = value_diagnostics.split_holdout(items, holdout_fraction, seed)
    data = build_targets(items, pad_id)
    held = build_targets(held_items, pad_id) if held_items else None
    logger.info(
        "training data: %d records -> %d unique sequences, %d (state, action) targets%s",
        data["records"],
        data["unique"],
        data["states"],
        f"; held out: {held['records']} records of distinct prompts" if held else "",
    )
    return data, held


def build_model(
    reference: Any,
    algo: ValueGuidedConfig,
    family: Mapping[str, Any],
    previous: Path | None,
    *,
    seed: int,
    attn_impl: str,
    logger: logging.Logger,
    task_id: str,
) -> tuple[Any, str]:
    """(the model, its init): round k−1's checkpoint (`previous`, its train folder), else a
    fresh guide (warm-started from π_ref); its head must be the one the config trains."""
    from pita.models.value_model import ValueModel, build_value_model, head_atoms, value_init

    if previous is not None:
        prev = previous / Artifact.VALUE_MODEL
        model = ValueModel.load(prev, device="cpu", attn_impl=attn_impl)
        logger.info("warm start from the previous round's checkpoint %s", prev)
        init = f"previous:{previous.name}"
    else:
        model = build_value_model(
            reference,
            family,
            algo,
            vocab_size=reference.config.vocab_size,
            seed=seed,
            attn_impl=attn_impl,
            logger=logger,
        )
        init = value_init(algo, family)  # reference | base | scratch (issue 23)
    if model.num_outputs != head_atoms(algo.loss_type, algo.num_atoms):
        raise ValueError(
            f"{task_id}: checkpoint has {model.num_outputs} outputs per token but "
            f"loss_type={algo.loss_type} needs {head_atoms(algo.loss_type, algo.num_atoms)}"
        )
    if model.head_type != algo.value_head:
        raise ValueError(
            f"{task_id}: checkpoint has value_head={model.head_type}, config says {algo.value_head}"
        )
    return model, init


def probe(
    model: Any,
    data: dict,
    held: dict | None,
    device: Any,
    steps: int,
    seed: int,
    logger: logging.Logger,
) -> dict:
    """The frozen-backbone linear probe before any training step (`probe_steps` > 0 with a
    hold-out): its held-out accuracy, and a warning when the run looks set to plateau."""
    from pita.algos import value_diagnostics

    if held is None or steps <= 0:
        return {}
    accuracy = value_diagnostics.linear_probe(
        model, data, held, device, steps=int(steps), seed=seed
    )
    logger.info(
        "frozen-backbone linear probe (%d steps), held-out balanced accuracy by response "
        "position: %s",
        int(steps),
        value_diagnostics.format_positions(accuracy),
    )
    warning = value_diagnostics.plateau_warning(accuracy)
    if warning:
        logger.warning(warning)
    return {"probe_heldout_acc": accuracy}


def _batching(run: ValueRun, auto: bool) -> None:
    """The training set on the device, the loss, the micro-batch (the whole batch, halved by
    each OOM retry; `auto`: the probe's) and the steps."""
    import torch

    from pita.runtime.batching import training_micro_batch
    from pita.training.ddp import apply_gang
    from pita.training.loop import accumulation_plan, micro_batch_plan
    from pita.training.precision import training_precision

    job, algo, n, device = run.job, run.algo, run.n, run.device
    share = -(-run.batch // run.world)  # the largest rank's share of a step's batch
    micro, _ = micro_batch_plan(share, job.training, job.batch_scale, whole_batch=True)
    # The whole training set lives on the device (pre-tensorised, copied once): a step only
    # indexes it, so there is no per-step collation and no host<->device copy in the loop.
    run.tensors = tuple(_to_device(run.data[k], device) for k in ("ids", "alt", "target", "weight"))
    run.loss_fn = value_loss(run.model, run.tensors, str(algo.loss_type))
    if auto:  # worst case: the longest sequences, >= 2 optimizer steps, before the real optimizer
        loss_fn = run.loss_fn
        micro = training_micro_batch(
            model=run.model,
            batch=run.batch,
            seq_tokens=int(run.tensors[0].shape[1]),
            make_batch=lambda b: {"m": torch.arange(b, device=device) % n},
            loss_fn=lambda _model, mb: loss_fn(mb["m"])[0],
            fallback=micro,
            cache_key=dict(job.probe_key),
            safety_margin=job.safety_margin,
            batch_scale=job.batch_scale,
            logger=job.logger,
        )
        micro = _smallest_over_ranks(min(micro, share), run.dist)
    run.micro, run.n_micro = accumulation_plan(share, micro, job.training.accumulation_steps)
    if run.dist is not None:  # DDP / FSDP2 run their hooks on a module's forward
        run.precision = training_precision(job.training, run.device, logger=job.logger)
        run.net = apply_gang(_readout(run.model), run.dist, run.precision)
        run.loss_fn = value_loss(run.model, run.tensors, str(algo.loss_type), forward=run.net)
    run.steps = int(algo.steps) or int(algo.epochs) * math.ceil(n / run.batch)
    run.log_every = max(1, run.steps // 10)


def _smallest_over_ranks(value: int, dist: Any) -> int:
    """The smallest of the ranks' values (every rank must cut the same micro-batches)."""
    if dist is None:
        return value
    import torch
    import torch.distributed as tdist

    t = torch.tensor([value], device=dist.device)
    tdist.all_reduce(t, op=tdist.ReduceOp.MIN)
    return int(t.item())


def value_loss(
    model: Any, tensors: tuple, loss_type: str, forward: Callable[..., Any] | None = None
) -> Callable[[Any], Any]:
    """`loss_fn(m)`: the weighted mean loss of micro-batch m (indices into the unique
    sequences) and its accuracy. Untrained positions have weight 0 and drop out of the
    weighted means: no boolean indexing (it would wait for the device to count the selected
    positions). The head (Q- or V-type) is read through `action_values`: column t = the
    value of token t+1 (`forward(ids, alt)`: the same read-out, wrapped for a gang)."""
    from pita.algos import losses

    ids, alts, target, weight = tensors
    read = forward if forward is not None else (lambda x, alt: model.action_values(x, alt=alt))

    def loss_fn(m: Any):
        x, w, y = ids[m], weight[m].reshape(-1), target[m]
        bt = loss_type == "bradley_terry"
        out, alt = read(x, alts[m] if bt else None)  # [b, T-1, M]
        out = out.float()
        out, y = out.reshape(-1, out.shape[-1]), y.reshape(-1, y.shape[-1])
        if bt:  # P(y' ≻ y) = σ(v(s, a') − v(s, a)), a the competing token
            alt = alt.float().reshape(-1, out.shape[-1])
            diff = out[:, 0] - alt[:, 0]
            return losses.bradley_terry_loss(out[:, 0], alt[:, 0], y[:, 0], w), {
                "accuracy": _hits(diff, y[:, 0], w)
            }
        if loss_type == "mle":
            hit = (out.argmax(-1) == y.argmax(-1)).float()
            return losses.mle_loss(out, y, w), {
                "accuracy": (hit * w).sum() / w.sum().clamp_min(1e-12)
            }
        fn = losses.bce_loss if loss_type == "bce" else losses.mse_loss
        return fn(out[:, 0], y[:, 0], w), {"accuracy": _hits(out[:, 0], y[:, 0], w)}

    return loss_fn


def build_optimizer(
    params: Any, algo: ValueGuidedConfig, training: TrainingConfig, steps: int, device: Any
) -> tuple[Any, Any]:
    """(AdamW, fused on CUDA; its schedule: cosine with warmup, or `official`) over `steps`
    optimizer steps; `algos.<NAME>.weight_decay` unset falls back to `training.weight_decay`."""
    import torch
    from transformers import get_cosine_schedule_with_warmup

    wd = training.weight_decay if algo.weight_decay is None else algo.weight_decay
    optim = torch.optim.AdamW(params, lr=float(algo.lr), weight_decay=wd, **_fused_adamw(device))
    if algo.lr_schedule == "official":  # the Q# star-graph classifier's
        return optim, official_schedule(optim, steps)
    return optim, get_cosine_schedule_with_warmup(optim, min(100, steps // 10), steps)


def _train_step(run: ValueRun, tracker: Tracker) -> Any:
    """The TrainStep of `training.*` (precision, clipping), its metrics also to `tracker`;
    figures are read back once per logging window, not every step (no host sync per step)."""
    from pita.training.loop import TrainStep
    from pita.training.precision import training_precision

    job = run.job
    return TrainStep(
        run.net if run.net is not None else run.model,  # DDP: its no_sync while accumulating
        run.optim,
        run.precision or training_precision(job.training, run.device, logger=job.logger),
        scheduler=run.sched,
        max_grad_norm=job.training.max_grad_norm,
        clear_cache_interval=job.clear_cache_interval,
        device=run.device,
        logger=job.logger,
        sync_every=min(run.log_every, 50),
        tracker=tracker,
    )


def _resume(run: ValueRun, plan: CheckpointPlan) -> None:
    """The first shuffle, the start line, and the newest in-task checkpoint of `plan` if any
    (`training.checkpoint_every`: a retry continues from there)."""
    import torch

    run.gen = torch.Generator().manual_seed(run.job.seed)
    run.order, run.cursor = torch.randperm(run.n, generator=run.gen).to(run.device), 0
    run.job.logger.info(
        "training %s: %d steps, batch %d = micro %d x %d, lr %g, %s, init %s",
        str(run.algo.loss_type),
        run.steps,
        run.batch,
        run.micro,
        run.n_micro,
        run.algo.lr,
        run.trainer.precision.name,
        run.init,
    )
    run.ckpt = plan.checkpointer(
        run.job.logger,
        writer=run.dist is None or run.dist.is_main,
        collective=run.dist is not None,
    )
    run.saved = plan.objects(run.model, run.optim)
    model, optim = run.saved
    run.start, extra = run.ckpt.restore(
        model=model,
        optimizer=optim,
        scheduler=run.sched,
        step=run.trainer,
        max_step=run.steps,
    )
    if extra:
        run.order, run.cursor = extra["order"].to(run.device), extra["cursor"]
        run.gen.set_state(extra["gen"])


def train_loop(run: ValueRun, report_progress: Callable[..., None]) -> None:
    """Optimizer steps `start`..`steps`: a batch of unique sequences from the shuffled order
    (a fresh shuffle each epoch), micro-batches weighted by their share of the batch's
    weight, a log window every `log_every` steps, a checkpoint when due.
    `report_progress(done, total, unit, detail)`: the task's progress line."""
    import torch

    n, batch, weight = run.n, run.batch, run.tensors[3]
    model, optim = run.saved
    sched, gen = run.sched, run.gen
    detail = ""  # the last log window's loss, shown with every step's progress
    for step in range(run.start, run.steps):
        if run.cursor + batch > n:  # the next epoch, freshly shuffled
            run.order, run.cursor = torch.randperm(n, generator=gen).to(run.device), 0
        idx = run.order[run.cursor : run.cursor + batch]
        run.cursor += batch
        parts, shares = _micro_batches(run, idx, weight)
        run.trainer.run(parts, run.loss_fn, weights=shares, samples=len(idx))
        if (step + 1) % run.log_every == 0 or step + 1 == run.steps:
            detail = _log_window(run, step + 1)
        report_progress(step + 1, run.steps, "step", detail)
        run.ckpt.maybe_save(
            step + 1,
            lambda: {"model": model, "optimizer": optim, "scheduler": sched},
            step=run.trainer,
            extra=lambda o=run.order, c=run.cursor: {
                "order": o.cpu(),
                "cursor": c,
                "gen": gen.get_state(),
            },
        )


def _micro_batches(run: ValueRun, idx: Any, weight: Any) -> tuple[list, list]:
    """This process's micro-batches of a step's batch `idx` and their loss weights: each
    micro-batch's weighted mean counts by its share of the batch's weight (device tensors).

    On a gang the rank takes its strided share of `idx` in `n_micro` parts (the same count
    on every rank: FSDP2 reduce-scatters after each backward) and the weights are scaled by
    k, since DDP / FSDP2 average the ranks' gradients."""
    if run.dist is None:
        parts = list(idx.split(run.micro))
        if len(parts) == 1:
            return parts, [1.0]
        return parts, [weight[m].sum() / weight[idx].sum() for m in parts]
    mine = idx[run.dist.shard(len(idx), pad=False)]  # DistributedSampler's, unpadded
    total = weight[idx].sum()
    parts, shares = [], []
    for m in mine.tensor_split(run.n_micro):
        if len(m) == 0:  # a share shorter than n_micro: a no-op part keeps the collectives paired
            parts.append(mine[:1])
            shares.append(0.0)
        else:
            parts.append(m)
            shares.append(weight[m].sum() * run.world / total)
    return parts, shares


def _recent_means(run: ValueRun) -> tuple[list[dict], float, float]:
    """(the last window's metric rows, their mean loss, their mean accuracy)."""
    recent = run.trainer.metrics_rows()[-run.log_every :]
    mean_loss = sum(r["loss"] for r in recent) / len(recent)
    mean_acc = sum(r.get("accuracy", 0.0) for r in recent) / len(recent)
    return recent, mean_loss, mean_acc


def _log_window(run: ValueRun, done: int) -> str:
    """Log the window's mean loss / accuracy and the held-out accuracy by response position
    (where learning stops); returns the detail the progress line shows until the next."""
    from pita.algos import value_diagnostics
    from pita.training.ddp import gathered

    recent, mean_loss, mean_acc = _recent_means(run)
    log = run.job.logger
    log.info(
        "step %d/%d (epoch %.1f) loss %.4f acc %.3f lr %.2e",
        done,
        run.steps,
        done * run.batch / run.n,
        mean_loss,
        mean_acc,
        run.trainer.lr(),
    )
    if run.held is not None:
        with gathered(run.net, run.dist):  # FSDP2: the root's shards gathered for the read
            acc = value_diagnostics.heldout_accuracy(run.model, run.held, run.device)
        run.diagnostics["heldout_acc"] = acc
        recent[-1].update({f"heldout_pos{j}": a for j, a in acc.items()})
        log.info(
            "held-out balanced accuracy by response position: %s",
            value_diagnostics.format_positions(acc),
        )
    return f"loss {recent[-1]['loss']:.4f}"


def finish(run: ValueRun, out_dir: Path, t0: float) -> dict:
    """Save `value_model/` into `out_dir`, write the training report, return the stage's
    result (the last window's means: its rows survive a resume, they are in the checkpoint)."""
    from pita.training.ddp import full_state_dict
    from pita.training.report import write_training_report
    from pita.training.shards import save_consolidated, sharded_model

    _, mean_loss, mean_acc = _recent_means(run)
    folder = out_dir / Artifact.VALUE_MODEL
    if sharded_model(run.dist):  # FSDP2: each rank writes its shards, merged file by file
        save_consolidated(run.model, folder, run.dist.rank)
        if not run.dist.is_main:
            return {}
        run.model.eval().save_config(folder)
    else:
        state = full_state_dict(run.model, run.dist)  # every rank takes part (FSDP2 gathers)
        if run.dist is not None and not run.dist.is_main:
            return {}  # rank 0 writes the model, the report and the result
        run.model.eval().save(folder, state=state)
    perf = write_training_report(
        out_dir,
        run.trainer,
        micro_batch=run.micro,
        accumulation_steps=run.n_micro,
        world_size=run.world,
        gradient_checkpointing=run.checkpointing,
        title=run.job.task_id,
    )
    return {
        "steps": run.steps,
        "batch_size": run.batch,
        "micro_batch_size": run.micro * run.world,  # over the gang: the row does not depend on k
        "records": run.data["records"],
        "unique_sequences": run.n,
        "targets": run.data["states"],
        "final_loss": round(mean_loss, 5),
        "final_acc": round(mean_acc, 4),
        "init": run.init,
        "train_s": round(time.perf_counter() - t0, 2),
        "value_head": run.model.head_type,
        **run.diagnostics,
        **{k: perf[k] for k in ("precision", "samples_per_s", "peak_memory_mb")},
    }
