"""Placing large models on a task's gang of GPUs.

- `max_memory_for_gang(free)`: accelerate's `max_memory` for the gang, keeping a reserve
  per device for activations and the CUDA context.
- `infer_placement`: a `device_map` from a config alone (accelerate's
  `init_empty_weights` + `get_balanced_memory` + `infer_auto_device_map`, the same
  computation `from_pretrained(device_map="auto")` does), refusing CPU / disk offload
  unless asked; works without CUDA, so maps for 8B / 70B models over simulated GPUs are
  testable on a laptop. `layer_distribution` and `layer_distribution_line` give the
  "Layer distribution: GPU 0: 16 layers, GPU 1: 16 layers" line for the logs.
- `gpus_needed(model_bytes, device_bytes)`: how many GPUs a model needs (the planner's
  `model.gpus_per_task`), e.g. a 70B bf16 reward model on 40 GB GPUs -> 4.
- `gang_placement(model, free_bytes, ...)`: the placement `load_on_gang` uses for a gang
  with that free memory (pure: testable with simulated GPUs and a meta-device model).
- `load_on_gang`: load a checkpoint sharded over the worker's pinned GPUs (quantized
  aliases -8bit / -4bit through `pita.models.loading`: CUDA only, one clear error elsewhere).
- `load_stage_lm`: THE loader of a stage's causal LMs (evaluate, collect): the family's
  dtype and quantization, and with `model.device_map=auto` `load_on_gang`; the layer
  distribution travels with the model (`placement_lines`) into the stage's `run_log_lines`,
  which the orchestrator writes to run.log.

The arithmetic is plain Python (the planner may import this module: no torch at import).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

GiB = 2**30

# Bytes per parameter by dtype name (weights only; quantized formats keep a few tensors wider).
BYTES_PER_PARAM = {
    "float32": 4.0,
    "fp32": 4.0,
    "bfloat16": 2.0,
    "bf16": 2.0,
    "float16": 2.0,
    "fp16": 2.0,
    "8bit": 1.0,
    "int8": 1.0,
    "4bit": 0.5,
    "int4": 0.5,
}


# --- arithmetic ------------------------------------------------------------------------------


def _gib(n_bytes: float) -> str:
    """Bytes -> accelerate's "12.34GiB" (floored to 0.01 GiB, never rounded up)."""
    hundredths = math.floor(n_bytes / GiB * 100)
    return f"{hundredths // 100}GiB" if hundredths % 100 == 0 else f"{hundredths / 100:.2f}GiB"


def max_memory_for_gang(
    free_bytes_per_device: Sequence[int], reserve_fraction: float = 0.1
) -> dict[int, str]:
    """`{0: "64.8GiB", 1: "70.2GiB", ...}`: what accelerate may put on each gang device,
    its free memory minus `reserve_fraction` (activations, CUDA context, fragmentation)."""
    if not 0 <= reserve_fraction < 1:
        raise ValueError(f"reserve_fraction={reserve_fraction}: must be in [0, 1)")
    return {
        i: _gib(max(0, b) * (1 - reserve_fraction)) for i, b in enumerate(free_bytes_per_device)
    }


def model_bytes(num_params: float, dtype: str = "bfloat16") -> int:
    """Weight bytes of a model of `num_params` parameters in `dtype` (or 8bit / 4bit)."""
    key = str(dtype).lower().removeprefix("torch.")
    if key not in BYTES_PER_PARAM:
        raise ValueError(f"dtype={dtype!r}: expected one of {sorted(BYTES_PER_PARAM)}")
    return int(num_params * BYTES_PER_PARAM[key])


def gpus_needed(
    model_bytes: float, device_bytes: int | Sequence[int], overhead: float = 1.2
) -> int:
    """The fewest GPUs whose memory holds `model_bytes × overhead`.

    `device_bytes`: one GPU's memory (all alike) or each GPU's free memory (the largest are
    used first). Raises ValueError when even every listed GPU together is too small.
    """
    need = model_bytes * overhead
    if isinstance(device_bytes, (int, float)):
        if device_bytes <= 0:
            raise ValueError(f"device_bytes={device_bytes}: must be > 0")
        return max(1, math.ceil(need / device_bytes))
    total = 0
    for k, b in enumerate(sorted(device_bytes, reverse=True), start=1):
        total += b
        if total >= need:
            return k
    raise ValueError(
        f"a model of {model_bytes / GiB:.1f} GiB (x{overhead} overhead = {need / GiB:.1f} GiB) does not "
        f"fit on all {len(device_bytes)} GPUs together ({total / GiB:.1f} GiB free); use a quantized "
        "alias (-8bit / -4bit) or more GPUs"
    )


