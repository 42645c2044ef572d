"""Device-memory estimates of tasks, from what is known (parent side, torch-free).

The scheduler packs several tasks on a GPU while their estimates fit, so an estimate must
mean something. Each task's `mem_mb` comes from the first of these that is known, and
`mem_source` says which (dry_run prints it):

1. **measured peak** of the same (algo, stage, family, dataset) — earlier in this run
   (a finished task's `result.json` has `peak_gpu_mb`, torch's `max_memory_reserved`), or
   in the peaks cache next to the batch-size cache (`$PITA_CACHE_DIR/task_peaks.json`,
   keyed with a fingerprint of the family, dataset and batch settings);
2. **checkpoint size** of the models the stage holds (its algorithm's row in
   pita/algos/registry.py declares which, and what the stage does with each): parameters ×
   dtype bytes read from `config.json` and the safetensors headers of a local folder or the
   local hub cache (json + struct: no torch, no download), plus KV cache / activations for the configured batch and lengths, plus
   gradients and AdamW state for training stages (`pita.runtime.batch_size.search.estimate_from_config`,
   the same formula the batch-size probe starts from). The tiny family's models are built
   in the run: their size comes from `model.reference_arch` / `guide_arch`;
   An explicit `model.memory_gb` (one that differs from conf/model/<family>.yaml: set on
   the command line or by an experiment) is the user's word and comes before the size;
3. **family `model.memory_gb`** × the stage's factor (the planner's value). A hub or local
   family whose size cannot be read and which leaves `memory_gb` at the schema default
   never gets a flat 0.5 GB: its size is parsed from the id ("8B", "350M") or, failing
   that, it claims a whole device.

Every GPU estimate adds WORKER_OVERHEAD_MB: the CUDA context and allocator slack a worker
process holds that `max_memory_reserved` does not count but NVML does.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from pita.algos.registry import ALGORITHMS, Held, stage_models
from pita.core import user_cache
from pita.core.parallel import Strategy
from pita.core.paths import pita_cache_dir
from pita.core.schema import ModelConfig, default_of, memory_keys, settings
from pita.models.placement import BYTES_PER_PARAM

log = logging.getLogger(__name__)

WORKER_OVERHEAD_MB = 512
PEAK_MARGIN = 1.10  # a measured peak, plus 10 % (allocator rounding, a longer batch next time)
HUB_PROMPT_TOKENS, HUB_NEW_TOKENS = 512, 256  # a hub task that sets no length of its own
UNKNOWN_VOCAB = 80  # the built-in family's vocabulary on a task without node tokens
SCHEMA_DEFAULT_GB = default_of("model.memory_gb")  # "nobody said"
# Bytes per element by dtype name: placement's weight table (the same numbers the gang
# placement uses) plus the other names a config.json may store.
DTYPE_BYTES = {
    **BYTES_PER_PARAM,
    "float": 4,
    "half": 2,
    "float64": 8,
    "uint8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "bool": 1,
}
SAFETENSORS_BYTES = {
    "F64": 8,
    "F32": 4,
    "BF16": 2,
    "F16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
MB = 2**20


# --- reading checkpoints without torch ------------------------------------------------------


def safetensors_parameters(folder: Path) -> tuple[int, int]:
    """(parameters, bytes on disk) summed over the safetensors headers of `folder`."""
    params = nbytes = 0
    for f in sorted(Path(folder).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            n = 1
            for dim in meta["shape"]:
                n *= int(dim)
            params += n
            nbytes += n * SAFETENSORS_BYTES.get(meta["dtype"], 4)
    return params, nbytes


def hub_snapshot(model_id: str) -> Path | None:
    """A local folder, or the local hub cache's snapshot of `model_id` (never downloads):
    huggingface_hub's own cache lookup, as preflight uses it."""
    p = Path(os.path.expanduser(model_id))
    if p.is_dir():
        return p
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(model_id, "config.json")
    except Exception:  # noqa: BLE001 - an id the hub would reject is in no cache
        return None
    return Path(cached).parent if isinstance(cached, str) else None


def _text_config(raw: Mapping[str, Any]) -> Mapping[str, Any]:
    for key in ("text_config", "llm_config"):
        if isinstance(raw.get(key), Mapping) and "hidden_size" in raw[key]:
            return {**raw, **raw[key]}
    return raw


