"""What the TRL-based stages (DPO, GRPO, GRPO-HF, the proxy reward model) share.

- `training_args(ctx, ConfigClass, ...)`: a TRL config (`DPOConfig`, `GRPOConfig`,
  `RewardConfig`) built from `training.*` and `algos.<NAME>.*` for the device the task
  runs on. TRL's own defaults are tuned for GPUs (bf16 on, gradient checkpointing on); here
  bf16 / fp16 are used only on CUDA and only as `training.mixed_precision` /
  `training.precision_type` say, gradient checkpointing only when
  `training.gradient_checkpointing` is on, `use_cpu` on CPU, `report_to="none"` (TRL's logs
  go to the task's tracker, pita/training/tracking.py), no hub, Trainer checkpoints only every
  `training.checkpoint_every` steps / `checkpoint_every_minutes` (a gang: by rank 0's
  clock) or when the run asks the task to stop at one (growth, pita/core/growth.py) into
  the task's `tasks/<id>.checkpoints/` (a retry, or the task on a larger gang, resumes from
  the newest whose proof verifies and runs exactly the remaining steps, `_train_resumable`,
  with the numbers of an uninterrupted run on any k: the Trainer's loss sums and TRL's
  unlogged metrics go into the checkpoint as the gang's, and the last step is logged,
  `last_step_logged`; the stage itself saves the final model with `save_pretrained`),
  and a constant learning rate without warmup (so a learning-rate sweep means what it says).
- The effective batch `algos.<NAME>.batch_size` is kept; it is cut into micro-batches with
  gradient accumulation (`micro_batches`: `training.micro_batch_size` × the task's
  `batch_scale` for hub models, the whole batch for the tiny models built in the run).
- `algos.<NAME>.trl` (`trl_options`) is handed to the TRL config last, so any field pita
  does not set from its own keys can be chosen (checked in the parent:
  pita/experiment/trl_options.py); `applied_options` records what the built config holds.
- `algos.<NAME>.peft` (`lora_config`): the trainer gets a LoRA config and trains only the
  adapter; `merged_adapter` saves it to the task's `adapter/` and merges it into the
  weights, so `model/` is a plain checkpoint for evaluation and the next round.
- `train_and_save`: the stage's ending (train with the report, save the model, the
  result's common part), the same for DPO, GRPO, GRPO-HF and the reward model.
- `StageLogCallback`: TRL's log lines go to the task's `log.txt`, to `train_log.jsonl`
  in the task folder and to the worker's heartbeat.
- `run_on_gang(ctx, body)`: the stage body on every rank of the task's gang
  (`task.gpus` > 1 with a DDP or FSDP `task.gang`, pita/experiment/gangs.py): the gang's
  ranks are the accelerate processes TRL expects (RANK / WORLD_SIZE / LOCAL_RANK /
  MASTER_ADDR / MASTER_PORT set and the process group up before the Trainer is built, so
  accelerate picks it up: `MULTI_CPU` on CPU, `MULTI_GPU` on CUDA, `FSDP` on CUDA under
  fsdp through `TrainingArguments(fsdp=True, fsdp_config={"version": 2, ...})`, the form
  transformers 5 keeps of `fsdp="full_shard auto_wrap"`).
  The effective batch is the gang's: each of k ranks takes 1/k of it, with the same data
  order (accelerate's seedable sampler, batches dealt to ranks in turn), so k ranks step as
  one process on the same examples. Rank 0 writes the task's files; `distributed_info`
  records the strategy that really ran (accelerate's `distributed_type`) in result.json.
- `offline()`: the hub is never contacted (HF_HUB_OFFLINE and friends), so a missing file
  fails fast instead of hanging a CPU box without network; no `datasets` progress bars.
- Where the checkpoints come from: `ctx.reference_model()` (π_ref), `policy_start_dir` (the policy
  a train stage starts from: the previous round's, else π_ref).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

from pita.core.parallel import Gang, Strategy
from pita.core.paths import Artifact
from pita.core.schema import GRPOConfig, PreferenceConfig, TrainedConfig
from pita.runtime.context import StageContext

OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
}


def offline() -> None:
    """Forbid every hub access from this process (env vars, and the already-imported flag)."""
    for key, value in OFFLINE_ENV.items():
        os.environ[key] = value
    try:  # huggingface_hub reads the variable at import; the worker may have imported it already
        from huggingface_hub import constants

        constants.HF_HUB_OFFLINE = True
    except ImportError:  # pragma: no cover - huggingface_hub always comes with transformers
        pass
    try:  # TRL tokenizes with datasets.map: no progress bars in the worker's log
        import datasets

        datasets.disable_progress_bars()
    except ImportError:  # pragma: no cover
        pass


# --- the task's gang -------------------------------------------------------------------------


def cpu_fsdp_note(task_id: str) -> str:
    """The one line a TRL task under `training.parallel_strategy=fsdp` logs where it runs DDP
    (CPU and `fake:` devices; the dry run prints the same line)."""
    return (
        f"{task_id}: training.parallel_strategy=fsdp runs DDP here (replicated ranks): "
        "accelerate has no FSDP on CPU, a TRL stage shards only on CUDA"
    )


def gang_rank() -> tuple[int, int]:
    """(rank, world size) of this process in the task's gang; (0, 1) outside one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def run_on_gang(ctx: StageContext, body: Any) -> dict:
    """`body(ctx, dist)` (a module-level function: it is pickled) on every rank of the task's
    gang, or here alone; rank 0's result. See the module docstring."""
    from pita.runtime.gang import run_stage

    if ctx.task.gpus > 1 and fsdp_runs_ddp(ctx.task.gang):
        ctx.logger.info(cpu_fsdp_note(ctx.task.id))
    return run_stage(ctx, body)