# --- device maps from configs ----------------------------------------------------------------


def layer_distribution(
    device_map: Mapping[str, Any], num_layers: int | None = None, layers_prefix: str | None = None
) -> dict[Any, int]:
    """`{device: number of transformer blocks}` of a device map.

    With `num_layers` and `layers_prefix` (e.g. "model.layers") every block is resolved
    through the map (also when a whole parent, or "", is mapped to one device); without,
    the map's keys that end in a block index (".<n>") are counted.
    """
    counts: dict[Any, int] = {}
    if num_layers is not None and layers_prefix is not None:
        for i in range(num_layers):
            name = f"{layers_prefix}.{i}"
            owners = [k for k in device_map if k == "" or name == k or name.startswith(k + ".")]
            if not owners:
                raise ValueError(f"device map places no module containing {name!r}")
            dev = device_map[max(owners, key=len)]
            counts[dev] = counts.get(dev, 0) + 1
        return _ordered(counts)
    for key, dev in device_map.items():
        if re.search(r"(^|\.)\d+$", key):
            counts[dev] = counts.get(dev, 0) + 1
    return _ordered(counts)


def _ordered(counts: dict[Any, int]) -> dict[Any, int]:
    gpus = sorted(k for k in counts if isinstance(k, int))
    return {
        **{k: counts[k] for k in gpus},
        **{k: v for k, v in counts.items() if not isinstance(k, int)},
    }


def _device_label(dev: Any) -> str:
    if isinstance(dev, int):
        return f"GPU {dev}"
    return {"cpu": "CPU", "disk": "disk"}.get(str(dev), str(dev))


def layer_distribution_line(distribution: Mapping[Any, int]) -> str:
    """`Layer distribution: GPU 0: 16 layers, GPU 1: 16 layers` (for run.log / the task log)."""
    parts = [
        f"{_device_label(d)}: {n} layer{'s' if n != 1 else ''}" for d, n in distribution.items()
    ]
    return "Layer distribution: " + ", ".join(parts)


@dataclass
class DevicePlacement:
    """A device map and what it puts where."""

    device_map: dict[str, Any]  # pass to from_pretrained(device_map=...)
    layers: dict[Any, int]  # device -> transformer blocks
    bytes_per_device: dict[Any, int]  # device -> weight bytes
    max_memory: dict[Any, int]  # device -> the budget accelerate was given (bytes)
    num_layers: int
    total_bytes: int

    def log_line(self) -> str:
        return layer_distribution_line(self.layers)

    def log_lines(self) -> list[str]:
        """One line per device: layers, weight bytes and the budget."""
        lines = []
        for dev, n_bytes in self.bytes_per_device.items():
            budget = self.max_memory.get(dev)
            of = f" of {budget / GiB:.2f} GiB allowed" if budget else ""
            lines.append(
                f"{_device_label(dev)}: {self.layers.get(dev, 0)} layers, "
                f"{n_bytes / GiB:.2f} GiB of weights{of}"
            )
        return lines


def _torch_dtype(dtype: Any) -> Any:
    import torch
    from accelerate.utils import CustomDtype

    if isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key in ("8bit", "int8"):
        return torch.int8
    if key in ("4bit", "int4"):
        return CustomDtype.INT4
    from pita.models.loading import _DTYPES

    if key not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected float32 / bfloat16 / float16 / 8bit / 4bit")
    return _DTYPES[key]


def _empty_model(model_name_or_config: Any, trust_remote_code: bool, dtype: Any) -> Any:
    """The architecture on the meta device (no weights allocated, nothing downloaded but the config)."""
    import torch
    from accelerate import init_empty_weights
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        PretrainedConfig,
    )

    if isinstance(model_name_or_config, torch.nn.Module):
        return model_name_or_config
    config = model_name_or_config
    if not isinstance(config, PretrainedConfig):
        from pita.models.loading import _from_pretrained

        config = _from_pretrained(
            AutoConfig, "config of", str(model_name_or_config), trust_remote_code=trust_remote_code
        )
    archs = getattr(config, "architectures", None) or []
    auto_cls = (
        AutoModelForSequenceClassification
        if any("SequenceClassification" in a for a in archs)
        else AutoModelForCausalLM
    )
    build_dtype = (
        dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float16
    )
    with init_empty_weights():
        model = auto_cls.from_config(config, dtype=build_dtype, trust_remote_code=trust_remote_code)
    model.tie_weights()  # from_config on meta leaves tied embeddings untied: count them once
    return model