def _namespace(raw: Mapping[str, Any]) -> SimpleNamespace | None:
    """The attributes estimate_from_config reads, from a config.json (GPT-2 names mapped)."""
    c = dict(_text_config(raw))
    aliases = {
        "num_hidden_layers": ("n_layer", "num_layers"),
        "hidden_size": ("n_embd", "d_model"),
        "num_attention_heads": ("n_head", "num_heads"),
        "intermediate_size": ("n_inner", "ffn_dim"),
    }
    for key, alts in aliases.items():
        if c.get(key) is None:
            c[key] = next((c[a] for a in alts if c.get(a) is not None), None)
    if c.get("intermediate_size") is None and c.get("hidden_size"):
        c["intermediate_size"] = 4 * int(c["hidden_size"])
    if not all(
        c.get(k) for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")
    ):
        return None
    return SimpleNamespace(
        **{
            k: c.get(k)
            for k in (
                "num_hidden_layers",
                "hidden_size",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "intermediate_size",
                "vocab_size",
            )
        }
    )


@dataclass
class ModelSize:
    """What the estimate needs of one model: its shape and its weights."""

    params: int
    weight_bytes: float  # params × bytes per parameter as loaded (quantization included)
    config: SimpleNamespace | None  # layer/hidden/head sizes, for KV cache and activations
    what: str  # "config.json of gpt2", "model.reference_arch"


def checkpoint_size(
    model_id: str, dtype: str = "auto", quantization: str | None = None
) -> ModelSize | None:
    """The size of a local or locally cached hub checkpoint, or None when it is not on disk."""
    folder = hub_snapshot(model_id)
    if folder is None or not (folder / "config.json").is_file():
        return None
    try:
        raw = json.loads((folder / "config.json").read_text())
        params, on_disk = safetensors_parameters(folder)
    except (OSError, ValueError, KeyError, struct.error) as exc:
        log.debug("cannot read %s: %s", folder, exc)
        return None
    ns = _namespace(raw)
    if params == 0 and ns is None:
        return None
    if params == 0 and ns is not None:  # no safetensors (a .bin checkpoint): count from the shapes
        h, n_layer, vocab = int(ns.hidden_size), int(ns.num_hidden_layers), int(ns.vocab_size)
        params = n_layer * (4 * h * h + 3 * h * int(ns.intermediate_size)) + 2 * vocab * h
        on_disk = 0
    stored = str(_text_config(raw).get("torch_dtype") or raw.get("dtype") or "float32")
    bytes_per = DTYPE_BYTES.get(dtype if dtype != "auto" else stored, 0) or (
        on_disk / params if on_disk else 4
    )
    if quantization == "8bit":
        bytes_per = 1.0
    elif quantization == "4bit":
        bytes_per = 0.56  # nf4 + double-quantized scales
    return ModelSize(params, params * bytes_per, ns, f"config.json of {model_id}")


def tiny_size(arch: Mapping[str, Any], vocab: int, what: str = "model arch") -> ModelSize:
    """A tiny Llama built in the run (pita/models/tiny.py): fp32 weights."""
    d, n_layer = int(arch["d_model"]), int(arch["n_layer"])
    ns = SimpleNamespace(
        num_hidden_layers=n_layer,
        hidden_size=d,
        num_attention_heads=int(arch["n_head"]),
        num_key_value_heads=int(arch["n_head"]),
        head_dim=None,
        intermediate_size=4 * d,
        vocab_size=vocab,
    )
    params = n_layer * (4 * d * d + 3 * d * 4 * d) + 2 * vocab * d
    return ModelSize(params, params * 4.0, ns, what)


def size_from_name(model_id: str) -> ModelSize | None:
    """ "Llama-3.1-8B" -> 8e9 parameters in bf16; None when the id names no size."""
    m = re.search(r"(\d+(?:\.\d+)?)\s*([BbMm])(?![a-zA-Z])", model_id.rsplit("/", 1)[-1])
    if not m:
        return None
    params = int(float(m.group(1)) * (1e9 if m.group(2) in "Bb" else 1e6))
    return ModelSize(params, params * 2.0, None, f"the size in the name {model_id}")


# --- lengths and batches ----------------------------------------------------------------------


