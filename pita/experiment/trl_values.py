"""The VALUES of `algos.<NAME>.trl.<key>` / `.reward_trl.<key>` that TRL itself checks only
when the trainer starts, checked in the parent before any process exists (exit 2, one
line each). trl_options.py checks the field names and cheap types; this module checks:

- choices: a value outside what the field allows (`loss_type=dr_grpoo`), with the nearest
  allowed value. What a field allows is read from TRL's source with `ast`, like the fields
  themselves: a literal `metadata={"choices": [...]}`, an enum annotation
  (`optim: OptimizerNames | str`), or a help text that enumerates its values ("Supported
  values are 'grpo', 'dr_grpo', ..."; every quoted word of such a help counts as allowed,
  so a field is never refused a value its help names);
- a package the value needs that is not installed (`optim=adamw_bnb_8bit` without
  bitsandbytes, `deepspeed=<file>` without deepspeed): transformers would raise in the
  first training task, after the run started;
- files named by an option (`deepspeed`, `fsdp_config`, `accelerator_config`): read like a
  run folder's control files (no link, yours, not writable by others, at most 1 MB, JSON);
- secrets: a token-like option (`hub_token`, ...) is refused without echoing its value:
  pita never pushes to a hub, and the value would be written into the run folder
  (`.hydra/config.yaml`, `run_info.json`, every task's `result.json` and log);
- `trust_remote_code` anywhere under `trl` (TRL's own field, `model_init_kwargs`): refused,
  naming `model.trust_remote_code`, the one switch for every model pita loads;
- ceilings: every number passed through has one (`CEILINGS`, by what the field's name says
  it counts: processes, tokens, steps and sizes, a port, seconds; any other number: at most
  `OTHER_CEILING` in magnitude), so `dataset_num_proc=100000` (100,000 processes asked of
  `datasets`) or `max_length=1000000000` is one line before the run, naming the key and its
  ceiling, like every size of pita's own schema.
"""

from __future__ import annotations

import ast
import difflib
import functools
import importlib.util
import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

SECRET_NAME = re.compile(r"(^|_)token$|secret|passw|api_?key|credential", re.IGNORECASE)
SECRET_ALLOWED = {"pad_token", "eos_token", "include_num_input_tokens_seen"}  # names, not secrets
# a hub / API token, or a URL carrying a password (`https://user:pw@host`)
SECRET_VALUE = re.compile(r"\b(hf_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_-]{20,})|://[^/\s:@]+:[^/\s@]+@")
# space-separated option lists or mappings, not one choice
NOT_CHOICES = frozenset({"debug", "lr_scheduler_kwargs", "fsdp"})
FILE_OPTIONS = ("deepspeed", "fsdp_config", "accelerator_config")
MAX_OPTION_FILE_BYTES = 2**20
_ENUMERATES = re.compile(r"supported values|possible values|must be one of", re.IGNORECASE)
_QUOTED = re.compile(r"'([A-Za-z0-9_.\-]+)'|`([A-Za-z0-9_.\-]+)`")

# (what the field's name says it counts, its ceiling, the unit named in the message); the
# first match wins. The schema's own ceilings for the same things: threads_per_worker 1,024,
# dataset.max_new_tokens 131,072, dataset.train_size 10,000,000.
CEILINGS: tuple[tuple[re.Pattern[str], float, str], ...] = (
    (re.compile(r"num_proc|num_workers|parallel_size|prefetch_factor"), 1_024, "processes"),
    (re.compile(r"port$"), 65_535, "a TCP port"),
    (re.compile(r"timeout"), 604_800, "seconds (a week)"),
    (re.compile(r"length|tokens"), 131_072, "tokens"),
    (
        re.compile(r"size|steps|num_|iterations|limit|_mb$|multiple_of|print|epochs"),
        10_000_000,
        "a count or size",
    ),
)
OTHER_CEILING = 1e6  # coefficients, probabilities, temperatures: any larger one is a typo