def _blocks(model: Any, no_split: Sequence[str]) -> tuple[str | None, int]:
    """(prefix, count) of the model's stack of transformer blocks (its largest ModuleList
    of no-split modules)."""
    import torch

    best: tuple[str | None, int] = (None, 0)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > best[1]:
            if not no_split or type(module[0]).__name__ in no_split:
                best = (name, len(module))
    return best


def _device_map(
    model: Any, budget: dict[Any, int], no_split: list[str], torch_dtype: Any, balanced: bool
) -> dict[str, Any]:
    """accelerate's device map of `model` within `budget` (balanced over the GPUs, or GPU 0
    first), its "Device 0 is not available" warnings silenced (expected for simulated GPUs)."""
    from accelerate import infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    accel_log = logging.getLogger("accelerate.utils.modeling")
    quiet = accel_log.level
    accel_log.setLevel(logging.ERROR)
    try:
        per_device = dict(budget)
        if balanced and sum(1 for k in budget if isinstance(k, int)) > 1:
            per_device = get_balanced_memory(
                model,
                max_memory=budget,
                no_split_module_classes=no_split,
                dtype=torch_dtype,
                low_zero=False,
            )
        return dict(
            infer_auto_device_map(
                model, max_memory=per_device, no_split_module_classes=no_split, dtype=torch_dtype
            )
        )
    finally:
        accel_log.setLevel(quiet)


def infer_placement(
    model_name_or_config: Any,
    max_memory: Mapping[Any, Any],
    dtype: Any = "bfloat16",
    no_split_module_classes: Sequence[str] | None = None,
    *,
    balanced: bool = True,
    allow_offload: bool = False,
    trust_remote_code: bool = False,
) -> DevicePlacement:
    """The device map of a model over `max_memory` ({gpu index: "40GiB", ...}; integer ids
    work without CUDA: only sizes are computed), with its layer and byte distribution.

    `model_name_or_config`: a transformers config, a hub id / local folder (its config is
    read), or a model already built (on the meta device). `dtype`: the load dtype, or
    "8bit" / "4bit". `balanced` spreads the blocks evenly (from_pretrained's "auto" /
    "balanced"); False fills GPU 0 first ("sequential"). A map that would offload to the
    CPU or disk raises ValueError unless `allow_offload`.
    """
    from accelerate.utils import compute_module_sizes, convert_file_size_to_int

    torch_dtype = _torch_dtype(dtype)
    model = _empty_model(model_name_or_config, trust_remote_code, torch_dtype)
    no_split = list(
        no_split_module_classes
        if no_split_module_classes is not None
        else (getattr(model, "_no_split_modules", None) or [])
    )
    budget = {
        k: convert_file_size_to_int(v) if isinstance(v, str) else int(v)
        for k, v in max_memory.items()
    }
    if not budget:
        raise ValueError("max_memory is empty: give at least one device")
    device_map = _device_map(model, budget, no_split, torch_dtype, balanced)
    offloaded = sorted({str(d) for d in device_map.values() if not isinstance(d, int)})
    sizes = compute_module_sizes(model, dtype=torch_dtype)
    total = int(sizes[""])
    if offloaded and not allow_offload:
        raise ValueError(
            f"the model ({total / GiB:.1f} GiB in {dtype}) does not fit in max_memory "
            f"({', '.join(f'{k}: {v / GiB:.1f} GiB' for k, v in budget.items())}): part would go to "
            f"{' and '.join(offloaded)}; raise model.gpus_per_task, use a quantized alias (-8bit / -4bit) "
            "or pass allow_offload=True"
        )
    bytes_per_device: dict[Any, int] = {}
    for key, dev in device_map.items():
        bytes_per_device[dev] = bytes_per_device.get(dev, 0) + int(sizes.get(key, 0))
    prefix, n_layers = _blocks(model, no_split)
    blocks = (n_layers, prefix) if prefix is not None else ()
    return DevicePlacement(
        device_map=device_map,
        layers=layer_distribution(device_map, *blocks),
        bytes_per_device=_ordered(bytes_per_device),
        max_memory=budget,
        num_layers=n_layers,
        total_bytes=total,
    )


# --- loading on the worker's gang ---------------------------------------------------------


