"""Structured config of pita: one dataclass per `conf/` group, with help text per field.

The dataclasses are registered in Hydra's ConfigStore as `pita_schema`, and
`conf/config.yaml` lists that schema first in its defaults, so an unknown key or a value
of the wrong type fails at compose time. `validate(cfg)` then checks what types cannot
express (ranges, choices, paths) and raises one `ConfigError` with a line per problem,
each naming the key and what is allowed. Both happen before any worker starts.

Keys documented by the seed guide (docs/guides/gpu_execution.txt) keep their names and meaning (experiment.name,
system.attn_impl, system.clear_cache_interval, system.use_parallel_execution,
training.micro_batch_size, training.gradient_checkpointing,
data_collection.reward_batch_size, generation.batch_size,
algos.<NAME>.enabled|batch_size|num_workers, rounds_of_training, resume_from).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pita.algos.registry import ALGO_NAMES, ANY
from pita.core.errors import ConfigError
from pita.core.gpu_manager import parse_device_memory, validate_devices_spec  # noqa: F401 (re-used by validate)
from pita.core.paths import RunPaths

BatchSize = Any  # an int > 0, or "auto" / "auto_batch_size"


def _help(text: str, default: Any = MISSING, **kw: Any) -> Any:
    """A dataclass field with TRL-style `metadata={"help": ...}` (one copy of the doc)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": text}, **kw)
    return field(default=default, metadata={"help": text}, **kw)


@dataclass
class ExperimentConfig:
    name: str = _help("Run folder name under outputs/ (letters, digits, . _ -).", "goal_walk")
    datasets: List[str] = _help(
        "Dataset group names for a multi-dataset experiment; empty = [dataset.name].", []
    )
    families: List[str] = _help("Model family group names; empty = [model.name].", [])
    seed: int = _help("Seed of everything random in the run.", 0)


@dataclass
class SystemConfig:
    devices: Any = _help("auto | cpu | [0,2] | fake:N | fake:[80GB,40GB]", "auto")
    gpu_mode: str = _help("auto | cpu | single_gpu | multi_gpu", "auto")
    attn_impl: str = _help("Attention implementation: eager | sdpa | flash_attention_2.", "eager")
    clear_cache_interval: int = _help(
        "Empty the CUDA cache every N training steps (0 = never).", 10
    )
    use_parallel_execution: bool = _help(
        "false runs every task in this process (debugging, pdb).", True
    )
    threads_per_worker: int = _help("torch threads per CPU worker.", 1)


@dataclass
class ExecutorConfig:
    backend: str = _help("local (worker processes on this machine) | inprocess | ray", "local")
    cpu_workers: Any = _help(
        "CPU worker count when no GPU is used: auto = cores / threads_per_worker.", "auto"
    )
    max_tasks_per_gpu: Any = _help(
        "Tasks that may share one GPU: auto = while their memory estimates fit "
        "(at most 8, and one per core of the device's share); an integer caps it; "
        "CPU slots run one task each under auto.",
        "auto",
    )
    max_tasks_per_worker: int = _help("Recycle a worker after this many tasks.", 200)
    max_retries: int = _help(
        "Retries of a task whose worker was killed, hit a CUDA fault or OOM.", 2
    )
    task_timeout_s: float = _help("Kill a task running longer than this (seconds).", 7200.0)
    heartbeat_s: float = _help("Seconds between worker heartbeats.", 2.0)
    heartbeat_timeout_s: float = _help("A worker silent this long is treated as lost.", 120.0)
    start_timeout_s: float = _help(
        "A worker that has not connected this long after its start is killed "
        "and its task retried on a fresh one (seconds).",
        60.0,
    )
    model_cache_size: int = _help("Models a worker keeps loaded between tasks (LRU).", 2)
    max_shards: int = _help("Upper bound on shards per shardable stage (0 = one per device).", 0)
    monitor_interval_s: float = _help(
        "Seconds between GPU/RSS samples and run.log summaries.", 30.0
    )
    progress: bool = _help("Live progress display of tasks per device.", True)
    preimport: bool = _help(
        "Workers import torch as soon as they start, overlapping planning.", True
    )
    stage_overrides: Dict[str, Dict[str, str]] = _help(
        "Replace stage functions: +executor.stage_overrides.QSharp.train=mypkg.mod:fn (algo 'any' = all).",
        {},
    )
    ray_address: Optional[str] = _help(
        "Ray cluster address for backend=ray (None = local Ray).", None
    )