def sequence_lengths(ds: Mapping[str, Any], cfg: Any) -> tuple[int, int]:
    """(prompt tokens, new tokens) of the dataset's longest example, as configured."""
    from pita.datasets import with_defaults

    ds = with_defaults(ds)
    name = ds["name"]
    gen_new = int(_get(cfg, "generation.max_new_tokens"))
    if name == "star_graph":
        d, length = int(ds["degree"]), int(ds["path_length"])
        return 3 * d * (length - 1) + 3, gen_new or length + 1
    if name == "goal_walk":
        return 4, gen_new or int(ds["walk_length"]) + 1
    # a hub task without its own limits: a long prompt and answer (the estimate's upper side)
    prompt, new = ds.get("max_prompt_tokens"), ds.get("max_new_tokens")
    return int(prompt or HUB_PROMPT_TOKENS), gen_new or int(new or HUB_NEW_TOKENS)


def tiny_vocab(ds: Mapping[str, Any]) -> int:
    """The task vocabulary of an offline dataset: node tokens + separators + specials."""
    from pita.datasets import with_defaults

    nodes = with_defaults(ds).get("num_nodes")  # a hub task has no node tokens
    return int(nodes) + 16 if nodes else UNKNOWN_VOCAB


def _get(cfg: Any, dotted: str) -> Any:
    """The value of a dotted key in a (possibly partial) config, else the schema's default:
    the default has one home (pita/core/schema.py)."""
    node = _lookup(cfg, dotted)
    return default_of(dotted) if node is None else node


def _algo_get(cfg: Any, algo: str, key: str) -> Any:
    """`algos.<algo>.<key>`, else the default of the algorithm's schema (None for a task
    outside an algorithm's chain, or a key its schema lacks)."""
    node = _lookup(cfg, f"algos.{algo}.{key}")
    if node is not None or algo not in ALGORITHMS:
        return node
    fields = {f.name: f for f in dataclasses.fields(ALGORITHMS[algo].schema)}
    return default_of(key, ALGORITHMS[algo].schema) if key in fields else None


def _lookup(cfg: Any, dotted: str) -> Any:
    node = cfg
    for part in dotted.split("."):
        try:
            node = node[part]
        except (KeyError, TypeError, AttributeError):
            return None
        if node is None:
            return None
    return node


def _batch(value: Any, fallback: int) -> int:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else fallback


# --- the estimate -------------------------------------------------------------------------------


class ModelSizes:
    """Sizes of a family's checkpoints (reference | guide | reward), read once per (family,
    dataset)."""

    def __init__(self) -> None:
        self._cache: dict[tuple, ModelSize | None] = {}

    def get(
        self, family: Mapping[str, Any], ds: Mapping[str, Any], checkpoint: str
    ) -> ModelSize | None:
        key = (
            json.dumps(family, sort_keys=True, default=str),
            json.dumps(ds, sort_keys=True, default=str),
            checkpoint,
        )
        if key not in self._cache:
            self._cache[key] = self._read(family, ds, checkpoint)
        return self._cache[key]

    @staticmethod
    def _read(
        family: Mapping[str, Any], ds: Mapping[str, Any], checkpoint: str
    ) -> ModelSize | None:
        from pita.models.catalog import resolve_family

        try:
            fam = resolve_family(settings(ModelConfig, family).name, family)
        except ValueError:
            return None
        if fam.is_builtin:
            key = "reference_arch" if checkpoint == "reference" else "guide_arch"
            arch = family.get(key)
            return tiny_size(arch, tiny_vocab(ds), f"model.{key}") if arch else None
        model_id = {"reference": fam.reference, "guide": fam.guide, "reward": fam.reward}[
            checkpoint
        ]
        if not model_id:
            return None
        return checkpoint_size(
            model_id, settings(ModelConfig, family).dtype, fam.quantization
        ) or size_from_name(model_id)


# Which checkpoint of the family each model a stage holds (registry MODEL_ROLES) is sized
# from: a policy starts as π_ref; the value and proxy reward models are the guide's size.
CHECKPOINT_OF = {
    "policy": "reference",
    "reference": "reference",
    "value": "guide",
    "reward": "guide",
}


def _batch_of(task: Any, cfg: Any, held: Held, builtin: bool) -> int:
    """How many sequences the held model processes at once in this task, before batch_scale."""
    micro = int(_get(cfg, "training.micro_batch_size"))
    if held.use == "generate":
        if task.stage == "train":  # roll-outs sampled inside training (GRPO's groups)
            return micro * int(_algo_get(cfg, task.algo, "num_generations"))
        if task.stage == "evaluate":
            batch = _batch(_get(cfg, "evaluation.batch_size"), 512)
            return batch * int(_get(cfg, "evaluation.num_samples"))
        return _batch(_get(cfg, "generation.batch_size"), 256)
    if held.use == "forward":
        if task.stage == "train":
            return micro * held.sequences
        return _batch(_get(cfg, "generation.batch_size"), 256)
    # train: the whole batch at once for built-in models, micro-batches for hub models
    if task.stage == "pretrain":
        return int(_get(cfg, "pretrain.batch_size"))
    if builtin:
        return _batch(_algo_get(cfg, task.algo, "batch_size"), 256)
    return micro * held.sequences