def fsdp_runs_ddp(gang: Gang) -> bool:
    """Whether the planner gave a gang DDP where the config asked FSDP (a TRL stage on CPU)."""
    return gang.asked is Strategy.FSDP and gang.strategy is Strategy.DDP


def distributed_info(trainer: Any) -> dict[str, Any]:
    """What really ran, for result.json: accelerate's `distributed_type` (NO, MULTI_CPU,
    MULTI_GPU, FSDP, ...), its number of processes and FSDP's version when sharded."""
    acc = trainer.accelerator
    kind = acc.distributed_type
    info: dict[str, Any] = {
        "distributed_type": str(getattr(kind, "value", kind)),
        "num_processes": int(acc.num_processes),
    }
    plugin = getattr(acc.state, "fsdp_plugin", None)
    if plugin is not None and info["distributed_type"] == "FSDP":
        info["fsdp_version"] = int(getattr(plugin, "fsdp_version", 1))
    return info


def fsdp_kwargs(ctx: StageContext, on_cuda: bool) -> dict[str, Any]:
    """TrainingArguments' FSDP2 fields for a task the planner gave `strategy=fsdp`, on CUDA
    only (accelerate has no FSDP on CPU: the planner never gives a TRL task fsdp there).
    Each transformer block is wrapped (`_no_split_modules`), parameters resharded after
    forward; the final model is gathered in full for `save_pretrained`.

    Checkpoints: `FULL_STATE_DICT`, so accelerate gathers the model and optimizer on rank 0
    and writes plain tensor pickles that pita proves load with `weights_only=True` and that
    resume on any k (`pita.training.checkpoint.last_trl_checkpoint`). Not
    `SHARDED_STATE_DICT`: accelerate writes it through DCP's `FileSystemWriter`, whose
    `.metadata` is a pickle read with `pickle.load` (a Trainer checkpoint holding DCP files
    is refused), or per-rank pickles that resume on the same k only. The price: a TRL stage
    under FSDP checkpoints only a model whose full state fits rank 0's host memory
    (pita's own loops shard theirs: `pita.training.shards`)."""
    if ctx.task.strategy is not Strategy.FSDP or not on_cuda:
        return {}
    return {
        # transformers 5 deprecates the string form ("full_shard auto_wrap"): fsdp=True and
        # the rest in fsdp_config (FSDP2's full shard is reshard_after_forward=True)
        "fsdp": True,
        "fsdp_config": {
            "version": 2,
            "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "reshard_after_forward": True,
            "state_dict_type": "FULL_STATE_DICT",
            "cpu_ram_efficient_loading": False,
            # FSDP's own activation checkpointing (the Trainer's would all-gather twice)
            "activation_checkpointing": bool(ctx.training.gradient_checkpointing),
        },
    }