# optimizer value -> (module to import, pip name): transformers' trainer_optimizer.py
_BNB = ("bitsandbytes", "bitsandbytes")
OPTIM_PACKAGES: dict[str, tuple[str, str]] = {
    **{
        o: _BNB
        for o in (
            "adamw_bnb_8bit",
            "adamw_8bit",
            "ademamix",
            "ademamix_8bit",
            "lion_8bit",
            "lion_32bit",
            "paged_adamw_32bit",
            "paged_adamw_8bit",
            "paged_ademamix_32bit",
            "paged_ademamix_8bit",
            "paged_lion_32bit",
            "paged_lion_8bit",
            "rmsprop_bnb",
            "rmsprop_bnb_8bit",
            "rmsprop_bnb_32bit",
        )
    },
    **{
        o: ("galore_torch", "galore-torch")
        for o in (
            "galore_adamw",
            "galore_adamw_8bit",
            "galore_adafactor",
            "galore_adamw_layerwise",
            "galore_adamw_8bit_layerwise",
            "galore_adafactor_layerwise",
        )
    },
    **{o: ("apollo_torch", "apollo-torch") for o in ("apollo_adamw", "apollo_adamw_layerwise")},
    **{o: ("torchao", "torchao") for o in ("adamw_torch_4bit", "adamw_torch_8bit")},
    **{
        o: ("schedulefree", "schedulefree")
        for o in ("schedule_free_radam", "schedule_free_adamw", "schedule_free_sgd")
    },
    **{o: ("lomo_optim", "lomo-optim") for o in ("lomo", "adalomo")},
    "grokadamw": ("grokadamw", "grokadamw"),
    "stable_adamw": ("optimi", "torch-optimi"),
    "adamw_anyprecision": ("torchdistx", "torchdistx"),
    "adamw_torch_xla": ("torch_xla", "torch_xla"),
    "adamw_torch_npu_fused": ("torch_npu", "torch_npu"),
}
BACKEND_PACKAGES = {"deepspeed": ("deepspeed", "deepspeed")}


# --- what a field allows, read from TRL's source ----------------------------------------------


def _class_node(module: str, name: str) -> tuple[ast.Module, ast.ClassDef] | None:
    from pita.experiment.trl_source import _module_file, _parse

    path = _module_file(module)
    if path is None:
        return None
    tree = _parse(path)
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)
    return None if cls is None else (tree, cls)


def _resolve(tree: ast.Module, module: str, name: str) -> str:
    from pita.experiment.trl_source import _base_module

    return _base_module(tree, module, name) or module


def _field_stmts(module: str, name: str, depth: int = 0) -> Iterator[tuple[str, ast.Module, Any]]:
    """(module, tree, AnnAssign) of every field of dataclass `name`, its bases' first."""
    found = _class_node(module, name)
    if found is None or depth > 8:
        return
    tree, cls = found
    for base in cls.bases:
        if isinstance(base, ast.Name):
            yield from _field_stmts(_resolve(tree, module, base.id), base.id, depth + 1)
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            yield module, tree, stmt


def _enum_values(module: str, tree: ast.Module, annotation: ast.AST) -> set[str]:
    """The string values of the enum classes an annotation names (`OptimizerNames | str`)."""
    values: set[str] = set()
    for node in ast.walk(annotation):
        if not isinstance(node, ast.Name) or node.id in ("str", "None", "Optional", "Union"):
            continue
        found = _class_node(_resolve(tree, module, node.id), node.id)
        if found is None:
            continue
        _, cls = found
        if not any(getattr(b, "id", "").endswith("Enum") for b in cls.bases):
            continue
        for stmt in cls.body:
            if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Constant):
                if isinstance(stmt.value.value, str):
                    values.add(stmt.value.value)
    return values


def _metadata(value: ast.AST | None) -> dict[str, ast.AST]:
    if not (isinstance(value, ast.Call) and getattr(value.func, "id", "") == "field"):
        return {}
    meta = next((k.value for k in value.keywords if k.arg == "metadata"), None)
    if not isinstance(meta, ast.Dict):
        return {}
    return {
        k.value: v
        for k, v in zip(meta.keys, meta.values)
        if isinstance(k, ast.Constant) and isinstance(k.value, str)
    }


def _choices_of(module: str, tree: ast.Module, stmt: Any) -> set[str]:
    meta = _metadata(stmt.value)
    choices = meta.get("choices")
    if isinstance(choices, (ast.List, ast.Tuple)):
        literal = [c.value for c in choices.elts if isinstance(c, ast.Constant)]
        if literal and all(isinstance(c, str) for c in literal):
            return {str(c) for c in literal}
    values = _enum_values(module, tree, stmt.annotation)
    if values:
        return values
    help_node = meta.get("help")
    text = help_node.value if isinstance(help_node, ast.Constant) else ""
    if isinstance(text, str) and _ENUMERATES.search(text):
        return {a or b for a, b in _QUOTED.findall(text)}
    return set()


@functools.cache
def field_choices(module: str, name: str) -> dict[str, frozenset[str]]:
    """field -> the string values TRL's `trl.trainer.<module>.<name>` accepts, for the
    fields whose source says so (see the module docstring); other fields are absent."""
    from pita.experiment.trl_source import trl_fields

    names = set(trl_fields(module, name))  # a help text quotes other fields too: not values
    out: dict[str, frozenset[str]] = {}
    for mod, tree, stmt in _field_stmts(f"trl.trainer.{module}", name):
        choices = _choices_of(mod, tree, stmt) - names
        if choices and stmt.target.id not in NOT_CHOICES:
            out[stmt.target.id] = frozenset(choices)
        else:
            out.pop(stmt.target.id, None)
    return out


# --- the checks ---------------------------------------------------------------------------------


def _missing(module: str) -> bool:
    return importlib.util.find_spec(module) is None


def _choice_error(prefix: str, value: Any, allowed: frozenset[str], config: str) -> str | None:
    items = value if isinstance(value, (list, tuple)) else [value]
    for item in items:
        if not isinstance(item, str) or item in allowed:
            continue  # bools and numbers: the type check's and TRL's business
        near = difflib.get_close_matches(item, sorted(allowed), n=1, cutoff=0.6)
        hint = f"; did you mean {near[0]}?" if near else ""
        shown = ", ".join(sorted(allowed)[:12]) + (" ..." if len(allowed) > 12 else "")
        return f"{prefix}={item!r}: not a value TRL's {config} accepts ({shown}){hint}"
    return None


def _package_error(prefix: str, field: str, value: Any) -> str | None:
    if field == "optim" and isinstance(value, str) and value in OPTIM_PACKAGES:
        module, pip = OPTIM_PACKAGES[value]
        if _missing(module):
            return (
                f"{prefix}={value!r}: needs the {pip} package, which is not installed here; "
                f"pip install {pip}, or use optim=adamw_torch"
            )
    if field in BACKEND_PACKAGES and value not in (None, "", {}):
        module, pip = BACKEND_PACKAGES[field]
        if _missing(module):
            return f"{prefix}: needs the {pip} package, which is not installed here; pip install {pip}, or drop it"
    return None


def option_file_error(prefix: str, value: Any) -> str | None:
    """A TRL option naming a file, read as pita reads its control files: an absolute path
    to a regular file you own, no link, nobody else may write it, at most 1 MB of JSON."""
    if not isinstance(value, str) or not value:
        return None  # an inline mapping: passed as is
    from pita.core.errors import ConfigError
    from pita.core.safe_files import read_control_text

    path = Path(value).expanduser()
    if not path.is_absolute():
        return f"{prefix}={value!r}: an absolute path (workers run from pita's folder, not yours)"
    try:
        text = read_control_text(path, MAX_OPTION_FILE_BYTES)
    except FileNotFoundError:
        return f"{prefix}={value!r}: no such file"
    except ConfigError as exc:
        return f"{prefix}={value!r}: {exc.messages[0]}"
    except OSError as exc:
        return f"{prefix}={value!r}: cannot be read ({exc.strerror})"
    try:
        json.loads(text)
    except ValueError as exc:
        return f"{prefix}={value!r}: not a JSON file ({str(exc).split(':')[0]})"
    return None


def _remote_code_keys(value: Any, key: str) -> Iterator[str]:
    if isinstance(value, Mapping):
        for k, v in value.items():
            if str(k) == "trust_remote_code":
                yield f"{key}.{k}"
            else:
                yield from _remote_code_keys(v, f"{key}.{k}")


def secret_error(prefix: str, field: str, value: Any) -> str | None:
    """A token-like option: refused, its value never printed."""
    looks_secret = isinstance(value, str) and SECRET_VALUE.search(value)
    if (SECRET_NAME.search(field) and field not in SECRET_ALLOWED) or looks_secret:
        return (
            f"{prefix}: looks like a secret; refused, its value is not shown (pita never pushes to a "
            f"hub, and the config is written into the run folder); pass secrets in the environment "
            f"(HF_TOKEN, WANDB_API_KEY, MLFLOW_TRACKING_PASSWORD), which pita never writes"
        )
    return None


def guard_error(prefix: str, field: str, value: Any) -> str | None:
    """Checked before anything else of `<prefix>.<field>` (so no later message echoes a
    secret): a remote-code switch, a token-like option."""
    remote = next(_remote_code_keys({field: value}, prefix), None)
    if remote is not None:
        return (
            f"{remote}: remote code is switched by model.trust_remote_code alone (one switch "
            f"for every model pita loads); set model.trust_remote_code=true instead"
        )
    return secret_error(f"{prefix}.{field}", field, value)


def ceiling_error(key: str, field: str, value: Any) -> str | None:
    """`key=value: at most <ceiling> (<unit>)` for a number above its field's ceiling
    (`CEILINGS`; in magnitude for a field no rule names)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    for pattern, ceiling, unit in CEILINGS:
        if pattern.search(field):
            if value > ceiling:
                return f"{key}={value!r}: at most {ceiling:,} ({unit}); pita passes it to TRL"
            return None
    if abs(value) > OTHER_CEILING:
        return f"{key}={value!r}: at most {OTHER_CEILING:,.0f} in magnitude; pita passes it to TRL"
    return None


def value_error(key: str, field: str, value: Any, config: tuple[str, str]) -> str | None:
    """The value of an existing TRL field that TRL would refuse only in the task: a number
    above its ceiling, a missing package, a value outside its choices, an unsafe or
    unreadable file."""
    line = ceiling_error(key, field, value) or _package_error(key, field, value)
    choices = field_choices(*config)
    if line is None and field in choices:
        line = _choice_error(key, value, choices[field], config[1])
    if line is None and field in FILE_OPTIONS:
        line = option_file_error(key, value)
    return line