def _model_estimate(
    task: Any, cfg: Any, held: Held, size: ModelSize, builtin: bool, lengths: tuple[int, int]
):
    """estimate_from_config for one held model (its KV cache / activations, and for a trained
    one its gradients and AdamW state)."""
    from pita.runtime.batch_size.search import StageMode, estimate_from_config

    config = size.config
    if held.atoms_head:  # a value head: num_atoms outputs, not the vocabulary
        atoms = int(_algo_get(cfg, task.algo, "num_atoms"))
        config = SimpleNamespace(**{**vars(config), "vocab_size": atoms})
    return estimate_from_config(
        config,
        mode=cast(StageMode, held.use),  # never "weights": the caller counts those
        prompt_tokens=lengths[0],
        new_tokens=lengths[1],
        dtype_bytes=4 if builtin else 2,
        n_params=size.params,
        optimizer_bytes_per_param=8.0 if held.use == "train" else None,
    )


def _largest_block(size: ModelSize) -> float:
    """Bytes of the largest unit FSDP all-gathers at once (one transformer block, or the
    embedding): what a sharded rank holds unsharded for a moment beside its shard."""
    c = size.config
    if c is None:
        return 0.0
    h, inter = int(c.hidden_size), int(c.intermediate_size or 4 * int(c.hidden_size))
    per_param = size.weight_bytes / max(1, size.params)
    return max(4 * h * h + 3 * h * inter, int(c.vocab_size) * h) * per_param


@dataclass
class TrainingMemory:
    """A task's analytic estimate split the way a gang's strategy divides it (bytes).

    `params`, `grads` and `optimizer` are the trained model's (AdamW: two fp32 moments);
    `frozen` the weights and forward buffers of the models it only reads (π_ref beside a
    value model, DPO's reference); `activations` those of the trained model on the batch one
    process takes; `batch_split`: k ranks each take 1/k of that batch (the tiny models built
    in the run train on the whole batch at once; hub models keep `training.micro_batch_size`
    per rank and accumulate less). DDP replicates everything on every rank; FSDP divides the
    first three by k and adds one block gathered unsharded (`block`). Frozen models are not
    sharded (each rank holds its copy).
    """

    params: float
    grads: float
    optimizer: float
    activations: float
    frozen: float
    block: float
    batch_split: bool
    what: str

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.frozen

    def per_rank_mb(self, strategy: str | Strategy, ranks: int) -> int:
        """MB on each rank of a `ranks`-device gang under `strategy` (a `Strategy`, or its name)."""
        k, strategy = max(1, ranks), Strategy.of(strategy)
        state = self.params + self.grads + self.optimizer
        if strategy is Strategy.FSDP and k > 1:
            state = state / k + self.block
        split = self.batch_split and strategy is not Strategy.NONE
        acts = self.activations / k if split else self.activations
        return int((state + acts + self.frozen) / MB) + WORKER_OVERHEAD_MB


