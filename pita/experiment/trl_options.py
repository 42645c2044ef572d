"""`algos.<NAME>.trl.<key>`, `.reward_trl.<key>` and `.peft`, checked in the parent before
anything starts.

`trl` passes any field of the trainer's TRL config (`DPOConfig` for DPO / RPO, `GRPOConfig`
for GRPO / GRPO-HF, TrainingArguments included) to the worker, which hands it to the config
last (pita/algos/trl_common.py `training_args`); `reward_trl` does the same with
`RewardConfig` for the proxy reward model of the -HF variants. Both mappings are registered
open (`open_trl_dict`), so `algos.GRPO.trl.scale_rewards=false` needs no `+`. Three mistakes
are refused here, each one line naming the key (exit 2):

- a field the config does not have, with the nearest field (`difflib.get_close_matches`);
- a value of the wrong type, where the field's annotation makes that cheap to know (fields
  that are only int / float / bool / None; strings, lists and enum-typed fields are left to
  TRL's own `__post_init__`, which accepts more than their annotation says, e.g.
  `scale_rewards=false`);
- a field pita sets from one of its own keys (`learning_rate` is `algos.<NAME>.lr`, ...):
  pita's key keeps its meaning, so the message names the key to use instead.

How the fields are known without importing TRL (the parent must stay torch-free): the
config dataclasses are read from their source files with `ast`
(pita/experiment/trl_source.py `trl_fields`). That is exactly `dataclasses.fields(DPOConfig)`
(tests/test_trl_options.py checks it against the installed TRL) at the cost of parsing three
files once per process.

`peft` (LoRA) is checked by its rule in pita/core/schema.py (`peft_errors`), and peft must
be installed (`pip install 'pita[lora]'`).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pita.core.schema import GRPOConfig, PreferenceConfig, RewardModelMixin, peft_errors
from pita.experiment.trl_source import trl_fields
from pita.experiment.trl_values import guard_error, value_error

# algorithm family -> (TRL module under trl/trainer/, config class)
TRL_CONFIGS: dict[type, tuple[str, str]] = {
    PreferenceConfig: ("dpo_config", "DPOConfig"),
    GRPOConfig: ("grpo_config", "GRPOConfig"),
}

_BATCH = "algos.{name}.batch_size (cut into training.micro_batch_size x accumulation)"
_CKPT = "training.checkpoint_every / training.checkpoint_every_minutes"
# TRL field -> the pita key that sets it (every TRL-trained algorithm)
PITA_KEYS: dict[str, str] = {
    "learning_rate": "algos.{name}.lr",
    "num_train_epochs": "algos.{name}.epochs",
    "max_steps": "algos.{name}.steps",
    "per_device_train_batch_size": _BATCH,
    "gradient_accumulation_steps": _BATCH,
    "weight_decay": "training.weight_decay",
    "max_grad_norm": "training.max_grad_norm",
    "torch_compile": "training.compile",
    "seed": "experiment.seed",
    "data_seed": "experiment.seed",
    "bf16": "training.precision_type / training.mixed_precision",
    "fp16": "training.precision_type / training.mixed_precision",
    "gradient_checkpointing": "training.gradient_checkpointing",
    "activation_checkpointing": "training.gradient_checkpointing",
    "dataloader_num_workers": "algos.{name}.num_workers",
    "dataloader_pin_memory": "training.pin_memory",
    "use_cpu": "system.devices",
    "save_strategy": _CKPT,
    "save_steps": _CKPT,
    "output_dir": "the run folder (pita places the task's files)",
    "report_to": "logger.backend",
    "run_name": "logger.backend (runs are named by task id)",
    "push_to_hub": "nothing: pita never contacts the hub from a task",
    "resume_from_checkpoint": "resume_from",
    "peft_config": "algos.{name}.peft",
}
FAMILY_KEYS: dict[type, dict[str, str]] = {
    PreferenceConfig: {"beta": "algos.{name}.beta"},
    GRPOConfig: {
        "beta": "algos.{name}.beta",
        "num_generations": "algos.{name}.num_generations",
        "max_completion_length": "algos.{name}.max_completion_length",
        "temperature": "generation.temperature",
        "top_k": "generation.top_k",
        "top_p": "generation.top_p",
    },
}
REWARD_CONFIG = ("reward_config", "RewardConfig")  # algos.<-HF>.reward_trl: the proxy reward model
REWARD_KEYS = {
    **PITA_KEYS,
    "learning_rate": "algos.{name}.reward_lr",
    "num_train_epochs": "algos.{name}.reward_epochs",
    "max_steps": "algos.{name}.reward_epochs",
}
SFT_KEYS = ("loss_type", "loss_weights")  # set by sft_weight > 0 (RPO: [sigmoid, sft])
_CHECKED_KINDS = {"int", "float", "bool", "None"}


def open_trl_dict(schema: type) -> Any:
    """The Hydra node of an algorithm schema, with its `trl` mapping open (not struct), so
    `algos.DPO.trl.loss_type=ipo` needs no `+`; what it may hold is `trl_option_errors`' job."""
    keys = [f.name for f in dataclasses.fields(schema) if f.name in ("trl", "reward_trl")]
    if not keys:
        return schema
    node = OmegaConf.structured(schema)
    for key in keys:
        OmegaConf.set_struct(node[key], False)
    return node