# --- checkpoints --------------------------------------------------------------------------


def policy_start_dir(ctx: StageContext) -> str:
    """The policy a train stage starts from: round k−1's trained policy, else π_ref."""
    if ctx.has_input("previous"):
        return str(ctx.input("previous") / Artifact.MODEL)
    return ctx.reference_model()


def load_trainable_lm(ctx: StageContext, path: str):
    """A fresh fp32 copy of a causal LM for training (never the worker's cached copy: the
    trainers patch `forward` and change the weights), through the stages' one loader."""
    from pita.models.placement import load_stage_lm

    return load_stage_lm(
        path,
        family=ctx.task.family,
        family_cfg=ctx.cfg.model,
        device=ctx.device,
        attn_impl=ctx.system.attn_impl,
        trainable=True,
    )


def save_model(model: Any, tokenizer: Any, folder: Path, state_dict: Any = None) -> None:
    """`save_pretrained` of the unwrapped model and its tokenizer (loadable with from_pretrained;
    `state_dict`: the full weights gathered from FSDP shards); the trainer's unused, empty
    `output_dir` beside it is removed."""
    model.save_pretrained(folder, state_dict=state_dict)
    tokenizer.save_pretrained(folder)
    with contextlib.suppress(OSError):  # rmdir refuses a folder that is not empty
        (Path(folder).parent / Artifact.TRAINER_SCRATCH).rmdir()


# --- batch sizes and precision ------------------------------------------------------------


def whole_batches(trainer_cls: type, global_batch: int) -> type:
    """`trainer_cls` whose training sampler draws whole global batches each epoch, so no k
    ever trains on a partial last batch. Without it one process's last batch of an epoch
    holds the N mod B pairs left while k ranks' holds B (accelerate fills it up on every rank
    by wrapping around to the epoch's first examples): with 60 pairs and a batch of 8, one
    and two ranks end 9 % of an update apart. Here each epoch is a fresh seeded permutation
    (accelerate's `SeedableRandomSampler` keeps `num_samples`) cut to the largest multiple
    of B (the last N mod B examples of that epoch's order are left out, other ones each
    epoch), or, with fewer than B examples, cycled up to one batch; the same on any k
    (tests/test_trl_gang.py::test_trl_stages_on_two_ranks_match_one_process)."""
    from torch.utils.data import RandomSampler

    class WholeBatches(trainer_cls):
        def _get_train_sampler(self, train_dataset=None):
            sampler = super()._get_train_sampler(train_dataset)
            if type(sampler) is not RandomSampler or sampler.replacement:
                return sampler  # a strategy set through algos.<NAME>.trl: as TRL does it
            n = len(sampler.data_source)
            keep = max(global_batch, n - n % global_batch)
            return sampler if keep == n else RandomSampler(sampler.data_source, num_samples=keep)

    WholeBatches.__name__ = WholeBatches.__qualname__ = trainer_cls.__name__
    return WholeBatches


def effective_batch(ctx: StageContext, fallback: int = 64) -> int:
    """`algos.<NAME>.batch_size` (the effective batch); `auto` -> `fallback` (the micro-batch,
    not the effective batch, is what memory limits)."""
    value = ctx.algo_as(TrainedConfig).batch_size
    if isinstance(value, int):
        return value
    ctx.logger.info(
        "algos.%s.batch_size=%s: training uses an effective batch of %d",
        ctx.task.algo,
        value,
        fallback,
    )
    return fallback


def micro_batches(ctx: StageContext, batch: int) -> tuple[int, int]:
    """(micro-batch, accumulation steps) of a TRL stage: `micro_batch_plan`, with the whole
    batch at once for the tiny models built in the run (they have a `reference` input)."""
    from pita.training.loop import micro_batch_plan

    return micro_batch_plan(
        batch, ctx.training, ctx.task.batch_scale, whole_batch=ctx.has_input("reference")
    )