def training_memory(task: Any, cfg: Any, sizes: ModelSizes) -> TrainingMemory | None:
    """The analytic estimate of `task` split by what a strategy shards (None: sizes unknown).

    Weights are counted once per model the stage holds (its algorithm's row in
    pita/algos/registry.py): DPO's policy and its frozen reference are two copies of π_ref's
    checkpoint; GRPO's policy that trains and samples is one."""
    held = stage_models(task.algo, task.stage, task.round)
    if not held:
        return None
    family, ds = task.family_cfg, task.dataset_cfg
    builtin = str(family.get("name")) == "tiny"
    lengths = sequence_lengths(ds, cfg)
    trained = {h.model for h in held if h.use == "train"}
    mem = TrainingMemory(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, builtin, "")
    counted: set[str] = set()
    whats: list[str] = []
    for h in held:
        size = sizes.get(family, ds, CHECKPOINT_OF[h.model])
        if size is None:
            return None
        if h.model not in counted:  # a model's weights are counted once, whatever it does
            counted.add(h.model)
            whats.append(size.what)
            if h.model in trained:
                mem.params += size.weight_bytes
                mem.block = max(mem.block, _largest_block(size))
            else:
                mem.frozen += size.weight_bytes
        adapter = _lora_params(cfg, task, size) if h.model == "policy" else None
        if h.use == "train" and adapter is not None:  # LoRA: only the fp32 adapter trains
            mem.grads += adapter * 4.0
            mem.optimizer += adapter * 8.0
        elif h.use == "train":  # gradients in the compute dtype, AdamW's two fp32 moments
            mem.grads += size.params * (4 if builtin else 2)
            mem.optimizer += size.params * 8.0
        if h.use == "weights" or size.config is None:
            continue  # no shapes (a size read from the name): no activations to count
        est = _model_estimate(task, cfg, h, size, builtin, lengths)
        batch = max(1, int(_batch_of(task, cfg, h, builtin) * task.batch_scale))
        if h.use == "train":
            mem.activations += batch * est.per_sample_bytes
        else:
            mem.frozen += est.bytes_for(batch)
    mem.what = " + ".join(dict.fromkeys(whats))
    return mem


# LoRA's adapter on a linear layer is r x (inputs + outputs); which layers of a decoder
# block take (hidden, hidden) and which (hidden, MLP width)
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "c_attn", "c_proj")
_MLP = ("gate_proj", "up_proj", "down_proj", "c_fc")


def _lora_params(cfg: Any, task: Any, size: ModelSize) -> float | None:
    """Parameters of the LoRA adapter `algos.<NAME>.peft` puts on the policy (None: full
    fine-tuning, or a model without shapes). `all-linear` = the 4 attention and 3 MLP
    projections of each block."""
    peft = _algo_get(cfg, task.algo, "peft")
    c = size.config
    if not isinstance(peft, Mapping) or c is None:
        return None
    r = int(peft.get("r", 8) or 8)
    h = int(c.hidden_size)
    inter = int(c.intermediate_size or 4 * h)
    targets = peft.get("target_modules", "all-linear")
    if isinstance(targets, str):
        targets = [*_ATTENTION[:4], *_MLP[:3]] if targets == "all-linear" else [targets]
    per_block = sum(r * (h + inter) if t in _MLP else r * 2 * h for t in targets)
    return float(int(c.num_hidden_layers) * per_block)


def analytic_mb(task: Any, cfg: Any, sizes: ModelSizes) -> tuple[int, str] | None:
    """Weights + KV cache / activations + optimizer state of the models the task's stage
    holds (its algorithm's row in pita/algos/registry.py says which), in MB, on one device."""
    mem = training_memory(task, cfg, sizes)
    if mem is None:
        return None
    return mem.per_rank_mb("none", 1), mem.what


# --- measured peaks -------------------------------------------------------------------------------


def peak_key(task: Any, cfg: Any) -> str:
    """(algo, stage, family, dataset) + a fingerprint of what changes the peak: the chain's
    model and dataset groups and every key whose field says `memory=True` (the run's and the
    algorithm's: `schema.memory_keys`)."""
    keys = {k: _get(cfg, k) for k in memory_keys()}
    row = ALGORITHMS.get(task.algo)
    own = {k: _algo_get(cfg, task.algo, k) for k in memory_keys(row.schema)} if row else {}
    blob = json.dumps([task.family_cfg, task.dataset_cfg, keys, own], sort_keys=True, default=str)
    stage = task.stage.removesuffix("_merge")
    return f"{task.algo}|{stage}|{task.family}|{task.dataset}|{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


def peaks_cache_path() -> Path:
    return pita_cache_dir() / "task_peaks.json"