# --- the check -----------------------------------------------------------------------------


def _type_ok(kinds: set[str], value: Any) -> bool:
    if not kinds <= _CHECKED_KINDS:
        return True
    if value is None:
        return "None" in kinds
    if isinstance(value, bool):
        return "bool" in kinds
    if isinstance(value, int):
        return bool(kinds & {"int", "float"})
    if isinstance(value, float):
        return "float" in kinds
    return False


def _expected(kinds: set[str]) -> str:
    order = ("int", "float", "bool", "None")
    return " or ".join("null" if k == "None" else k for k in order if k in kinds)


def _option_errors(
    name: str, algo: dict, key: str, config: tuple[str, str], own: dict[str, str]
) -> list[str]:
    """The lines of `algos.<name>.<key>` (trl or reward_trl) against TRL's `config`;
    `own`: the fields pita sets itself -> the pita key to use instead."""
    options = algo.get(key) or {}
    if not isinstance(options, dict):
        return [f"algos.{name}.{key}={options!r}: a mapping of {config[1]} fields"]
    if not options:
        return []
    fields = trl_fields(*config)
    if not fields:
        return [f"algos.{name}.{key}: cannot read TRL's {config[1]} fields (is trl installed?)"]
    errors = []
    for field, value in options.items():
        prefix = f"algos.{name}.{key}.{field}"
        guard = guard_error(f"algos.{name}.{key}", field, value)
        if guard is not None:
            errors.append(guard)
        elif field not in fields:
            near = difflib.get_close_matches(field, list(fields), n=1, cutoff=0.6)
            hint = f"; did you mean {near[0]}?" if near else ""
            errors.append(f"{prefix}: not a field of TRL's {config[1]}{hint}")
        elif field in own:
            errors.append(
                f"{prefix}={value!r}: set by pita from {own[field].format(name=name)}; use that"
            )
        elif (
            key == "trl"
            and field in SFT_KEYS
            and "sft_weight" in algo
            and float(algo["sft_weight"]) > 0
        ):
            errors.append(
                f"{prefix}={value!r}: set by pita from algos.{name}.sft_weight "
                f"({algo['sft_weight']}: loss_type [sigmoid, sft]); set it to 0 to choose the loss"
            )
        elif not _type_ok(fields[field], value):
            errors.append(f"{prefix}={value!r}: must be {_expected(fields[field])}")
        elif (line := value_error(prefix, field, value, config)) is not None:
            errors.append(line)
    return errors


def trl_option_errors(algos: dict) -> list[str]:
    """One line per bad `algos.<NAME>.trl.<key>`, `.reward_trl.<key>` or `.peft` of a resolved
    config (the algorithms whose schema has them: the TRL-trained families, the -HF reward
    model)."""
    from pita.algos.registry import ALGORITHMS

    errors: list[str] = []
    for name, algo in algos.items():
        if name not in ALGORITHMS or not isinstance(algo, (dict, DictConfig)):
            continue
        schema, algo = ALGORITHMS[name].schema, dict(algo)
        if issubclass(schema, RewardModelMixin):
            errors += _option_errors(name, algo, "reward_trl", REWARD_CONFIG, REWARD_KEYS)
        family = next((f for f in TRL_CONFIGS if issubclass(schema, f)), None)
        if family is None:
            continue
        own = {**PITA_KEYS, **FAMILY_KEYS.get(family, {})}
        errors += _option_errors(name, algo, "trl", TRL_CONFIGS[family], own)
        errors += peft_errors(algo.get("peft"), f"algos.{name}.")
        if algo.get("peft") is not None and importlib.util.find_spec("peft") is None:
            errors.append(
                f"algos.{name}.peft: the peft package is not installed; pip install 'pita[lora]'"
            )
    return errors