def precision_flags(ctx: StageContext) -> dict[str, bool]:
    """bf16 / fp16 for TRL configs from training.mixed_precision / precision_type, chosen
    by the shared training stack (TRL defaults to bf16, which must be off on a CPU)."""
    from pita.training.precision import trl_precision_kwargs

    return trl_precision_kwargs(ctx.training, ctx.device, logger=ctx.logger)


def train_with_report(ctx: StageContext, trainer: Any) -> dict[str, Any]:
    """trainer.train(), then the task's training_metrics.png and performance_summary.txt
    (the same report as the hand-written training loops); returns the summary."""
    from pita.runtime.kit import task_tracker
    from pita.training.checkpoint import time_checkpoint_callback
    from pita.training.loop import TrainingMetrics
    from pita.training.precision import training_precision
    from pita.training.report import trainer_metrics_callback, write_training_report
    from pita.training.tracking import trl_callback

    args = trainer.args
    world = max(1, int(getattr(args, "world_size", 1) or 1))
    per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * world
    metrics = TrainingMetrics(ctx.device)
    trainer.add_callback(trainer_metrics_callback(metrics, samples_per_step=per_step))
    if ctx.logger_settings.backend != "none":  # TRL reports to none: our tracker
        trainer.add_callback(trl_callback(task_tracker(ctx)))
    minutes = ctx.training.checkpoint_every_minutes
    if args.save_strategy != "no" and minutes > 0:
        trainer.add_callback(time_checkpoint_callback(minutes))
    trainer.add_callback(last_step_logged())
    _train_resumable(ctx, trainer, metrics)
    if not trainer.is_world_process_zero():
        return {}
    return write_training_report(
        ctx.out_dir,
        metrics,
        micro_batch=args.per_device_train_batch_size,
        accumulation_steps=args.gradient_accumulation_steps,
        world_size=world,
        gradient_checkpointing=ctx.training.gradient_checkpointing,
        precision=training_precision(ctx.training, ctx.device, logger=ctx.logger),
        title=ctx.task.id,
    )


def last_step_logged():
    """A TrainerCallback that logs the schedule's last step (the Trainer logs every
    `logging_steps`). Unlogged, the last steps' loss enters `train_loss` as rank 0's own
    share (transformers adds its running loss, not reduced over the gang, at the end), so a
    gang's `train_loss` would differ from one process' and from a run that grew; logged, it
    is the gang's mean like every other logged loss, whatever k ran which step."""
    from transformers import TrainerCallback

    class LogLastStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.max_steps > 0 and state.global_step >= state.max_steps:
                control.should_log = True

    return LogLastStep()


def _train_resumable(ctx: StageContext, trainer: Any, metrics: Any) -> None:
    """trainer.train(), resumed from the task's newest checkpoint whose proof verifies (see
    pita/training/checkpoint.py), with its train log, metric rows and loss sums replayed so
    the task's `train_log.jsonl` holds every step and `train_loss` covers them all. A
    checkpoint at the last step is loaded, not trained from: the Trainer would run one step
    past `max_steps`. Every torch.load of the Trainer is forced to `weights_only` (no
    pickle of a run folder runs code)."""
    from pita.runtime.kit import checkpoint_plan
    from pita.training import checkpoint as ck
    from pita.training.tracking import scoped_env

    args = trainer.args
    if args.save_strategy == "no":
        trainer.train()
        return
    train_log = ctx.out_dir / Artifact.TRAIN_LOG
    plan = checkpoint_plan(ctx)
    identity = dict(plan.identity)
    trainer.add_callback(ck.checkpoint_commit_callback(identity, train_log, metrics, trainer))
    max_steps = int(args.max_steps) if int(args.max_steps) > 0 else None
    resume = plan.last_trl(max_steps, ctx.logger)
    if resume:
        ctx.logger.info("resumed from checkpoint %s (step %s)", resume, resume.rsplit("-", 1)[-1])
        ck.restore_trl_logs(resume, train_log, metrics)
        trainer.add_callback(ck.resume_loop_callback(trainer, resume))
    guard = ck.resume_guard(resume, ctx.logger)
    trainer.add_callback(guard)
    # the run asks it to checkpoint and stop (growth)
    stop = ck.stop_callback(plan.stop_file, plan.on_request_only)
    if plan.stop_file is not None:
        trainer.add_callback(stop)
    with scoped_env({"TORCH_FORCE_WEIGHTS_ONLY_LOAD": "1"}), guard:
        if resume and max_steps is not None and int(resume.rsplit("-", 1)[-1]) >= max_steps:
            ck.finish_from_checkpoint(trainer, resume)
        else:
            trainer.train(resume_from_checkpoint=resume)
    if stop.stopped_at is not None:
        from pita.core.errors import StoppedAtCheckpoint

        ctx.logger.info("stopped at the checkpoint of step %d, as the run asked", stop.stopped_at)
        raise StoppedAtCheckpoint(stop.stopped_at)


def train_and_save(
    ctx: StageContext,
    trainer: Any,
    tokenizer: Any,
    artifact: str,
    logged: tuple[str, ...],
    options: str = "trl",
) -> tuple[Any, dict[str, Any]]:
    """The ending every TRL stage shares: `train_with_report` (resuming from the task's
    newest committed checkpoint; training_metrics.png, performance_summary.txt), then the
    trained model, unwrapped, with its tokenizer saved to `out_dir/<artifact>` (the task
    folder is committed atomically by the worker; the Trainer's empty scratch folder is
    removed, its checkpoints go with the task's checkpoint folder once committed).

    Returns (the trained model in eval mode, the common part of the stage's result:
    `steps`, the last logged value of each `logged` key, `performance` and the TRL options
    of `algos.<NAME>.<options>` as the built config holds them)."""
    performance = train_with_report(ctx, trainer)
    info = distributed_info(trainer)
    # FSDP: every rank takes part in gathering the full weights; rank 0 writes them
    state_dict = (
        trainer.accelerator.get_state_dict(trainer.model)
        if info["distributed_type"] == "FSDP"
        else None
    )
    model = trainer.accelerator.unwrap_model(trainer.model)
    if trainer.is_world_process_zero():
        model = merged_adapter(ctx, model)
        save_model(model, tokenizer, ctx.out_dir / artifact, state_dict)
    ctx.logger.info(
        "trained with %s over %d process(es)", info["distributed_type"], info["num_processes"]
    )
    return model.eval(), {
        "steps": trainer.state.global_step,
        **last_logged(trainer, *logged),
        "performance": performance,
        **applied_options(trainer.args, ctx, options),
        "distributed": info,
    }


# --- algos.<NAME>.trl and algos.<NAME>.peft --------------------------------------------------

ADAPTER = "adapter"  # the LoRA adapter's folder in the task folder (model/ holds it merged)


def trl_options(ctx: StageContext, key: str = "trl") -> dict[str, Any]:
    """`algos.<NAME>.trl` (or `.reward_trl`, the -HF reward model's) as a plain dict: any
    other TRL config field, checked in the parent (pita/experiment/trl_options.py: a field
    of the config, not one pita sets itself)."""
    return dict(getattr(ctx.algo, key))


def lora_config(ctx: StageContext):
    """peft's LoraConfig of `algos.<NAME>.peft` (keys and values checked in the parent,
    pita/core/schema.py `PEFT_KEYS`), or None for full fine-tuning."""
    algo = ctx.algo
    spec = algo.peft if isinstance(algo, (PreferenceConfig, GRPOConfig)) else None
    if spec is None:
        return None
    from peft import LoraConfig

    from pita.core.schema import PEFT_KEYS

    lora = {k: spec.get(k, default) for k, (default, _) in PEFT_KEYS.items()}
    return LoraConfig(
        r=int(lora["r"]),
        lora_alpha=float(lora["alpha"]),  # peft hints int; alpha / r takes a float
        lora_dropout=float(lora["dropout"]),
        target_modules=lora["target_modules"],
        task_type="CAUSAL_LM",
    )


def merged_adapter(ctx: StageContext, model: Any) -> Any:
    """A LoRA-trained model (a peft `PeftModel`): its adapter saved to the task's `adapter/`,
    then merged into the weights (`merge_and_unload`), so `model/` is a plain checkpoint that
    evaluation and the next round load unchanged. Any other model is returned as is."""
    if not hasattr(model, "merge_and_unload"):
        return model
    model.save_pretrained(ctx.out_dir / ADAPTER)
    merged = model.merge_and_unload()
    ctx.logger.info("LoRA adapter saved to %s/ and merged into the model", ADAPTER)
    return merged


def applied_options(args: Any, ctx: StageContext, key: str = "trl") -> dict[str, Any]:
    """For result.json: each `trl` option as the built TRL config holds it (after TRL's
    `__post_init__`: `scale_rewards=false` reads 'none', `loss_type=ipo` ['ipo']), and the
    LoRA spec; empty for a task that sets neither."""
    import enum

    def plain(value: Any) -> Any:
        if isinstance(value, enum.Enum):
            return value.value
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)

    out: dict[str, Any] = {}
    options = trl_options(ctx, key)
    if options:
        out[key] = {k: plain(getattr(args, k)) for k in options}
    lora = lora_config(ctx) if key == "trl" else None  # LoRA trains the policy only
    if lora is not None:
        target = lora.target_modules
        out["peft"] = {
            "r": lora.r,
            "alpha": lora.lora_alpha,
            "dropout": lora.lora_dropout,
            "target_modules": target if isinstance(target, str) else sorted(target),
        }
    return out


def _checkpointing_field(config_cls: type) -> str:
    """transformers 5 renamed gradient_checkpointing (a deprecated alias that warns) to
    activation_checkpointing: the name `config_cls` has."""
    names = {f.name for f in dataclasses.fields(config_cls)}
    new = "activation_checkpointing"
    return new if new in names else "gradient_checkpointing"


def _loader_fields(ctx: StageContext, on_cuda: bool) -> dict[str, Any]:
    """The Trainer's dataloader workers and pinning: algos.<NAME>.num_workers (the seed
    guide's key) wins; 0 there defers to training.num_workers; -1 = auto: this worker's
    thread budget - 1, at most 4 (`dataloader_kwargs`)."""
    from pita.training.loop import dataloader_kwargs

    tr = ctx.training
    workers = ctx.algo_as(TrainedConfig).num_workers or tr.num_workers
    loader = dataloader_kwargs(workers, tr.pin_memory, "cuda" if on_cuda else "cpu")
    return {
        "dataloader_num_workers": loader["num_workers"],
        "dataloader_pin_memory": loader["pin_memory"],
    }


def _house_fields(ctx: StageContext) -> dict[str, Any]:
    """What every pita TRL stage sets alike: a constant lr (a fair lr sweep: no hidden decay
    schedule), `training.*`'s decay, clipping and compile, the task's seed, about 20 log
    lines per run whatever its length, no tracker and no progress bar of TRL's own."""
    tr = ctx.training
    return dict(
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=tr.weight_decay,
        max_grad_norm=tr.max_grad_norm,
        torch_compile=bool(tr.compile),
        seed=ctx.seed,
        data_seed=ctx.seed,
        logging_steps=0.05,
        # TRL opens no tracker of its own (W&B would get a second run per task, MLflow its
        # refused file store): train_with_report forwards TRL's logs to the task's tracker
        report_to="none",
        run_name=ctx.task.id,
        push_to_hub=False,
        disable_tqdm=True,
    )


def _saving_fields(ctx: StageContext) -> dict[str, Any]:
    """Where and when the Trainer checkpoints (every training.checkpoint_every steps into
    tasks/<id>.checkpoints/); a gang saves by time too: rank 0's clock decides for every
    rank (time_checkpoint_callback)."""
    from pita.runtime.kit import checkpoint_plan

    return {
        "output_dir": str(ctx.out_dir / Artifact.TRAINER_SCRATCH),
        **checkpoint_plan(ctx).trl_kwargs(),
    }


def training_args(
    ctx: StageContext,
    config_cls: type,
    *,
    batch_size: int,
    lr: float,
    epochs: int = 1,
    steps: int = 0,
    options: dict[str, Any] | None = None,
    **extra: Any,
):
    """A TRL config for this task: effective batch, lr, epochs or steps, and CPU/GPU settings.

    `extra` are the trainer-specific fields (beta, num_generations, ...); `options`
    (`algos.<NAME>.trl`) come last, so they win over pita's defaults (lr_scheduler_type,
    warmup_steps, loss_type, ...); the fields pita sets from its own keys were refused in the
    parent, so they never reach here.
    """
    import torch

    offline()
    tr = ctx.training
    on_cuda = torch.device(ctx.device).type == "cuda" and torch.cuda.is_available()
    _, world = gang_rank()
    if batch_size % world:  # the planner checks integer batches; this is `auto`'s fallback
        raise ValueError(
            f"algos.{ctx.task.algo}.batch_size={batch_size}: the gang's {world} ranks each "
            f"take an equal share; use a multiple of {world}"
        )
    micro, accum = micro_batches(ctx, batch_size // world)  # each rank's share of the batch
    sharding = fsdp_kwargs(ctx, on_cuda)
    extra = {_checkpointing_field(config_cls): tr.gradient_checkpointing and not sharding, **extra}
    kwargs = dict(
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=accum,
        learning_rate=lr,
        num_train_epochs=epochs,
        max_steps=steps if steps > 0 else -1,
        use_cpu=not on_cuda,
        **_loader_fields(ctx, on_cuda),
        **_house_fields(ctx),
        **_saving_fields(ctx),  # checkpoints into tasks/<id>.checkpoints/
        **precision_flags(ctx),
        **sharding,
        **extra,
    )
    if options:
        shown = ", ".join(f"{k}={v!r}" for k, v in options.items())
        ctx.logger.info("algos.%s.trl: %s", ctx.task.algo, shown)
    args = config_cls(**{**kwargs, **(options or {})})
    shape = f"effective batch {batch_size} = {micro} micro x {accum} accumulation x {world} rank(s)"
    length = f"{steps} steps" if steps > 0 else f"{epochs} epoch(s)"
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    what = (config_cls.__name__, shape, lr, length, precision, ctx.device)
    ctx.logger.info("%s: %s, lr %.2e, %s, %s, device %s", *what)
    return args


# --- logging ------------------------------------------------------------------------------


def quiet(trainer: Any) -> Any:
    """Drop the Trainer's stdout printer (with tqdm off it prints every log dict); the
    stage's callback already writes them to the task log."""
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    return trainer


def stage_log_callback(ctx: StageContext):
    """A TrainerCallback writing TRL's logs to the task log, train_log.jsonl and the heartbeat."""
    from transformers import TrainerCallback

    path = ctx.out_dir / Artifact.TRAIN_LOG
    t0 = time.time()

    class StageLogCallback(TrainerCallback):
        live = ""  # the last logged loss / reward / kl, shown with every step's progress

        def on_step_end(self, args, state, control, **kwargs):
            ctx.report_progress(state.global_step, state.max_steps, "step", self.live)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not state.is_world_process_zero:  # a gang: rank 0 writes for all
                return
            logs = {k: v for k, v in (logs or {}).items() if isinstance(v, (int, float))}
            record = {
                "step": state.global_step,
                "max_steps": state.max_steps,
                "elapsed_s": round(time.time() - t0, 2),
                **logs,
            }
            with open(path, "a") as f:
                f.write(json.dumps(record) + "\n")
            shown = ", ".join(f"{k}={v:.4g}" for k, v in logs.items() if _worth_showing(k))
            ctx.logger.info("step %d/%d %s", state.global_step, state.max_steps, shown)
            self.live = " ".join(
                f"{k}={logs[k]:.3g}" for k in ("loss", "reward", "kl") if k in logs
            )
            ctx.report_progress(state.global_step, state.max_steps, "step", self.live)

    return StageLogCallback()


_SHOWN = (
    "loss",
    "reward",
    "kl",
    "rewards/",
    "accuracy",
    "margin",
    "logps/",
    "grad_norm",
    "entropy",
    "train_",
)


def _worth_showing(key: str) -> bool:
    return key.startswith(_SHOWN) or key in ("loss", "reward", "kl")


def last_logged(trainer: Any, *keys: str) -> dict[str, float]:
    """The most recent logged value of each key (for the stage's result.json)."""
    out: dict[str, float] = {}
    for record in reversed(trainer.state.log_history):
        for key in keys:
            if key not in out and key in record:
                out[key] = float(record[key])
    return out