def free_bytes_on_gang() -> list[int]:
    """Free bytes of each GPU this process sees (its pinned gang); [] without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [int(torch.cuda.mem_get_info(i)[0]) for i in range(torch.cuda.device_count())]


def gang_placement(
    name_or_config: Any,
    free_bytes: Sequence[int],
    *,
    dtype: Any = "bfloat16",
    quantization: str | None = None,
    reserve_fraction: float = 0.1,
    trust_remote_code: bool = False,
) -> DevicePlacement:
    """Where `load_on_gang` puts a model on a gang whose GPUs have `free_bytes` free:
    `max_memory_for_gang` per device, then a balanced map (no CPU / disk offload)."""
    max_memory = max_memory_for_gang(free_bytes, reserve_fraction)
    return infer_placement(
        name_or_config, max_memory, quantization or dtype, trust_remote_code=trust_remote_code
    )


def load_on_gang(
    name_or_path: str,
    *,
    dtype: str = "auto",
    quantization: str | None = None,
    reserve_fraction: float = 0.1,
    logger: logging.Logger | None = None,
    **load_kwargs: Any,
) -> Any:
    """A causal LM sharded over every GPU pinned to this worker (one GPU: just that GPU).

    The map comes from `gang_placement` (the GPUs' free memory) and the layer distribution
    is logged and kept on the model (`placement_lines`). Quantized loads (-8bit / -4bit
    aliases) go through `pita.models.loading`, which raises one clear line without CUDA +
    bitsandbytes; without CUDA a full-precision model loads on the CPU.
    """
    from pita.models.loading import load_causal_lm, resolve_dtype

    logger = logger or log
    free = free_bytes_on_gang()
    if not free:
        return load_causal_lm(
            name_or_path, dtype=dtype, device="cpu", quantization=quantization, **load_kwargs
        )
    placement = gang_placement(
        name_or_path,
        free,
        dtype=resolve_dtype(dtype, "cuda"),
        quantization=quantization,
        reserve_fraction=reserve_fraction,
        trust_remote_code=bool(load_kwargs.get("trust_remote_code", False)),
    )
    lines = [placement.log_line(), *placement.log_lines()]
    for line in lines:
        logger.info("%s: %s", name_or_path, line)
    model = load_causal_lm(
        name_or_path,
        dtype=dtype,
        device="cuda",
        device_map=placement.device_map,
        quantization=quantization,
        **load_kwargs,
    )
    model.pita_placement_lines = lines
    return model


def placement_lines(model: Any, name: str) -> list[str]:
    """The run.log lines of a model loaded by `load_on_gang` ("<name>: Layer distribution: ...")."""
    return [f"{name}: {line}" for line in getattr(model, "pita_placement_lines", [])]


def trained_policy_refusal(family: str, quantization: str | None) -> str | None:
    """Why a policy a stage trains cannot load as the family says (None: it can): its
    weights are trained in fp32, never quantized (QLoRA is not supported; preflight refuses
    the same family before the run: pita/experiment/preflight.py)."""
    if quantization:
        return (
            f"model.name={family}: a policy this stage trains loads in fp32; -{quantization} "
            "(quantized training) is not supported: drop the suffix"
        )
    return None


def load_stage_lm(
    name_or_path: str,
    *,
    family: str,
    family_cfg: Mapping[str, Any],
    device: str,
    attn_impl: str = "eager",
    logger: logging.Logger | None = None,
    trainable: bool = False,
) -> Any:
    """A stage's causal LM (π_ref, a trained policy) as the family says: its dtype, the
    quantization of a -8bit / -4bit alias, and with `model.device_map=auto` sharded over the
    worker's gang through `load_on_gang` (per-GPU `max_memory`, layer distribution logged).
    The one loader of every stage: `trainable` (a policy pretrain, DPO / RPO or GRPO trains)
    is a fresh fp32 copy on `device` (`device_map` places only the models a stage runs; a
    trained policy too large for one device gets an FSDP gang from the planner); a quantized
    family is refused in one line, since quantization would not reach the trained weights."""
    from pita.models.catalog import resolve_family
    from pita.models.loading import load_causal_lm

    spec = resolve_family(family, family_cfg)
    if trainable:
        refusal = trained_policy_refusal(family, spec.quantization)
        if refusal:
            raise ValueError(refusal)
        if family_cfg.get("device_map") == "auto" and logger is not None:
            # device_map places the models a stage only runs; a trained policy is placed by
            # training.parallel_strategy (one device, or a DDP / FSDP gang for a large one)
            logger.info("model.device_map=auto: the trained policy stays on %s", device)
        return load_causal_lm(
            str(name_or_path),
            dtype="float32",  # mixed precision is autocast's job
            device=device,
            attn_impl=attn_impl,
            trust_remote_code=spec.trust_remote_code,
        )
    kwargs: dict[str, Any] = dict(
        dtype=spec.dtype,  # model.dtype over the catalog's
        quantization=spec.quantization,
        attn_impl=attn_impl,
        trust_remote_code=spec.trust_remote_code,
    )
    if family_cfg.get("device_map") == "auto":
        return load_on_gang(str(name_or_path), logger=logger, **kwargs)
    return load_causal_lm(str(name_or_path), device=device, **kwargs)