class PeakEstimator:
    """Measured peaks by key: learned from finished tasks, kept across runs in a cache file.

    The DagRunner calls `observe` with each finished task's result and `refine` on the
    tasks that have not started; the planner calls `refine` through `fill_estimates`.
    """

    def __init__(self, cfg: Any, cache_path: Path | None = None):
        self.cfg = cfg
        self.cache_path = cache_path
        self.peaks: dict[str, tuple[float, str]] = {}  # key -> (peak MB, where it was measured)
        if cache_path is not None:
            path = Path(cache_path)
            self.peaks = user_cache.entries(
                user_cache.read_json(path, "peaks"),
                path,
                "peaks",
                lambda v: (float(v["peak_mb"]), f"cached peak of {v['task']}"),
            )

    def observe(self, task: Any, result: Mapping[str, Any]) -> bool:
        """Record the task's measured peak (MB); True when one was measured."""
        peak = float(result.get("peak_gpu_mb") or 0)
        if peak <= 0 or task.stage.endswith("_merge"):
            return False
        key = peak_key(task, self.cfg)
        mb, source = self.peaks.get(key, (0.0, ""))
        if (
            source.startswith("peak of") and mb >= peak
        ):  # this run's largest (shards, rounds differ a little)
            return True
        self.peaks[key] = (peak, f"peak of {task.id}")
        self._save(key, self.peaks[key][0], task.id)
        return True

    def refine(self, task: Any) -> tuple[int, str] | None:
        """(MB, source) from a measured peak of the same key, or None."""
        if task.stage.endswith("_merge"):
            return None
        hit = self.peaks.get(peak_key(task, self.cfg))
        if hit is None:
            return None
        return int(hit[0] * PEAK_MARGIN) + WORKER_OVERHEAD_MB, hit[1]

    def learn_from_run(self, run_dir: Path, tasks: Mapping[str, Any], done: set[str]) -> None:
        """Resume: the peaks of tasks finished before the interruption (their result.json)."""
        for tid in done:
            try:
                result = json.loads((Path(run_dir) / "tasks" / tid / "result.json").read_text())
            except (OSError, ValueError):
                continue
            if tid in tasks:
                self.observe(tasks[tid], result)

    def _save(self, key: str, peak_mb: float, task_id: str) -> None:
        if self.cache_path is None:
            return
        entry = {"peak_mb": round(peak_mb, 1), "task": task_id}
        user_cache.update_json(
            Path(self.cache_path), "peaks", lambda data: data.update({key: entry})
        )


@functools.cache  # read once per planned task (17k in the largest plan); the file is the repo's
def family_file_memory_gb(name: str) -> float:
    """`memory_gb` of conf/model/<name>.yaml (the schema default when there is no file)."""
    path = Path(__file__).resolve().parents[2] / "conf" / "model" / f"{name}.yaml"
    try:
        for line in path.read_text().splitlines():
            if line.startswith("memory_gb:"):
                return float(line.split(":", 1)[1].split("#")[0])
    except (OSError, ValueError):
        pass
    return SCHEMA_DEFAULT_GB


def estimate(
    task: Any,
    cfg: Any,
    *,
    sizes: ModelSizes | None = None,
    peaks: PeakEstimator | None = None,
    device_mb: list[int] | None = None,
) -> tuple[int, str]:
    """(MB, source) of one task: measured peak, else an explicit `model.memory_gb` (the user's
    word: set on the command line or by the experiment), else the checkpoint's size, else
    the family file's memory_gb. `task.mem_mb` arrives as memory_gb × the stage's factor."""
    if task.stage.endswith("_merge"):
        return 0, "merge (no model)"
    if peaks is not None:
        hit = peaks.refine(task)
        if hit is not None:
            return hit
    family = settings(ModelConfig, task.family_cfg)
    fam_gb, name = family.memory_gb, family.name
    if abs(fam_gb - family_file_memory_gb(name)) > 1e-9:
        return task.mem_mb, f"model.memory_gb={fam_gb:g} (set)"
    sizes = sizes or ModelSizes()
    analytic = analytic_mb(task, cfg, sizes)
    if analytic is not None:
        return analytic[0], f"size: {analytic[1]}"
    if (
        name != "tiny" and abs(fam_gb - SCHEMA_DEFAULT_GB) < 1e-9 and device_mb
    ):  # never a flat 0.5 GB
        return max(device_mb), "unknown size: a whole device (set model.memory_gb)"
    return task.mem_mb, f"model.memory_gb={fam_gb:g}"


def fill_estimates(plan: Any, cfg: Any, device_mb: list[int] | None = None) -> None:
    """Set `mem_mb` and `mem_source` of every task of the plan (the planner's one call)."""
    sizes = ModelSizes()
    plain = _plain(cfg)  # read per task: a dict is ~50x faster than OmegaConf nodes
    peaks = PeakEstimator(plain, peaks_cache_path())
    for task in plan.tasks.values():
        task.mem_mb, task.mem_source = estimate(
            task, plain, sizes=sizes, peaks=peaks, device_mb=device_mb
        )


def _plain(cfg: Any) -> Any:
    """The resolved config as plain dicts and lists (a plain mapping is returned as is)."""
    from omegaconf import DictConfig, OmegaConf

    return OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg
