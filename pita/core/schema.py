"""The structured config of pita: one dataclass per `conf/` group, each field with its help
text and the values it allows.

Every fact about a key lives on its field, once: `spec(help, default, ge=1)` says what
the key means and what is allowed, and three readers use it: Hydra (registered as
`pita_schema` in pita/experiment/config.py, so an unknown key or a wrong type fails at
compose time), the walker `schema_errors` (one line per bad value, `<key>=<value>: <what is
allowed>`, before any worker starts) and `--help` (pita/experiment/cli_extras.py). Modules
that act on a choice import its list from here (`GUIDANCE_MODES` in pita/algos/guidance.py,
`PRECISION_TYPES` in pita/training/precision.py, ...) instead of writing it again.

Algorithms have one schema per family (`ReferenceConfig`, `ValueGuidedConfig`,
`PreferenceConfig`, `GRPOConfig`, + `RewardModelMixin` for the -HF variants): each row of
pita/algos/registry.py names its own, and each `conf/algo/<name>.yaml` starts from it
(Hydra's "structured config schema" pattern), so a key an algorithm does not have
(`algos.DPO.num_atoms`) is an unknown key. What relates two keys (V_min < V_max, ...) is
checked by `validate` in pita/experiment/config.py.

This module is torch-free and imports nothing of pita but `pita.core.parallel` (the parallel
strategies' names, owned there): it sits below every reader.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import re
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field
from typing import Any, Dict, List, Optional, TypeVar

from pita.core.parallel import AUTO
from pita.core.parallel import KEYS as STRATEGY_KEYS

# --- choice lists (each owned here; the modules that act on them import them) ---------------

GPU_MODES = ("auto", "cpu", "single_gpu", "multi_gpu")
PRETRAIN_SCHEDULES = ("cosine", "official")
VALUE_INITS = ("reference", "base", "scratch")  # where a value model starts (issue 23)
ATTN_IMPLS = ("eager", "sdpa", "flash_attention_2")
EXECUTOR_BACKENDS = ("local", "inprocess", "ray")
PRECISION_TYPES = ("auto", "fp16", "bf16", "fp32")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")
PARALLEL_STRATEGIES = (AUTO, *STRATEGY_KEYS)  # pita/core/parallel.py names them
LOGGER_BACKENDS = ("none", "tensorboard", "wandb", "mlflow", "csv")
WANDB_MODES = ("offline", "online", "disabled")
RECIPES = ("rollouts", "ground_truth_vs_first_wrong")
MODEL_DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICE_MAPS = (None, "auto")
LOSS_TYPES = ("bce", "mse", "mle", "bradley_terry")
VALUE_HEADS = ("q", "v")
LR_SCHEDULES = ("cosine", "official")
GUIDANCE_MODES = ("bernoulli", "mle", "expectation", "expectation_clamped")
AUTO_BATCH = ("auto", "auto_batch_size")  # a batch size the runtime searches for
FOLDER_NAME = r"(?!.*\.\.)[A-Za-z0-9][A-Za-z0-9._-]{0,99}"  # one path component, no '..'

SEED_MAX = 2**32 - 1  # numpy's seeds stop there
BATCH_MAX = 1 << 20
DAY_S, WEEK_S = 86_400.0, 604_800.0
UNKNOWN_KEY = "unknown key (not in pita's config schema, see conf/ and pita/core/schema.py)"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _num(x: float) -> str:
    return f"{x:g}"


@dataclass(frozen=True)
class Rule:
    """What a key allows. `ok` checks a value, `text` says what is allowed (the error
    message's tail and the `--help` hint). None passes unless `choices` lists it (an
    optional key left unset); `allowed` replaces the generated text where it reads badly."""

    choices: tuple | None = None
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    auto: bool = False  # "auto", or an integer within the bounds
    batch: bool = False  # a positive integer, or auto / auto_batch_size
    pattern: str | None = None
    items: bool = False  # a non-empty list whose items are within the bounds
    allowed: str | None = None
    note: str | None = None

    def ok(self, value: Any) -> bool:
        if self.choices is not None:
            return value in self.choices
        if value is None:
            return True
        if self.batch:
            if isinstance(value, str):
                return value in AUTO_BATCH
            return _is_int(value) and value > 0 and self._in(value)
        if self.pattern is not None:
            return isinstance(value, str) and re.fullmatch(self.pattern, value) is not None
        if self.items:
            return isinstance(value, (list, tuple)) and bool(value) and all(map(self._in, value))
        if self.auto and value == "auto":
            return True
        return (_is_int(value) if self.auto else _is_number(value)) and self._in(value)

    def _in(self, x: Any) -> bool:
        return _is_number(x) and not (
            (self.ge is not None and x < self.ge)
            or (self.gt is not None and x <= self.gt)
            or (self.le is not None and x > self.le)
            or (self.lt is not None and x >= self.lt)
        )

    @property
    def bounded(self) -> bool:
        return any(b is not None for b in (self.ge, self.gt, self.le, self.lt))

    def text(self, value: Any = None) -> str:
        """What the key allows; for a number out of range, the bound it crossed (a ceiling
        is named only to the value above it, so `must be >= 1` stays what a 0 reads)."""
        base = self.allowed or self._generated(value)
        return f"{base} ({self.note})" if self.note else base

    def _generated(self, value: Any = None) -> str:
        if self.choices is not None:
            return "allowed: " + " | ".join("null" if c is None else str(c) for c in self.choices)
        if self.batch:
            ceiling = f" <= {_num(self.le)}" if self.le is not None else ""
            return f"a positive integer{ceiling} or auto / {AUTO_BATCH[1]}"
        lo = f">= {_num(self.ge)}" if self.ge is not None else None
        lo = f"> {_num(self.gt)}" if self.gt is not None else lo
        hi = f"<= {_num(self.le)}" if self.le is not None else None
        hi = f"< {_num(self.lt)}" if self.lt is not None else hi
        if self.items:
            return f"a non-empty list of numbers {lo}"
        if self.auto:
            return f"auto or an integer {lo}"
        if lo and hi and _is_number(value):
            above = (self.le is not None and value > self.le) or (
                self.lt is not None and value >= self.lt
            )
            return f"must be {hi}" if above else f"must be {lo}"
        if lo and hi:
            left = f"[{_num(self.ge)}" if self.ge is not None else f"({_num(self.gt or 0)}"
            right = f"{_num(self.le)}]" if self.le is not None else f"{_num(self.lt or 0)})"
            return f"must be in {left}, {right}"
        return f"must be {lo or hi}"


# What changing a key changes (`spec(affects=...)`); four lists are derived from it: the keys a
# resume may change (and the CLI's refusal text), what a checkpoint's identity leaves out, the
# duration cache's key (pita/experiment/durations.py) and, with `memory=True`, the peak cache's.
AFFECTS = (
    "result",  # what a task computes (and so how long it works)
    "place",  # where and how fast it runs, never what: devices, workers, timeouts
    "record",  # only what is recorded around the result: trackers, progress, dry run
)


def spec(
    help: str, default: Any = MISSING, *, affects: str = "result", memory: bool = False, **rule: Any
) -> Any:
    """A dataclass field with TRL-style `metadata={"help": ...}`, what changing it affects
    (`AFFECTS`), whether it changes a task's device-memory peak (`memory`) and, when `rule`
    names any, the `Rule` of what the key allows."""
    assert affects in AFFECTS, f"affects={affects!r}: one of {AFFECTS}"
    meta: dict[str, Any] = {"help": help, "affects": affects, "memory": memory}
    if rule:
        meta["rule"] = Rule(**rule)
    if isinstance(default, (list, dict)):
        return field(default_factory=functools.partial(copy.copy, default), metadata=meta)
    return field(default=default, metadata=meta)


def rule_of(f: dataclasses.Field) -> Rule | None:
    return f.metadata.get("rule")


def nested_schema(f: dataclasses.Field) -> type | None:
    """The dataclass of a nested group field (`model.reference_arch`), else None."""
    if f.default_factory is MISSING:
        return None
    value = f.default_factory()
    return type(value) if dataclasses.is_dataclass(value) else None


# BatchSize: an int > 0, or "auto" / "auto_batch_size"; Any lets Hydra accept both.
BatchSize = Any


@dataclass
class ExperimentConfig:
    name: str = spec(
        "Run folder name under outputs/.",
        "goal_walk",
        pattern=FOLDER_NAME,
        allowed="letters, digits, '.', '_' and '-' only, no '..' (it names a folder inside outputs/)",
    )
    datasets: List[str] = spec(
        "Dataset group names for a multi-dataset experiment; empty = [dataset.name].", []
    )
    families: List[str] = spec("Model family group names; empty = [model.name].", [])
    dataset_file: Optional[str] = spec(
        "The conf/dataset file selected (dataset=<file>), recorded by pita from Hydra's choice: "
        "the listed dataset of that file takes the dataset.* overrides.",
        None,
    )
    seed: int = spec("Seed of everything random in the run.", 0, ge=0, le=SEED_MAX)


@dataclass
class SystemConfig:
    devices: Any = spec("auto | cpu | [0,2] | fake:N | fake:[80GB,40GB]", "auto", affects="place")
    gpu_mode: str = spec(
        "How many devices a run may use.", "auto", choices=GPU_MODES, affects="place"
    )
    attn_impl: str = spec("Attention implementation.", "eager", choices=ATTN_IMPLS, memory=True)
    clear_cache_interval: int = spec(
        "Empty the CUDA cache every N training steps.",
        10,
        ge=0,
        note="0 = never",
        affects="place",
        le=1_000_000,
    )
    use_parallel_execution: bool = spec(
        "false runs every task in this process (debugging, pdb).", True, affects="place"
    )
    threads_per_worker: int = spec(
        "torch threads per CPU worker.", 1, ge=1, le=1_024, affects="place"
    )
    trust_group: bool = spec(
        "Use a run folder owned by a teammate of one of your groups (resume a shared run).",
        False,
        affects="place",
    )


@dataclass
class ExecutorConfig:
    backend: str = spec(
        "local (worker processes on this machine), inprocess or ray.",
        "local",
        choices=EXECUTOR_BACKENDS,
        affects="place",
    )
    cpu_workers: Any = spec(
        "CPU worker count when no GPU is used: auto = cores / threads_per_worker.",
        "auto",
        auto=True,
        ge=1,
        le=1_024,
        affects="place",
    )
    max_tasks_per_gpu: Any = spec(
        "Tasks that may share one GPU: auto = while their memory estimates fit "
        "(at most 8, and one per core of the device's share); an integer caps it; "
        "CPU slots run one task each under auto.",
        "auto",
        auto=True,
        ge=1,
        le=64,
        affects="place",
    )
    max_tasks_per_worker: int = spec(
        "Recycle a worker after this many tasks.", 200, ge=1, le=1_000_000, affects="place"
    )
    max_retries: int = spec(
        "Retries of a task whose worker was killed, hit a CUDA fault or OOM.",
        2,
        ge=0,
        le=100,
        affects="place",
    )
    task_timeout_s: float = spec(
        "Kill a task running longer than this (seconds).",
        7200.0,
        gt=0,
        note="seconds",
        affects="place",
        le=WEEK_S,
    )
    gang_stall_s: Optional[float] = spec(
        "A k-rank task (a gang) one of whose ranks makes no training step for this long is "
        "killed and retried as `stalled` (seconds). None: 20 x the longest gap between two "
        "of its steps so far, at least 300 s, once it has stepped twice.",
        None,
        gt=0,
        note="seconds",
        affects="place",
        le=DAY_S,
    )
    heartbeat_s: float = spec(
        "Seconds between worker heartbeats.", 2.0, gt=0, note="seconds", affects="place", le=DAY_S
    )
    heartbeat_timeout_s: float = spec(
        "A worker silent this long is treated as lost (> heartbeat_s).",
        120.0,
        gt=0,
        note="seconds",
        affects="place",
        le=DAY_S,
    )
    start_timeout_s: float = spec(
        "A worker that has not connected this long after its start is killed "
        "and its task retried on a fresh one (seconds).",
        60.0,
        gt=0,
        note="seconds",
        affects="place",
        le=DAY_S,
    )
    model_cache_size: int = spec(
        "Models a worker keeps loaded between tasks (LRU).", 2, ge=1, le=64, affects="place"
    )
    max_ranks_per_task: int = spec(
        "Most ranks (devices) a data-parallel training task may get; its k in 1, 2, 4, ... is "
        "chosen when it is dispatched by simulating the rest of the plan (pita/core/elastic.py).",
        8,
        ge=1,
        le=1_024,
        note="1 = off",
        affects="place",
    )
    grow_idle_s: float = spec(
        "Seconds devices stay idle (no ready task wants them) before a running data-parallel "
        "training task that would end sooner on more ranks is asked to checkpoint and restart "
        "on a larger gang (pita/core/growth.py).",
        2.0,
        ge=0,
        note="0 = never grow",
        le=1e6,
        affects="place",
    )
    max_shards: int = spec(
        "Upper bound on shards per shardable stage.",
        0,
        ge=0,
        note="0 = one per device",
        le=1_024,
        affects="place",
    )
    monitor_interval_s: float = spec(
        "Seconds between GPU/RSS samples and run.log summaries.",
        30.0,
        gt=0,
        note="seconds",
        affects="record",
        le=DAY_S,
    )
    progress: bool = spec("Live progress display of tasks per device.", True, affects="record")
    timeline_plot: bool = spec(
        "Draw results/timeline.png at the end of a run (matplotlib: about a second; time.md"
        " and time.csv are written either way).",
        True,
        affects="record",
    )
    preimport: bool = spec(
        "Workers import torch as soon as they start, overlapping planning; on CPU and fake"
        " devices they fork from a forkserver that imported it once (false: they start fresh"
        " and only a stage that uses torch imports it).",
        True,
        affects="place",
    )
    stage_overrides: Dict[str, Dict[str, str]] = spec(
        "Replace stage functions: +executor.stage_overrides.QSharp.train=mypkg.mod:fn (algo 'any' = all).",
        {},
    )
    ray_address: Optional[str] = spec(
        "Ray cluster address for backend=ray (None = local Ray).", None, affects="place"
    )
    ray_placement_timeout_s: float = spec(
        "backend=ray: seconds Ray may take to reserve the cluster's device slots (one"
        " placement group) before the run stops with one line saying what was asked and"
        " what the cluster offers.",
        120.0,
        gt=0,
        le=WEEK_S,
        affects="place",
    )


@dataclass
class TrainingConfig:
    micro_batch_size: int = spec(
        "Examples per forward/backward; the rest is gradient accumulation.",
        4,
        ge=1,
        le=65_536,
        memory=True,
    )
    gradient_checkpointing: bool = spec(
        "Recompute activations in backward: less memory, slower.", False, memory=True
    )
    mixed_precision: bool = spec("Use fp16/bf16 autocast on GPUs.", True, memory=True)
    precision_type: str = spec(
        "auto: bf16 on CC>=8.0, fp16 below, fp32 on CPU.",
        "auto",
        choices=PRECISION_TYPES,
        memory=True,
    )
    accumulation_steps: int = spec(
        "Gradient accumulation steps.", 0, ge=0, note="0 = derived", le=65_536, memory=True
    )
    compile: bool = spec("torch.compile the model.", False, memory=True)
    compile_mode: str = spec("torch.compile mode.", "default", choices=COMPILE_MODES)
    parallel_strategy: str = spec(
        "How a training stage uses a gang of devices: data_parallel = DDP (replicated ranks), "
        "1..executor.max_ranks_per_task of them, k chosen at dispatch by simulating the rest of "
        "the plan and grown at a checkpoint; fsdp = FSDP2 on every device (parameters, "
        "gradients and optimizer state sharded; a TRL stage runs DDP on CPU, where accelerate "
        "has no FSDP); none = one device. auto = data_parallel on more than one CUDA GPU, none "
        "on CPU and fake: devices (their ranks share the CPU cores), resolved once when the run "
        "starts (a resume keeps it). A training task too large for one device gets the "
        "smallest FSDP gang that fits whatever this says.",
        "auto",
        choices=PARALLEL_STRATEGIES,
        memory=True,
    )
    num_workers: int = spec(
        "DataLoader workers of TRL stages whose algos.<NAME>.num_workers is 0.",
        0,
        ge=-1,
        note="-1 = auto",
        le=256,
    )
    pin_memory: bool = spec("Pin host memory in DataLoaders (GPU only).", False)
    max_grad_norm: float = spec("Gradient clipping norm.", 1.0, ge=0, note="0 = off", le=1e6)
    weight_decay: float = spec("AdamW weight decay.", 0.0, ge=0, le=10)
    checkpoint_every: int = spec(
        "Checkpoint a training task every N optimizer steps into tasks/<id>.checkpoints/; "
        "a retried or resumed task continues from its newest checkpoint.",
        0,
        ge=0,
        note="0 = off",
        le=100_000_000,
    )
    checkpoint_every_minutes: float = spec(
        "Also checkpoint when this many minutes passed since the last one.",
        10.0,
        ge=0,
        note="0 = off",
        le=1e6,
    )


@dataclass
class LoggerConfig:
    """Experiment tracking (conf/logger/*.yaml; pita/training/tracking.py)."""

    backend: str = spec(
        "Experiment tracker; logs under <run>/logs/<backend>/.",
        "none",
        choices=LOGGER_BACKENDS,
        note="or logger=<name>",
        affects="record",
    )
    project: str = spec("W&B project name.", "pita", affects="record")
    mode: str = spec(
        "W&B mode: offline (no API key; `wandb sync` later); beats WANDB_MODE.",
        "offline",
        choices=WANDB_MODES,
        affects="record",
    )
    tracking_uri: Optional[str] = spec(
        "MLflow tracking URI (None = one sqlite store outputs/mlflow/mlflow.db for every run "
        "under outputs/; a run folder outside outputs/: <run>/logs/mlflow/).",
        None,
        affects="record",
    )
    tags: List[str] = spec(
        "Tags of every tracked run (W&B tags, MLflow tags, TensorBoard text).", [], affects="record"
    )


@dataclass
class GenerationConfig:
    batch_size: BatchSize = spec(
        "Prompts per generation batch, or auto.", 256, batch=True, memory=True, le=BATCH_MAX
    )
    max_new_tokens: int = spec(
        "Longest response.", 0, ge=0, note="0 = the task's length", le=131_072, memory=True
    )
    temperature: float = spec(
        "Sampling temperature (offsets are added before it).", 1.0, gt=0, le=100
    )
    top_p: float = spec("Nucleus sampling mass.", 1.0, gt=0, le=1)
    top_k: int = spec("Sample among the top-k tokens (0 = all).", 0, ge=0, le=1_000_000)


@dataclass
class DataCollectionConfig:
    reward_batch_size: BatchSize = spec(
        "Sequences per reward-model forward, or auto.", 32, batch=True, memory=True, le=BATCH_MAX
    )
    samples_per_example: int = spec(
        "Roll-outs collected per training prompt per round.", 64, ge=1, le=100_000
    )
    bradley_terry_beta: float = spec(
        "β_BT of the Bradley–Terry draw for PITA labels.", 10.0, ge=0, le=1e6
    )
    max_examples: int = spec(
        "Use at most this many training prompts per round (0 = all).", 0, ge=0, le=10_000_000
    )
    recipe: str = spec(
        "rollouts: roll-in / cut / roll-out; ground_truth_vs_first_wrong: per prompt the "
        "known answer, label 1, and π_ref's first wrong sample, label 0 (the Q# star-graph recipe).",
        "rollouts",
        choices=RECIPES,
    )
    max_tries: int = spec(
        "ground_truth_vs_first_wrong: π_ref samples per prompt before it is dropped.",
        1000,
        ge=1,
        le=1_000_000,
    )


@dataclass
class EvaluationConfig:
    batch_size: BatchSize = spec(
        "Prompts per evaluation batch, or auto.", 512, batch=True, memory=True, le=BATCH_MAX
    )
    num_samples: int = spec(
        "Samples per test prompt (k of maj@k).", 4, ge=1, le=10_000, memory=True
    )
    etas: List[float] = spec(
        "Guidance strengths η evaluated for guided algorithms (η=0 is π_ref).",
        [0.0, 2.0, 5.0, 10.0],
        items=True,
        ge=0,
        le=1e6,
    )
    max_prompts: int = spec(
        "Evaluate at most this many test prompts (0 = all).", 0, ge=0, le=10_000_000
    )


@dataclass
class PretrainConfig:
    steps: int = spec(
        "Teacher-forced steps of the reference policy (offline tasks).", 400, ge=1, le=10_000_000
    )
    batch_size: int = spec("Sequences per pretraining step.", 256, ge=1, le=65_536, memory=True)
    lr: float = spec("Peak AdamW learning rate.", 3e-3, gt=0, le=10)
    warmup_steps: int = spec(
        "Linear warmup steps before the cosine decay.", 20, ge=0, le=10_000_000
    )
    lr_schedule: str = spec(
        "cosine: warmup_steps, then decay to 0; official: warmup max(100, 1 %), cosine to "
        "0.1·lr (the official star-graph fine-tuning of GPT-2).",
        "cosine",
        choices=PRETRAIN_SCHEDULES,
    )
    weight_decay: Optional[float] = spec(
        "AdamW weight decay of pretraining (null = training.weight_decay).", None, ge=0, le=10
    )


@dataclass
class DatasetConfig:
    """Union of every task's keys. Each `conf/dataset/<name>.yaml` sets its own; the rest
    stay None and are dropped (`dataset_keys` in pita/experiment/config.py), so a key that
    does not belong to the selected task (e.g. dataset.degree on goal_walk) is reported by
    its validator (pita/datasets)."""

    name: str = spec("goal_walk | star_graph | gsm8k | math500 | aime | imdb | tldr", "goal_walk")
    seed: Optional[int] = spec("Seed of the task's data.", None, ge=0, le=SEED_MAX)
    num_nodes: Optional[int] = spec(
        "Graph nodes N (goal_walk, star_graph).", None, ge=1, le=100_000
    )
    out_degree: Optional[int] = spec(
        "Out-degree d of every node (goal_walk).", None, ge=1, le=1_000
    )
    walk_length: Optional[int] = spec("Walk length L (goal_walk).", None, ge=1, le=10_000)
    degree: Optional[int] = spec("Arms d of the star (star_graph).", None, ge=1, le=1_000)
    path_length: Optional[int] = spec("Nodes per arm l (star_graph).", None, ge=1, le=10_000)
    train_size: Optional[int] = spec("Training examples.", None, ge=1, le=10_000_000)
    test_size: Optional[int] = spec("Test examples.", None, ge=1, le=1_000_000)
    path: Optional[str] = spec("Local .jsonl file instead of the hub (hub tasks).", None)
    hub_id: Optional[str] = spec("Override the hub dataset id.", None)
    split: Optional[str] = spec("Hub split for evaluation.", None)
    max_prompt_tokens: Optional[int] = spec(
        "Truncate prompts to this many tokens (hub tasks).", None, ge=1, le=131_072
    )
    max_new_tokens: Optional[int] = spec("Response budget (hub tasks).", None, ge=1, le=131_072)
    train_path: Optional[str] = spec("Local .jsonl of training prompts (hub tasks).", None)
    train_split: Optional[str] = spec("Hub split of training prompts.", None)
    hub_config: Optional[str] = spec("Hub dataset config name (e.g. main for gsm8k).", None)
    cache_dir: Optional[str] = spec("datasets cache folder.", None)
    prompt_template: Optional[str] = spec("Python format string with {question}.", None)
    use_chat_template: Optional[bool] = spec(
        "Wrap prompts with the tokenizer's chat template.", None
    )
    prompt_words: Optional[int] = spec(
        "Truncate prompt text to this many words.", None, ge=1, le=1_000_000
    )


@dataclass
class TinyModelConfig:
    n_layer: int = spec("Transformer blocks.", 1, ge=1, le=256)
    d_model: int = spec("Hidden size.", 64, ge=1, le=65_536)
    n_head: int = spec("Attention heads.", 4, ge=1, le=1_024)


@dataclass
class ModelConfig:
    """A model family: reference policy + guide/value backbone (+ reward model)."""

    name: str = spec("Family alias (see pita/models/catalog.py); tiny = built in the run.", "tiny")
    reference: Optional[str] = spec("Hub id/path of the reference policy (None = catalog).", None)
    guide: Optional[str] = spec("Hub id/path of the guide/value backbone (None = catalog).", None)
    reward: Optional[str] = spec("Hub id/path of the reward model (None = catalog).", None)
    dtype: str = spec("Weights' dtype.", "auto", choices=MODEL_DTYPES)
    device_map: Optional[str] = spec(
        "auto shards the models over the task's gang.", None, choices=DEVICE_MAPS
    )
    trust_remote_code: bool = spec("Allow model repos to run their own code.", False)
    memory_gb: float = spec(
        "Estimated device memory of one stage's models (GB), for admission.", 0.5, gt=0, le=100_000
    )
    gpus_per_task: int = spec("Devices per task (a gang); >1 shards the models.", 1, ge=1, le=64)
    reference_arch: TinyModelConfig = field(default_factory=TinyModelConfig)
    guide_arch: TinyModelConfig = field(default_factory=lambda: TinyModelConfig(n_layer=2))


# --- algorithms: one schema per family ------------------------------------------------------


@dataclass
class GuidanceConfig:
    eta: float = spec("Default η (η multiplies the value; 0 = π_ref).", 10.0, ge=0, le=1e6)
    mode: str = spec("How values become token offsets.", "bernoulli", choices=GUIDANCE_MODES)
    top_k: int = spec("Guide among the reference's top-k tokens.", 2, ge=1, le=1_000_000)


@dataclass
class ReferenceConfig:
    """The reference policy π_ref itself, evaluated once: nothing to train."""

    enabled: bool = spec("Run this algorithm's chains.", False)


@dataclass
class TrainedConfig(ReferenceConfig):
    """Keys every trained algorithm has."""

    batch_size: BatchSize = spec(
        "Training batch size (effective), or auto.", 256, batch=True, memory=True, le=BATCH_MAX
    )
    num_workers: int = spec(
        "DataLoader workers for this algorithm's training (0 = training.num_workers).",
        0,
        ge=-1,
        le=256,
    )
    lr: float = spec("Learning rate.", 1e-3, gt=0, le=10)
    epochs: int = spec("Passes over the collected data.", 1, ge=1, le=100_000)
    steps: int = spec("Optimizer steps (0 = from epochs).", 0, ge=0, le=100_000_000)


@dataclass
class CollectingConfig(TrainedConfig):
    """Algorithms whose round starts by sampling the policy on the training prompts."""

    samples_per_example: int = spec(
        "Samples per training prompt in this algorithm's collect.",
        0,
        ge=0,
        note="0 = data_collection.samples_per_example",
        le=100_000,
    )


@dataclass
class RewardModelMixin:
    """The -HF variants: a proxy Bradley–Terry reward model fitted on preference pairs."""

    reward_lr: float = spec("Learning rate of the proxy reward model.", 1e-3, gt=0, le=10)
    reward_epochs: int = spec("Epochs of the proxy reward model.", 1, ge=1, le=100_000)
    pairs_per_example: int = spec(
        "At most this many preference pairs per training prompt.", 8, ge=1, le=100_000
    )
    samples_per_example: int = spec(
        "Samples per training prompt in this algorithm's collect.",
        0,
        ge=0,
        note="0 = data_collection.samples_per_example",
        le=100_000,
    )
    reward_trl: Dict[str, Any] = spec(
        "Any other field of TRL's RewardConfig for the proxy reward model, passed as is: "
        "reward_trl.center_rewards_coefficient=0.01. Checked like trl (reward_lr, "
        "reward_epochs, ... are pita's keys).",
        {},
    )


@dataclass
class ValueGuidedConfig(CollectingConfig):
    """PITA, Q#: a value model trained on roll-outs guides π_ref at decoding time."""

    loss_type: str = spec("Value loss.", "bce", choices=LOSS_TYPES)
    num_atoms: int = spec(
        "Atoms of the distributional value (mle).", 11, ge=2, memory=True, le=1_024
    )
    V_min: float = spec("Smallest atom value (< V_max).", 0.0)
    V_max: float = spec("Largest atom value.", 1.0)
    init: Optional[str] = spec(
        "Where the value model starts: reference (a copy of π_ref), base (the family's "
        "pretrained guide checkpoint with a fresh head: the official Q# classifier) or "
        "scratch. null: tiny -> warm_start (true: reference, false: scratch), other "
        "families -> base.",
        None,
        choices=(None, *VALUE_INITS),
    )
    warm_start: bool = spec(
        "With init=null on the tiny family: copy the reference's blocks into the value model.",
        True,
    )
    warm_start_layers: int = spec(
        "With warm_start: how many of the reference's blocks, bottom first, are copied "
        "(-1 = every block whose shape matches; 0 = embeddings and final norm only).",
        -1,
        ge=-1,
        allowed="allowed: -1 (every block) or a count of bottom blocks >= 0",
        le=1_024,
    )
    value_head: str = spec(
        "q: one value per vocabulary entry, read at the prefix; v: candidate appended, "
        "scalar read at its own position (the official Q# classifier).",
        "q",
        choices=VALUE_HEADS,
        memory=True,
    )
    weight_decay: Optional[float] = spec(
        "AdamW weight decay of value training.",
        None,
        ge=0,
        note="or null = training.weight_decay",
        le=10,
    )
    lr_schedule: str = spec(
        "cosine: warmup min(100, 10%), decay to 0; official: warmup max(100, 10%), "
        "cosine to 0.1·lr (the Q# star-graph classifier).",
        "cosine",
        choices=LR_SCHEDULES,
    )
    holdout_fraction: float = spec(
        "Fraction of prompts held out for per-position accuracy (0 = none).",
        0.0,
        ge=0,
        lt=1,
        allowed="a fraction in [0, 1)",
    )
    probe_steps: int = spec(
        "With a hold-out: steps of a frozen-backbone linear probe run first, which warns "
        "when the run will sit on the plateau (0 = off).",
        200,
        ge=0,
        le=10_000_000,
    )
    guidance: GuidanceConfig = field(default_factory=GuidanceConfig)


@dataclass
class ValueGuidedHFConfig(RewardModelMixin, ValueGuidedConfig):
    """Q#-HF: Q# on rewards relabelled by a proxy reward model."""


TRL_HELP = (
    "Any other field of TRL's {config} (TrainingArguments included), passed as is: "
    "trl.{example}, trl.lr_scheduler_type=cosine. Checked before the run starts: a field "
    "{config} lacks, a wrong type, or one pita sets from its own key (lr, epochs, steps, "
    "batch_size, beta, ...: use that key) is refused."
)
PEFT_HELP = (
    "LoRA instead of full fine-tuning (null): {r: 8, alpha: 16, dropout: 0.0, "
    "target_modules: all-linear | [q_proj, v_proj]}; the adapter is merged into model/ at the "
    "end (evaluated like a full model) and kept in the task's adapter/. Needs peft."
)
PEFT_KEYS = {  # key: (default, what is allowed)
    "r": (8, "an integer >= 1"),
    "alpha": (16, "a number > 0"),
    "dropout": (0.0, "a number in [0, 1)"),
    "target_modules": ("all-linear", "all-linear or a non-empty list of module names"),
}


def _peft_value_ok(key: str, value: Any) -> bool:
    if key == "r":
        return _is_int(value) and value >= 1
    if key == "alpha":
        return _is_number(value) and value > 0
    if key == "dropout":
        return _is_number(value) and 0 <= value < 1
    if isinstance(value, str):
        return value == "all-linear"
    return (
        isinstance(value, (list, tuple))
        and bool(value)
        and all(isinstance(v, str) and v for v in value)
    )


def peft_errors(value: Any, prefix: str) -> list[str]:
    """The rule of `algos.<NAME>.peft` (a dict field, so not a `Rule`): null, or a mapping of
    PEFT_KEYS with allowed values; one line per bad key."""
    if value is None:
        return []
    if not isinstance(value, Mapping):
        return [f"{prefix}peft={value!r}: null or a mapping of {', '.join(PEFT_KEYS)}"]
    errors = []
    for key, item in value.items():
        if key not in PEFT_KEYS:
            errors.append(f"{prefix}peft.{key}: unknown LoRA key; allowed: {', '.join(PEFT_KEYS)}")
        elif not _peft_value_ok(key, item):
            errors.append(f"{prefix}peft.{key}={item!r}: {PEFT_KEYS[key][1]}")
    return errors


@dataclass
class PreferenceConfig(CollectingConfig):
    """DPO, RPO: TRL's DPOTrainer on preference pairs of the policy's samples."""

    beta: float = spec("KL coefficient β.", 0.1, gt=0, le=1e6)
    sft_weight: float = spec(
        "Weight of an NLL term on the chosen responses (TRL's sigmoid+sft = RPO α).",
        0.0,
        ge=0,
        le=1e6,
    )
    pairs_per_example: int = spec(
        "At most this many preference pairs per training prompt.", 8, ge=1, le=100_000
    )
    trl: Dict[str, Any] = spec(TRL_HELP.format(config="DPOConfig", example="loss_type=ipo"), {})
    peft: Any = spec(
        PEFT_HELP, None, memory=True
    )  # Any: Hydra cannot merge a mapping into a None Dict


@dataclass
class GRPOConfig(TrainedConfig):
    """GRPO: TRL's GRPOTrainer with the task's verifier as reward."""

    beta: float = spec("KL coefficient β (0 = no KL term).", 0.04, ge=0, le=1e6)
    num_generations: int = spec(
        "Completions per prompt (the group).",
        8,
        ge=2,
        note="GRPO needs a group",
        memory=True,
        le=1_024,
    )
    max_completion_length: int = spec(
        "Completion budget (0 = task length).", 0, ge=0, memory=True, le=131_072
    )
    trl: Dict[str, Any] = spec(
        TRL_HELP.format(config="GRPOConfig", example="scale_rewards=false"), {}
    )
    peft: Any = spec(
        PEFT_HELP, None, memory=True
    )  # Any: Hydra cannot merge a mapping into a None Dict


@dataclass
class GRPOHFConfig(RewardModelMixin, GRPOConfig):
    """GRPO-HF: GRPO against a proxy reward model fitted on preference pairs."""


# The names `conf/algo/<name>.yaml` start from (`defaults: [<name>, _self_]`).
ALGO_SCHEMAS: dict[str, type] = {
    "reference_schema": ReferenceConfig,
    "value_schema": ValueGuidedConfig,
    "value_hf_schema": ValueGuidedHFConfig,
    "preference_schema": PreferenceConfig,
    "grpo_schema": GRPOConfig,
    "grpo_hf_schema": GRPOHFConfig,
}


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
    # algos.<NAME>: each row's own schema (pita/algos/registry.py), from conf/algo/*.yaml
    algos: Dict[str, Any] = field(default_factory=dict)
    rounds_of_training: int = spec(
        "Rounds per chain (round r collects with round r-1's guide).", 1, ge=1, le=20
    )
    batch_size_safety_margin: float = spec(
        "Fraction of free device memory the auto batch size may use; LOWER is safer.",
        0.9,
        gt=0,
        le=1,
        allowed="a fraction in (0, 1]; lower is safer",
    )
    dry_run: bool = spec(
        "Print the plan and exit without starting a worker.", False, affects="record"
    )
    resume_from: Optional[str] = spec(
        "Run folder to resume (its saved config is reused).", None, affects="record"
    )


# --- the walker -----------------------------------------------------------------------------


def schema_errors(
    node: Mapping[Any, Any], schema: type, prefix: str = "", *, values: bool = True
) -> list[str]:
    """One line per key of `node` (a resolved config, plain dicts and lists) that `schema`
    does not have, and, with `values`, per value its field's rule rejects. Dict-typed
    fields (`algos`, `executor.stage_overrides`) are left to their own checks."""
    fields = {f.name: f for f in dataclasses.fields(schema)}
    errors = [f"{prefix}{key}: {UNKNOWN_KEY}" for key in node if key not in fields]
    for name, f in fields.items():
        if name not in node:
            continue
        value, sub = node[name], nested_schema(f)
        if sub is not None and isinstance(value, Mapping):
            errors += schema_errors(value, sub, f"{prefix}{name}.", values=values)
            continue
        rule = rule_of(f)
        if values and rule is not None and not rule.ok(value):
            errors.append(f"{prefix}{name}={value!r}: {rule.text(value)}")
    return errors


# --- what a key affects: the lists derived from `spec(affects=..., memory=...)` -------------


def _walk(dotted: str) -> tuple[dataclasses.Field | None, type | None]:
    """(field, group dataclass) at a dotted key of PitaConfig: (None, PitaConfig) for "",
    (None, None) for a key outside the schema; a key inside a dict field
    (`executor.stage_overrides.QSharp.train`) is that field's."""
    f: dataclasses.Field | None = None
    schema: type | None = PitaConfig
    for part in dotted.split(".") if dotted else []:
        if schema is None:  # inside a leaf: a dict field's own keys
            return f, None
        fields = {g.name: g for g in dataclasses.fields(schema)}
        if part not in fields:
            return None, None
        f = fields[part]
        schema = nested_schema(f)
    return f, schema


def affects_of(dotted: str) -> str | None:
    """What changing a dotted key affects (`AFFECTS`); `algos.<NAME>.*` is "result" (every
    algorithm key changes what its chain computes), a whole group is "result"; None for a key
    outside the schema (`hydra.*`)."""
    if dotted == "algos" or dotted.startswith("algos."):
        return "result"
    f, schema = _walk(dotted)
    if schema is not None:
        return "result"
    return None if f is None else f.metadata.get("affects", "result")


def keys_affecting(kind: str, schema: type | None = None) -> tuple[str, ...]:
    """The dotted leaf keys of `schema` (PitaConfig unless given) that declare `affects=kind`."""
    assert kind in AFFECTS, f"kind={kind!r}: one of {AFFECTS}"
    return tuple(
        key
        for key, f in leaf_fields(schema or PitaConfig)
        if f.metadata.get("affects", "result") == kind  # `algos` (no spec): each algo's keys
    )


def resume_safe(dotted: str) -> bool:
    """Whether a resumed run may change the key: it affects where or how the run goes, or
    what is recorded, never what a task computes."""
    return affects_of(dotted) in ("place", "record")


def resume_safe_keys() -> tuple[str, ...]:
    """Every leaf key a resumed run may change (`resume_safe`)."""
    return keys_affecting("place") + keys_affecting("record")


@functools.cache  # read once per planned task (17k in the largest plan): the schema is fixed
def memory_keys(schema: type | None = None) -> tuple[str, ...]:
    """The dotted leaf keys of `schema` (PitaConfig unless given) that change a task's
    device-memory peak (`memory=True`): the peak cache's key."""
    return tuple(key for key, f in leaf_fields(schema or PitaConfig) if f.metadata.get("memory"))


def result_config(plain: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A resolved config (plain dicts) without what does not change a task's result: the keys
    that affect only its place or its record, and what is outside the schema (`hydra`). What
    a checkpoint's identity and the duration cache's key are computed from."""
    out: dict[str, Any] = {}
    for key, value in plain.items():
        dotted = f"{prefix}{key}"
        if affects_of(dotted) != "result":
            continue
        group = _walk(dotted)[1] is not None and isinstance(value, Mapping)
        out[key] = result_config(value, f"{dotted}.") if group else value
    return out


def describe_keys(keys: tuple[str, ...] | list[str]) -> str:
    """`keys` for a message: a group all of whose leaves are listed reads `group.*`, one
    with a single leaf left out reads `group.* but group.<leaf>`."""
    groups: dict[str, list[str]] = {}
    for key in keys:
        groups.setdefault(key.rsplit(".", 1)[0] if "." in key else "", []).append(key)
    parts: list[str] = []
    for group, listed in groups.items():
        sub = _walk(group)[1] if group else None
        every = [f"{group}.{k}" for k, _ in leaf_fields(sub)] if sub else []
        missing = [k for k in every if k not in listed]
        if sub and not missing:
            parts.append(f"{group}.*")
        elif sub and len(missing) == 1:
            parts.append(f"{group}.* but {missing[0]}")
        else:
            parts += listed
    return ", ".join(parts)


def default_of(dotted: str, schema: type | None = None) -> Any:
    """The default `schema` (PitaConfig unless given) declares for a dotted key
    (`training.micro_batch_size`, or `num_generations` of an algorithm's schema)."""
    f = _leaf_map(schema or PitaConfig)[dotted]
    return f.default_factory() if f.default is MISSING else f.default  # type: ignore[operator]


@functools.cache
def _leaf_map(schema: type) -> dict[str, dataclasses.Field]:
    """`leaf_fields` of a schema class by dotted key, built once per class: a dry run of
    17k tasks asked for defaults 43k times, and each walk of the tree took 0.2 ms."""
    return dict(leaf_fields(schema))


# --- typed settings: a stage's values as schema instances (issue 33) ----------------------

T = TypeVar("T")
_KEY = "_pita_key"  # a settings instance's dotted prefix (`algos.PITA.`), set by `settings`
# dotted key -> value of every setting read while `recording_reads` is open (one task at a
# time per process: workers and the in-process executor run tasks one after another)
_READS: dict[str, Any] | None = None


def _refuse_write(self: Any, name: str, value: Any = None) -> None:
    raise dataclasses.FrozenInstanceError(
        f"cannot assign to field {name!r}: a stage's settings are read-only"
    )


def _read_field(self: Any, name: str) -> Any:
    """Attribute access of a settings instance: a field read while a task records its reads
    is noted as `<prefix><field>` with its value (a nested group is noted leaf by leaf)."""
    value = object.__getattribute__(self, name)
    if _READS is not None and name in type(self).__dataclass_fields__:
        prefix = object.__getattribute__(self, "__dict__").get(_KEY)
        if prefix is not None and type(value).__setattr__ is not _refuse_write:
            _READS[prefix + name] = value
    return value


@functools.cache
def _frozen_class(schema: type) -> type:
    """A subclass of `schema` whose instances refuse assignment and note the fields a task
    reads (the schema classes stay plain dataclasses: Hydra merges overrides into them)."""
    return type(
        schema.__name__,
        (schema,),
        {
            "__setattr__": _refuse_write,
            "__delattr__": _refuse_write,
            "__getattribute__": _read_field,
            "__module__": __name__,
        },
    )


class recording_reads:  # noqa: N801 - used as a function: `with recording_reads() as reads:`
    """Note every setting read (by any thread of this process) until the block ends: the
    dict it yields maps each dotted key read to the value read. What a task's manifest
    records, so a resume re-runs the tasks whose keys changed (pita/experiment/resume_fix.py)
    — derived from the reads themselves, never from a hand-kept table."""

    def __enter__(self) -> dict[str, Any]:
        global _READS
        self._outer, _READS = _READS, {}
        return _READS

    def __exit__(self, *exc: object) -> None:
        global _READS
        _READS = self._outer


def record_read(dotted: str, value: Any) -> None:
    """Note a read that does not go through a settings field (a rank's reads sent back to
    its gang's worker; an algorithm the config lacks, read as absent)."""
    if _READS is not None:
        _READS[dotted] = value


def settings(schema: type[T], node: Mapping[str, Any] | None, prefix: str | None = None) -> T:
    """A read-only instance of `schema` holding `node`'s values (a resolved config group:
    plain dicts and lists): what a stage reads instead of digging keys out by string. A key
    `node` lacks takes the field's default, the one home of every default; a key the schema
    lacks is left out (the config was validated against the schema before any worker
    started). `prefix` (`"training."`): the group's dotted place in the config; its reads
    are then recorded (`recording_reads`), nested groups' too."""
    node = node or {}
    values: dict[str, Any] = {}
    for f in dataclasses.fields(schema):  # type: ignore[arg-type]
        if not f.init:
            continue
        sub = nested_schema(f)
        value = node.get(f.name, {} if sub is not None else MISSING)
        if value is MISSING:
            continue
        inner = None if prefix is None else f"{prefix}{f.name}."
        values[f.name] = (
            settings(sub, value, inner) if sub is not None and isinstance(value, Mapping) else value
        )
    instance = schema(**values)
    object.__setattr__(instance, "__class__", _frozen_class(schema))  # type: ignore[arg-type]
    if prefix is not None:
        object.__setattr__(instance, _KEY, prefix)
    return instance


def leaf_fields(schema: type, prefix: str = "") -> list[tuple[str, dataclasses.Field]]:
    """(dotted key, field) of every leaf of `schema`, nested groups flattened."""
    out: list[tuple[str, dataclasses.Field]] = []
    for f in dataclasses.fields(schema):
        sub = nested_schema(f)
        if sub is not None:
            out += leaf_fields(sub, f"{prefix}{f.name}.")
        else:
            out.append((f"{prefix}{f.name}", f))
    return out