@dataclass
class TrainingConfig:
    micro_batch_size: int = _help(
        "Examples per forward/backward; the rest is gradient accumulation.", 4
    )
    gradient_checkpointing: bool = _help(
        "Recompute activations in backward: less memory, slower.", False
    )
    mixed_precision: bool = _help("Use fp16/bf16 autocast on GPUs.", True)
    precision_type: str = _help(
        "auto | fp16 | bf16 (auto: bf16 on CC>=8.0, fp16 below, fp32 on CPU)", "auto"
    )
    accumulation_steps: int = _help("Gradient accumulation steps (0 = derived from batch_size).", 0)
    compile: bool = _help("torch.compile the model.", False)
    compile_mode: str = _help("default | reduce-overhead | max-autotune", "default")
    parallel_strategy: str = _help(
        "none | data_parallel (pretrain planned on a gang of every device, one DDP rank per device)",
        "none",
    )
    num_workers: int = _help(
        "DataLoader workers of TRL stages whose algos.<NAME>.num_workers is 0 (-1 = auto).", 0
    )
    pin_memory: bool = _help("Pin host memory in DataLoaders (GPU only).", False)
    max_grad_norm: float = _help("Gradient clipping norm (0 = off).", 1.0)
    weight_decay: float = _help("AdamW weight decay.", 0.0)
    checkpoint_every: int = _help(
        "Checkpoint a training task every N optimizer steps into tasks/<id>.checkpoints/ (0 = off); "
        "a retried or resumed task continues from its newest checkpoint.",
        0,
    )
    checkpoint_every_minutes: float = _help(
        "Also checkpoint when this many minutes passed since the last one (0 = off).", 10.0
    )


@dataclass
class LoggerConfig:
    """Experiment tracking (conf/logger/*.yaml; pita/training/tracking.py)."""

    backend: str = _help(
        "none | tensorboard | wandb | mlflow | csv (logs under <run>/logs/<backend>/)", "none"
    )
    project: str = _help("W&B project name.", "pita")
    mode: str = _help(
        "W&B mode: offline (sync later with `wandb sync`) | online | disabled.", "offline"
    )
    tracking_uri: Optional[str] = _help(
        "MLflow tracking URI (None = a file store in <run>/logs/mlruns).", None
    )


@dataclass
class GenerationConfig:
    batch_size: BatchSize = _help("Prompts per generation batch, or auto.", 256)
    max_new_tokens: int = _help("Longest response (0 = the task's own length).", 0)
    temperature: float = _help("Sampling temperature (offsets are added before it).", 1.0)
    top_p: float = _help("Nucleus sampling mass.", 1.0)
    top_k: int = _help("Sample among the top-k tokens (0 = all).", 0)


@dataclass
class DataCollectionConfig:
    reward_batch_size: BatchSize = _help("Sequences per reward-model forward, or auto.", 32)
    samples_per_example: int = _help("Roll-outs collected per training prompt per round.", 64)
    bradley_terry_beta: float = _help("β_BT of the Bradley–Terry draw for PITA labels.", 10.0)
    max_examples: int = _help("Use at most this many training prompts per round (0 = all).", 0)
    recipe: str = _help(
        "rollouts (roll-in / cut / roll-out) | ground_truth_vs_first_wrong (per prompt the "
        "known answer, label 1, and π_ref's first wrong sample, label 0: the Q# star-graph recipe)",
        "rollouts",
    )
    max_tries: int = _help(
        "ground_truth_vs_first_wrong: π_ref samples per prompt before it is dropped.", 1000
    )


@dataclass
class EvaluationConfig:
    batch_size: BatchSize = _help("Prompts per evaluation batch, or auto.", 512)
    num_samples: int = _help("Samples per test prompt (k of maj@k).", 4)
    etas: List[float] = _help(
        "Guidance strengths η evaluated for guided algorithms (η=0 is π_ref).",
        [0.0, 2.0, 5.0, 10.0],
    )
    max_prompts: int = _help("Evaluate at most this many test prompts (0 = all).", 0)


@dataclass
class PretrainConfig:
    steps: int = _help("Teacher-forced steps of the reference policy (offline tasks).", 400)
    batch_size: int = _help("Sequences per pretraining step.", 256)
    lr: float = _help("Peak AdamW learning rate.", 3e-3)
    warmup_steps: int = _help("Linear warmup steps before the cosine decay.", 20)
    # issue 23 (gpt2 helper): the official star-graph fine-tuning schedule, as an option
    lr_schedule: str = _help(
        "cosine (warmup_steps, decay to 0) | official (warmup max(100, 1%), cosine to 0.1·lr: "
        "the official star-graph pretraining of GPT-2)",
        "cosine",
    )
    weight_decay: Optional[float] = _help(
        "AdamW weight decay of pretraining (None = training.weight_decay).", None
    )


@dataclass
class DatasetConfig:
    """Union of every task's keys. Each `conf/dataset/<name>.yaml` sets its own; the rest
    stay None and are dropped (`dataset_keys`), so a key that does not belong to the
    selected task (e.g. dataset.degree on goal_walk) is reported by its validator."""

    name: str = _help("goal_walk | star_graph | gsm8k | math500 | aime | imdb | tldr", "goal_walk")
    seed: Optional[int] = _help("Seed of the task's data.", None)
    num_nodes: Optional[int] = _help("Graph nodes N (goal_walk, star_graph).", None)
    out_degree: Optional[int] = _help("Out-degree d of every node (goal_walk).", None)
    walk_length: Optional[int] = _help("Walk length L (goal_walk).", None)
    degree: Optional[int] = _help("Arms d of the star (star_graph).", None)
    path_length: Optional[int] = _help("Nodes per arm l (star_graph).", None)
    train_size: Optional[int] = _help("Training examples.", None)
    test_size: Optional[int] = _help("Test examples.", None)
    path: Optional[str] = _help("Local .jsonl file instead of the hub (hub tasks).", None)
    hub_id: Optional[str] = _help("Override the hub dataset id.", None)
    split: Optional[str] = _help("Hub split for evaluation.", None)
    max_prompt_tokens: Optional[int] = _help(
        "Truncate prompts to this many tokens (hub tasks).", None
    )
    max_new_tokens: Optional[int] = _help("Response budget (hub tasks).", None)
    train_path: Optional[str] = _help("Local .jsonl of training prompts (hub tasks).", None)
    train_split: Optional[str] = _help("Hub split of training prompts.", None)
    hub_config: Optional[str] = _help("Hub dataset config name (e.g. main for gsm8k).", None)
    cache_dir: Optional[str] = _help("datasets cache folder.", None)
    prompt_template: Optional[str] = _help("Python format string with {question}.", None)
    use_chat_template: Optional[bool] = _help(
        "Wrap prompts with the tokenizer's chat template.", None
    )
    prompt_words: Optional[int] = _help("Truncate prompt text to this many words.", None)


def dataset_keys(dataset_cfg: Any) -> dict:
    """The keys a dataset config actually sets (None = not this task's key)."""
    if isinstance(dataset_cfg, DictConfig):
        dataset_cfg = OmegaConf.to_container(dataset_cfg, resolve=True)
    return {k: v for k, v in dict(dataset_cfg).items() if v is not None}


@dataclass
class TinyModelConfig:
    n_layer: int = _help("Transformer blocks.", 1)
    d_model: int = _help("Hidden size.", 64)
    n_head: int = _help("Attention heads.", 4)


@dataclass
class ModelConfig:
    """A model family: reference policy + guide/value backbone (+ reward model)."""

    name: str = _help("Family alias (see pita/models/catalog.py); tiny = built in the run.", "tiny")
    reference: Optional[str] = _help("Hub id/path of the reference policy (None = catalog).", None)
    guide: Optional[str] = _help("Hub id/path of the guide/value backbone (None = catalog).", None)
    reward: Optional[str] = _help("Hub id/path of the reward model (None = catalog).", None)
    dtype: str = _help("auto | float32 | bfloat16 | float16", "auto")
    device_map: Optional[str] = _help("None | auto (shard over the task's gang).", None)
    trust_remote_code: bool = _help("Allow model repos to run their own code.", False)
    memory_gb: float = _help(
        "Estimated device memory of one stage's models (GB), for admission.", 0.5
    )
    gpus_per_task: int = _help("Devices per task (a gang); >1 shards the models.", 1)
    reference_arch: TinyModelConfig = field(default_factory=TinyModelConfig)
    guide_arch: TinyModelConfig = field(default_factory=lambda: TinyModelConfig(n_layer=2))


@dataclass
class GuidanceConfig:
    eta: float = _help("Default η (η multiplies the value; 0 = π_ref).", 10.0)
    mode: str = _help("bernoulli | mle | expectation", "bernoulli")
    top_k: int = _help("Guide among the reference's top-k tokens.", 2)


@dataclass
class AlgoConfig:
    """Union of every algorithm's keys (`conf/algo/*.yaml` set their own)."""

    enabled: bool = _help("Run this algorithm's chains.", False)
    batch_size: BatchSize = _help("Training batch size (effective), or auto.", 256)
    num_workers: int = _help(
        "DataLoader workers for this algorithm's training (0 = training.num_workers).", 0
    )
    lr: float = _help("Learning rate.", 1e-3)
    epochs: int = _help("Passes over the collected data.", 1)
    steps: int = _help("Optimizer steps (0 = from epochs).", 0)
    loss_type: str = _help("bce | mse | mle | bradley_terry", "bce")
    num_atoms: int = _help("Atoms of the distributional value (mle).", 11)
    V_min: float = _help("Smallest atom value.", 0.0)
    V_max: float = _help("Largest atom value.", 1.0)
    warm_start: bool = _help(
        "Copy the reference's embeddings/first block into the value model.", True
    )
    # issue 23 (gpt2 helper): where the value model starts; None keeps the old keys' meaning
    init: Optional[str] = _help(
        "Where the value model starts: reference (a copy of π_ref) | base (the family's "
        "pretrained guide checkpoint, fresh head: the official Q# classifier) | scratch "
        "(random weights). null: tiny -> warm_start (true: reference, false: scratch), "
        "hub/local families -> base.",
        None,
    )
    warm_start_layers: int = _help(
        "With warm_start: how many of the reference's blocks, bottom first, are copied "
        "(-1 = every block whose shape matches; 0 = embeddings and final norm only).",
        -1,
    )
    value_head: str = _help(
        "q (one value per vocabulary entry, read at the prefix) | v (candidate appended, "
        "scalar read at its own position: the official Q# classifier)",
        "q",
    )
    weight_decay: Optional[float] = _help(
        "AdamW weight decay of value training (None = training.weight_decay).", None
    )
    lr_schedule: str = _help(
        "cosine (warmup min(100, 10%), decay to 0) | official (warmup max(100, 10%), "
        "cosine to 0.1·lr: the Q# star-graph classifier)",
        "cosine",
    )
    holdout_fraction: float = _help(
        "Value training: fraction of prompts held out for per-position accuracy (0 = none).", 0.0
    )
    probe_steps: int = _help(
        "Value training with a hold-out: steps of a frozen-backbone linear probe "
        "run first, which warns when the run will sit on the plateau (0 = off).",
        200,
    )
    guidance: GuidanceConfig = field(default_factory=GuidanceConfig)
    beta: float = _help("KL coefficient (DPO β, GRPO β).", 0.1)
    num_generations: int = _help("GRPO group size.", 8)
    max_completion_length: int = _help("GRPO completion budget (0 = task length).", 0)
    sft_weight: float = _help(
        "Weight of an NLL term on the chosen responses (DPO; TRL's sigmoid+sft = RPO α).", 0.0
    )
    reward_lr: float = _help("Learning rate of the proxy reward model (-HF variants).", 1e-3)
    reward_epochs: int = _help("Epochs of the proxy reward model (-HF variants).", 1)
    samples_per_example: int = _help(
        "Samples per training prompt in this algorithm's collect (0 = data_collection.samples_per_example).",
        0,
    )
    pairs_per_example: int = _help(
        "DPO / -HF collect: at most this many preference pairs per training prompt.", 8
    )


@dataclass
class PitaConfig:
    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)
    system: SystemConfig = field(default_factory=SystemConfig)
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    data_collection: DataCollectionConfig = field(default_factory=DataCollectionConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    algos: Dict[str, AlgoConfig] = field(default_factory=dict)  # filled by conf/algo/*.yaml
    rounds_of_training: int = _help(
        "Rounds per chain (round r collects with round r-1's guide).", 1
    )
    batch_size_safety_margin: float = _help(
        "Fraction of free device memory the auto batch size may use; LOWER is safer.", 0.9
    )
    dry_run: bool = _help("Print the plan and exit without starting a worker.", False)
    resume_from: Optional[str] = _help("Run folder to resume (its saved config is reused).", None)


def register_configs() -> None:
    """Register the schema with Hydra (called by run_parallel.py and tests)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="pita_schema", node=PitaConfig)
    cs.store(group="algo", name="algo_schema", node=AlgoConfig)


# ---------------------------------------------------------------------------------------
# Validation: what types cannot express. Every message: "<key>=<value>: <what is allowed>".
# ---------------------------------------------------------------------------------------

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def _check(errors: list[str], ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        errors.append(f"{key}={value!r}: {allowed}")


def _is_batch(value: Any) -> bool:
    if isinstance(value, str):
        return value in ("auto", "auto_batch_size")
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def non_finite_errors(node: Any, key: str = "") -> list[str]:
    """`key=[0.0, inf]: item 1 (inf) must be a finite number` for every NaN/inf float in a
    resolved config (evaluation.etas, algos.*.beta, pretrain.lr, model.memory_gb, ...)."""
    if isinstance(node, float) and not math.isfinite(node):
        return [f"{key}={node}: must be a finite number"]
    if isinstance(node, dict):
        return [
            m
            for k, v in node.items()
            for m in non_finite_errors(v, f"{key}.{k}" if key else str(k))
        ]
    if isinstance(node, list):
        bad = [i for i, v in enumerate(node) if isinstance(v, float) and not math.isfinite(v)]
        if bad:
            return [f"{key}={node}: item {bad[0]} ({node[bad[0]]}) must be a finite number"]
        return [m for i, v in enumerate(node) for m in non_finite_errors(v, f"{key}[{i}]")]
    return []


def interpolation_error(cfg: DictConfig, exc: Exception, conf_dir: Path | None) -> str:
    """`experiment.name='${oops}': cannot resolve (Interpolation key 'oops' not found); set
    in conf/experiment/x.yaml` - one line with the key and, when found, the file."""
    key = str(getattr(exc, "full_key", "") or "")
    raw: Any = OmegaConf.to_container(cfg, resolve=False)
    for part in key.split(".") if key else []:
        raw = raw.get(part) if isinstance(raw, dict) else None
    where = "on the command line"
    if conf_dir is not None and isinstance(raw, str):
        for f in sorted(Path(conf_dir).rglob("*.yaml")):
            if raw in f.read_text(errors="replace"):
                where = f"in {f.relative_to(Path(conf_dir).parent)}"
                break
    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"{key or 'config'}={raw!r}: interpolation cannot be resolved ({detail}); set {where}"


def validate(cfg: DictConfig, *, project_root: Path | None = None) -> None:
    """Raise ConfigError listing every problem of a composed config."""
    try:
        resolved = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as exc:  # ${oops}: one line, not a traceback
        raise ConfigError(
            interpolation_error(cfg, exc, project_root / "conf" if project_root else None)
        ) from None
    non_finite = non_finite_errors(resolved)
    if non_finite:  # the range checks below would compare NaN and pass
        raise ConfigError(non_finite)
    errors: list[str] = []
    e = errors

    name = str(cfg.experiment.name)
    _check(
        e,
        bool(_NAME_RE.match(name)) and ".." not in name,
        "experiment.name",
        name,
        "letters, digits, '.', '_' and '-' only, no '..' (it names a folder inside outputs/)",
    )
    try:
        validate_devices_spec(cfg.system.devices)
    except ConfigError as exc:
        e.extend(exc.messages)
    _check(
        e,
        cfg.system.gpu_mode in ("auto", "cpu", "single_gpu", "multi_gpu"),
        "system.gpu_mode",
        cfg.system.gpu_mode,
        "allowed: auto | cpu | single_gpu | multi_gpu",
    )
    _check(
        e,
        cfg.system.attn_impl in ("eager", "sdpa", "flash_attention_2"),
        "system.attn_impl",
        cfg.system.attn_impl,
        "allowed: eager | sdpa | flash_attention_2",
    )
    _check(
        e,
        cfg.system.clear_cache_interval >= 0,
        "system.clear_cache_interval",
        cfg.system.clear_cache_interval,
        "must be >= 0 (0 = never)",
    )
    _check(
        e,
        cfg.system.threads_per_worker >= 1,
        "system.threads_per_worker",
        cfg.system.threads_per_worker,
        "must be >= 1",
    )

    ex = cfg.executor
    _check(
        e,
        ex.backend in ("local", "inprocess", "ray"),
        "executor.backend",
        ex.backend,
        "allowed: local | inprocess | ray",
    )
    _check(
        e,
        ex.cpu_workers == "auto" or (isinstance(ex.cpu_workers, int) and ex.cpu_workers >= 1),
        "executor.cpu_workers",
        ex.cpu_workers,
        "auto or an integer >= 1",
    )
    _check(
        e,
        ex.max_tasks_per_gpu == "auto"
        or (
            isinstance(ex.max_tasks_per_gpu, int)
            and not isinstance(ex.max_tasks_per_gpu, bool)
            and ex.max_tasks_per_gpu >= 1
        ),
        "executor.max_tasks_per_gpu",
        ex.max_tasks_per_gpu,
        "auto or an integer >= 1",
    )
    for key in ("max_tasks_per_worker", "model_cache_size"):
        _check(e, ex[key] >= 1, f"executor.{key}", ex[key], "must be >= 1")
    _check(e, ex.max_retries >= 0, "executor.max_retries", ex.max_retries, "must be >= 0")
    _check(
        e,
        ex.max_shards >= 0,
        "executor.max_shards",
        ex.max_shards,
        "must be >= 0 (0 = one per device)",
    )
    for key in (
        "task_timeout_s",
        "heartbeat_s",
        "heartbeat_timeout_s",
        "start_timeout_s",
        "monitor_interval_s",
    ):
        _check(e, ex[key] > 0, f"executor.{key}", ex[key], "must be > 0 seconds")
    _check(
        e,
        ex.heartbeat_timeout_s > ex.heartbeat_s,
        "executor.heartbeat_timeout_s",
        ex.heartbeat_timeout_s,
        f"must exceed executor.heartbeat_s ({ex.heartbeat_s})",
    )
    for algo_key, stages in (ex.stage_overrides or {}).items():
        _check(
            e,
            algo_key in ALGO_NAMES or algo_key == ANY,
            f"executor.stage_overrides.{algo_key}",
            algo_key,
            f"an algorithm name ({', '.join(ALGO_NAMES)}) or 'any'",
        )
        for stage_key, target in stages.items():
            _check(
                e,
                ":" in str(target),
                f"executor.stage_overrides.{algo_key}.{stage_key}",
                target,
                "a 'module.path:function' string",
            )

    tr = cfg.training
    _check(
        e,
        tr.micro_batch_size >= 1,
        "training.micro_batch_size",
        tr.micro_batch_size,
        "must be >= 1",
    )
    _check(
        e,
        tr.precision_type in ("auto", "fp16", "bf16", "fp32"),
        "training.precision_type",
        tr.precision_type,
        "allowed: auto | fp16 | bf16 | fp32",
    )
    _check(
        e,
        tr.accumulation_steps >= 0,
        "training.accumulation_steps",
        tr.accumulation_steps,
        "must be >= 0 (0 = derived)",
    )
    _check(
        e,
        tr.compile_mode in ("default", "reduce-overhead", "max-autotune"),
        "training.compile_mode",
        tr.compile_mode,
        "allowed: default | reduce-overhead | max-autotune",
    )
    _check(
        e,
        tr.parallel_strategy in ("none", "data_parallel"),
        "training.parallel_strategy",
        tr.parallel_strategy,
        "allowed: none | data_parallel",
    )
    _check(
        e, tr.num_workers >= -1, "training.num_workers", tr.num_workers, "must be >= -1 (-1 = auto)"
    )
    _check(
        e,
        tr.checkpoint_every >= 0,
        "training.checkpoint_every",
        tr.checkpoint_every,
        "must be >= 0 (0 = off)",
    )
    _check(
        e,
        tr.checkpoint_every_minutes >= 0,
        "training.checkpoint_every_minutes",
        tr.checkpoint_every_minutes,
        "must be >= 0 (0 = off)",
    )
    e.extend(logger_errors(cfg))

    _check(
        e,
        _is_batch(cfg.generation.batch_size),
        "generation.batch_size",
        cfg.generation.batch_size,
        "a positive integer or auto / auto_batch_size",
    )
    _check(
        e,
        cfg.generation.max_new_tokens >= 0,
        "generation.max_new_tokens",
        cfg.generation.max_new_tokens,
        "must be >= 0 (0 = the task's length)",
    )
    _check(
        e,
        cfg.generation.temperature > 0,
        "generation.temperature",
        cfg.generation.temperature,
        "must be > 0",
    )
    _check(
        e,
        0 < cfg.generation.top_p <= 1,
        "generation.top_p",
        cfg.generation.top_p,
        "must be in (0, 1]",
    )
    _check(e, cfg.generation.top_k >= 0, "generation.top_k", cfg.generation.top_k, "must be >= 0")
    _check(
        e,
        _is_batch(cfg.data_collection.reward_batch_size),
        "data_collection.reward_batch_size",
        cfg.data_collection.reward_batch_size,
        "a positive integer or auto / auto_batch_size",
    )
    _check(
        e,
        cfg.data_collection.recipe in ("rollouts", "ground_truth_vs_first_wrong"),
        "data_collection.recipe",
        cfg.data_collection.recipe,
        "allowed: rollouts | ground_truth_vs_first_wrong",
    )
    _check(
        e,
        cfg.data_collection.max_tries >= 1,
        "data_collection.max_tries",
        cfg.data_collection.max_tries,
        "must be >= 1",
    )
    _check(
        e,
        cfg.data_collection.samples_per_example >= 1,
        "data_collection.samples_per_example",
        cfg.data_collection.samples_per_example,
        "must be >= 1",
    )
    _check(
        e,
        _is_batch(cfg.evaluation.batch_size),
        "evaluation.batch_size",
        cfg.evaluation.batch_size,
        "a positive integer or auto / auto_batch_size",
    )
    _check(
        e,
        cfg.evaluation.num_samples >= 1,
        "evaluation.num_samples",
        cfg.evaluation.num_samples,
        "must be >= 1",
    )
    etas = list(cfg.evaluation.etas)
    _check(
        e,
        bool(etas) and all(isinstance(x, (int, float)) and x >= 0 for x in etas),
        "evaluation.etas",
        etas,
        "a non-empty list of numbers >= 0",
    )
    _check(
        e,
        0 < cfg.batch_size_safety_margin <= 1,
        "batch_size_safety_margin",
        cfg.batch_size_safety_margin,
        "a fraction in (0, 1]; lower is safer",
    )
    _check(
        e, cfg.rounds_of_training >= 1, "rounds_of_training", cfg.rounds_of_training, "must be >= 1"
    )
    _check(e, cfg.pretrain.steps >= 1, "pretrain.steps", cfg.pretrain.steps, "must be >= 1")
    _check(  # issue 23 (gpt2 helper)
        e,
        cfg.pretrain.lr_schedule in ("cosine", "official"),
        "pretrain.lr_schedule",
        cfg.pretrain.lr_schedule,
        "allowed: cosine | official",
    )

    m = cfg.model
    _check(
        e,
        m.dtype in ("auto", "float32", "bfloat16", "float16"),
        "model.dtype",
        m.dtype,
        "allowed: auto | float32 | bfloat16 | float16",
    )
    _check(
        e, m.device_map in (None, "auto"), "model.device_map", m.device_map, "allowed: null | auto"
    )
    _check(e, m.memory_gb > 0, "model.memory_gb", m.memory_gb, "must be > 0")
    _check(e, m.gpus_per_task >= 1, "model.gpus_per_task", m.gpus_per_task, "must be >= 1")

    enabled = []
    for name, algo in (cfg.algos or {}).items():
        if name not in ALGO_NAMES:
            e.append(f"algos.{name}: unknown algorithm; allowed: {', '.join(ALGO_NAMES)}")
            continue
        if not algo.enabled:
            continue
        enabled.append(name)
        _check(
            e,
            _is_batch(algo.batch_size),
            f"algos.{name}.batch_size",
            algo.batch_size,
            "a positive integer or auto / auto_batch_size",
        )
        _check(e, algo.lr > 0, f"algos.{name}.lr", algo.lr, "must be > 0")
        _check(e, algo.epochs >= 1, f"algos.{name}.epochs", algo.epochs, "must be >= 1")
        _check(
            e,
            algo.num_workers >= -1,
            f"algos.{name}.num_workers",
            algo.num_workers,
            "must be >= -1",
        )
        _check(
            e,
            algo.loss_type in ("bce", "mse", "mle", "bradley_terry"),
            f"algos.{name}.loss_type",
            algo.loss_type,
            "allowed: bce | mse | mle | bradley_terry",
        )
        _check(e, algo.num_atoms >= 2, f"algos.{name}.num_atoms", algo.num_atoms, "must be >= 2")
        _check(
            e,
            algo.V_min < algo.V_max,
            f"algos.{name}.V_min",
            algo.V_min,
            f"must be < algos.{name}.V_max ({algo.V_max})",
        )
        _check(
            e,
            algo.guidance.mode in ("bernoulli", "mle", "expectation", "expectation_clamped"),
            f"algos.{name}.guidance.mode",
            algo.guidance.mode,
            "allowed: bernoulli | mle | expectation | expectation_clamped",
        )
        _check(
            e,
            algo.value_head in ("q", "v"),
            f"algos.{name}.value_head",
            algo.value_head,
            "allowed: q | v",
        )
        _check(
            e,
            not (algo.value_head == "v" and algo.loss_type == "bradley_terry"),
            f"algos.{name}.value_head",
            algo.value_head,
            "v cannot train loss_type=bradley_terry (it scores one token per forward): use q",
        )
        _check(  # issue 23 (gpt2 helper)
            e,
            algo.init in (None, "reference", "base", "scratch"),
            f"algos.{name}.init",
            algo.init,
            "allowed: reference | base | scratch | null",
        )
        _check(
            e,
            algo.warm_start_layers >= -1,
            f"algos.{name}.warm_start_layers",
            algo.warm_start_layers,
            "allowed: -1 (every block) or a count of bottom blocks >= 0",
        )
        _check(
            e,
            algo.lr_schedule in ("cosine", "official"),
            f"algos.{name}.lr_schedule",
            algo.lr_schedule,
            "allowed: cosine | official",
        )
        _check(
            e,
            0 <= algo.holdout_fraction < 1,
            f"algos.{name}.holdout_fraction",
            algo.holdout_fraction,
            "a fraction in [0, 1)",
        )
        _check(
            e, algo.probe_steps >= 0, f"algos.{name}.probe_steps", algo.probe_steps, "must be >= 0"
        )
        _check(
            e,
            algo.weight_decay is None or algo.weight_decay >= 0,
            f"algos.{name}.weight_decay",
            algo.weight_decay,
            "must be >= 0 (or null = training.weight_decay)",
        )
        _check(
            e,
            algo.guidance.top_k >= 1,
            f"algos.{name}.guidance.top_k",
            algo.guidance.top_k,
            "must be >= 1",
        )
        _check(
            e,
            algo.samples_per_example >= 0,
            f"algos.{name}.samples_per_example",
            algo.samples_per_example,
            "must be >= 0 (0 = data_collection.samples_per_example)",
        )
        _check(
            e,
            algo.pairs_per_example >= 1,
            f"algos.{name}.pairs_per_example",
            algo.pairs_per_example,
            "must be >= 1",
        )
        _check(
            e,
            algo.num_generations >= 2,
            f"algos.{name}.num_generations",
            algo.num_generations,
            "must be >= 2 (GRPO needs a group)",
        )
    if not enabled and not e:
        e.append("algos: no algorithm enabled; set e.g. algos.QSharp.enabled=true")

    if cfg.resume_from is not None:
        e.extend(resume_path_errors(cfg.resume_from, project_root))

    from pita.datasets import validate_dataset_cfg

    try:
        validate_dataset_cfg(dataset_keys(cfg.dataset))
    except ValueError as exc:
        e.append(str(exc))
    if errors:
        raise ConfigError(errors)


def logger_errors(cfg: DictConfig) -> list[str]:
    """logger.*: a known backend whose package is installed."""
    from pita.training.tracking import BACKENDS, missing_package

    lg = cfg.get("logger")
    if lg is None:
        return []
    if lg.backend not in BACKENDS:
        return [
            f"logger.backend={lg.backend!r}: allowed: {' | '.join(BACKENDS)} (or logger=<name>)"
        ]
    need = missing_package(str(lg.backend))
    if need:
        return [f"logger={lg.backend}: the {lg.backend} package is not installed; {need}"]
    if lg.backend == "wandb" and lg.mode not in ("offline", "online", "disabled"):
        return [f"logger.mode={lg.mode!r}: allowed: offline | online | disabled"]
    return []


def resume_path_errors(path: str, project_root: Path | None = None) -> list[str]:
    """Why `resume_from=<path>` cannot be resumed (empty list: it can)."""
    p = Path(path).expanduser()
    if not p.is_absolute() and project_root is not None and not p.exists():
        p = project_root / p
    if not p.exists():
        return [f"resume_from={path!r}: no such run folder"]
    if not p.is_dir():
        return [f"resume_from={path!r}: not a folder; pass outputs/<name>/<timestamp>"]
    if not RunPaths(p).saved_config.is_file():
        return [
            f"resume_from={path!r}: no saved config (.hydra/config.yaml); not a pita run folder"
        ]
    if not RunPaths(p).plan.is_file():
        return [f"resume_from={path!r}: no plan.json; the run never started, start it afresh"]
    return []
