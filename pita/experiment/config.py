"""Checking a composed config: the cross-field rules, on top of the schema's walker.

The schema is pita/core/schema.py: one dataclass per `conf/` group, each field with its
help and the values it allows. It is registered in Hydra's ConfigStore (`pita_schema`,
and one schema per algorithm family that `conf/algo/*.yaml` start from), so an unknown key
or a value of the wrong type fails at compose time. `validate(cfg)` then walks the schema
(`schema_errors`: ranges, choices, a `+key` the schema does not have) and checks what
relates keys to each other or to the world (devices, packages, run folders, the task's own
keys), and raises one `ConfigError` with a line per problem, each naming the key and what
is allowed. Both happen before any worker starts.

Keys documented by the seed guide (docs/guides/gpu_execution.txt) keep their names and meaning (experiment.name,
system.attn_impl, system.clear_cache_interval, system.use_parallel_execution,
training.micro_batch_size, training.gradient_checkpointing,
data_collection.reward_batch_size, generation.batch_size,
algos.<NAME>.enabled|batch_size|num_workers, rounds_of_training, resume_from).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pita.algos.registry import ALGO_NAMES, ALGORITHMS, ANY
from pita.core.errors import ConfigError
from pita.core.gpu_manager import validate_devices_spec
from pita.core.paths import RunPaths
from pita.core.schema import (  # noqa: F401 (the dataclasses' old home re-exports them)
    ALGO_SCHEMAS,
    LOGGER_BACKENDS,
    UNKNOWN_KEY,
    DataCollectionConfig,
    DatasetConfig,
    EvaluationConfig,
    ExecutorConfig,
    ExperimentConfig,
    GenerationConfig,
    GuidanceConfig,
    LoggerConfig,
    ModelConfig,
    PitaConfig,
    PretrainConfig,
    SystemConfig,
    TinyModelConfig,
    TrainingConfig,
    leaf_fields,
    schema_errors,
)
from pita.core.yaml_bound import install as _bound_yaml_aliases
from pita.experiment.dataset_choice import dataset_keys  # noqa: F401 (its old home)
from pita.experiment.trl_options import open_trl_dict, trl_option_errors

_bound_yaml_aliases()  # every YAML read through OmegaConf from here on: pita/core/yaml_bound.py


# What this process stored in Hydra's ConfigStore: (group, name) -> the schema it came from.
_REGISTERED: dict[tuple[str | None, str], type] = {}


def register_configs() -> None:
    """Register the schema with Hydra (called before every composition: run_parallel.py and
    tests). A schema already stored from the same class is not stored again: `store`
    rebuilds the node from the dataclass, 0.06 s of a 0.4 s composition (what a process
    that composes many times, the suite's config tests, spends most on after Hydra)."""
    from hydra.core.config_store import ConfigStore

    from pita.datasets import plugin_schemas

    wanted: dict[tuple[str | None, str], type] = {(None, "pita_schema"): PitaConfig}
    # conf/algo/<x>.yaml: defaults: [<name>, _self_]
    wanted.update({("algo", name): schema for name, schema in ALGO_SCHEMAS.items()})
    # a plugin dataset's own keys: its conf/dataset/<x>.yaml's defaults name
    # `optional /dataset_schema@_here_: <x>` (docs/extending.md)
    wanted.update({("dataset_schema", n): s for n, s in plugin_schemas().items()})
    cs = ConfigStore.instance()
    for (group, name), schema in wanted.items():
        if _REGISTERED.get((group, name)) is schema:
            continue
        node = open_trl_dict(schema) if group == "algo" else schema
        cs.store(group=group, name=name, node=node)
        _REGISTERED[(group, name)] = schema


# ---------------------------------------------------------------------------------------
# Validation. Every message: "<key>=<value>: <what is allowed>".
# ---------------------------------------------------------------------------------------


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


def secret_errors(node: Any, key: str = "") -> list[str]:
    """`<key>: looks like a secret` for every string of a resolved config that holds a token
    or a URL with a password (the config is written into the run folder and every task's
    result); its value is never printed. `algos.<NAME>.trl` is checked by its own rule
    (pita/experiment/trl_values.py)."""
    from pita.experiment.trl_values import SECRET_VALUE, secret_error

    if isinstance(node, str):
        return [line] if SECRET_VALUE.search(node) and (line := secret_error(key, "", node)) else []
    if isinstance(node, dict):
        return [
            m
            for k, v in node.items()
            if k not in ("trl", "reward_trl")
            for m in secret_errors(v, f"{key}.{k}" if key else str(k))
        ]
    if isinstance(node, list):
        return [m for i, v in enumerate(node) for m in secret_errors(v, f"{key}[{i}]")]
    return []


COMMAND_LINE_WRITTEN = (
    "Hydra writes the command line into .hydra/overrides.yaml and hydra.yaml, pita into "
    "run_info.json and run.log"
)
IN_THE_ENVIRONMENT = (
    "pass secrets in the environment (e.g. `HF_TOKEN=... python run_parallel.py`; "
    "HF_TOKEN, WANDB_API_KEY, MLFLOW_TRACKING_PASSWORD), which pita never writes"
)


def command_line_secret_errors(argv: list[str]) -> list[str]:
    """`<key>: looks like a secret` for every argument of the command line that holds a
    token (any key: pita's, a `+`-added one, Hydra's own `hydra.*`, a flag's value) or sets a
    secret-named variable (`+hydra.job.env_set.HF_TOKEN=...`, whatever its value). Hydra's
    `hydra.job.env_set` is not a way to pass a secret: Hydra writes it into the run folder;
    the environment of the command is. Checked before anything is composed, so no later
    message echoes the value."""
    from pita.experiment.trl_values import SECRET_ALLOWED, SECRET_NAME, SECRET_VALUE

    errors = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        bare = key.lstrip("+~")
        leaf = bare.rsplit(".", 1)[-1]
        named = sep and SECRET_NAME.search(leaf) and leaf not in SECRET_ALLOWED
        if SECRET_VALUE.search(arg) or named:
            shown = SECRET_VALUE.sub("<secret>", bare if sep else "an argument")
            errors.append(
                f"{shown}: looks like a secret; refused, its value is not shown "
                f"({COMMAND_LINE_WRITTEN}); {IN_THE_ENVIRONMENT}"
            )
    return errors


def hydra_secret_errors(hydra: Any) -> list[str]:
    """The same for Hydra's own settings from config files (`hydra:` of an experiment or a
    `--config-dir` file): a token anywhere, or a secret-named `hydra.job.env_set` variable."""
    from pita.experiment.trl_values import SECRET_NAME

    errors = secret_errors(hydra, "hydra")
    env_set = ((hydra or {}).get("job") or {}).get("env_set") or {}
    for name in env_set:
        line = f"hydra.job.env_set.{name}: looks like a secret"
        if SECRET_NAME.search(str(name)) and not any(e.startswith(line) for e in errors):
            errors.append(
                f"{line}; refused, its value is not shown (Hydra writes it into .hydra/hydra.yaml); "
                f"{IN_THE_ENVIRONMENT}"
            )
    return errors


def path_secret_error(path: Path | str, what: str = "run folder") -> str | None:
    """A folder whose path holds a token (it is written into run_info.json, run.log, the
    journal and the duration history): refused, the token masked in the line."""
    from pita.experiment.trl_values import SECRET_VALUE

    text = str(Path(path).absolute())
    if not SECRET_VALUE.search(text):
        return None
    return (
        f"{what} {SECRET_VALUE.sub('<secret>', text)}: its path looks like it holds a secret "
        f"(pita writes the path into run_info.json, run.log and its caches); choose another folder"
    )


SEARCH_DIRS: list[Path] = []  # the config search path of the last composition (cli.py)


def set_search_dirs(dirs: list[Path]) -> None:
    """Where `interpolation_error` looks for the file that set a value (pita's conf/,
    --config-dir, hydra.searchpath), set by the command line when it composes."""
    SEARCH_DIRS[:] = [Path(d) for d in dirs]


def _where_set(raw: str, dirs: list[Path]) -> str:
    """`in <file>:<line>` of the first yaml line holding `raw`, else `on the command line`."""
    for folder in dirs:
        for f in sorted(folder.rglob("*.yaml")) if folder.is_dir() else []:
            for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
                if raw in line:
                    return f"in {f.relative_to(folder.parent)}:{n}"
    return "on the command line"


def interpolation_error(cfg: DictConfig, exc: Exception, conf_dir: Path | None) -> str:
    """`experiment.name='${oops}': cannot resolve (Interpolation key 'oops' not found); set
    in conf/experiment/x.yaml:3` - one line with the key and, when found, file and line
    (pita's conf/, then --config-dir and hydra.searchpath folders)."""
    key = str(getattr(exc, "full_key", "") or "")
    raw: Any = OmegaConf.to_container(cfg, resolve=False)
    for part in key.split(".") if key else []:
        raw = raw.get(part) if isinstance(raw, dict) else None
    where = "on the command line"
    if isinstance(raw, str):
        dirs = [*([conf_dir] if conf_dir is not None else []), *SEARCH_DIRS]
        where = _where_set(raw, dirs)
    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"{key or 'config'}={raw!r}: interpolation cannot be resolved ({detail}); set {where}"


def validate(cfg: DictConfig, *, project_root: Path | None = None) -> None:
    """Raise ConfigError listing every problem of a composed config: each value against its
    field's rule (pita/core/schema.py), then the rules that relate keys."""
    try:
        resolved = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as exc:  # ${oops}: one line, not a traceback
        raise ConfigError(
            interpolation_error(cfg, exc, project_root / "conf" if project_root else None)
        ) from None
    assert isinstance(resolved, dict)
    non_finite = non_finite_errors(resolved)
    if non_finite:  # the range checks below would compare NaN and pass
        raise ConfigError(non_finite)
    errors = [with_hint(e) for e in _schema_errors(resolved)]
    errors += secret_errors(resolved)
    try:
        validate_devices_spec(cfg.system.devices)
    except ConfigError as exc:
        errors.extend(exc.messages)
    ex = resolved["executor"]
    if ex["heartbeat_timeout_s"] <= ex["heartbeat_s"]:
        errors.append(
            f"executor.heartbeat_timeout_s={ex['heartbeat_timeout_s']!r}: "
            f"must exceed executor.heartbeat_s ({ex['heartbeat_s']})"
        )
    errors += stage_override_errors(ex.get("stage_overrides") or {})
    errors += logger_errors(cfg)
    errors += algo_errors(resolved.get("algos") or {})
    errors += trl_option_errors(resolved.get("algos") or {})
    if not any(a.get("enabled") for a in (resolved.get("algos") or {}).values()) and not errors:
        errors.append("algos: no algorithm enabled; set e.g. algos.QSharp.enabled=true")
    if cfg.resume_from is not None:
        errors += resume_path_errors(cfg.resume_from, project_root)

    from pita.datasets import validate_dataset_cfg
    from pita.experiment.dataset_choice import dataset_override_errors

    if not any(e.startswith("dataset.") for e in errors):
        errors += dataset_override_errors(cfg)
    if not any(e.startswith("dataset.") for e in errors):  # one line per bad key, and no
        try:  # task built from a size already refused; the task's own keys (pita/datasets)
            validate_dataset_cfg(dataset_keys(cfg.dataset))
        except ValueError as exc:
            errors.append(str(exc))
    if errors:
        raise ConfigError(errors)


def _schema_errors(resolved: dict) -> list[str]:
    """`schema_errors` of the whole config, the dataset against its own schema when it is a
    plugin that declares one (`pita.datasets.plugin_schemas`: keys DatasetConfig lacks)."""
    from pita.datasets import plugin_schemas

    dataset = resolved.get("dataset")
    name = dataset.get("name") if isinstance(dataset, dict) else None
    own = plugin_schemas().get(str(name)) if name else None
    if own is None or not isinstance(dataset, dict):
        return schema_errors(resolved, PitaConfig)
    rest = {k: v for k, v in resolved.items() if k != "dataset"}
    return schema_errors(rest, PitaConfig) + schema_errors(dataset, own, "dataset.")


def known_keys() -> list[str]:
    """Every dotted key of the schema, each algorithm's own keys under `algos.<NAME>.`."""
    keys = [k for k, _ in leaf_fields(PitaConfig) if k != "algos"]
    for name, row in ALGORITHMS.items():
        keys += [f"algos.{name}.{k}" for k, _ in leaf_fields(row.schema)]
    return keys


def did_you_mean(key: str) -> str:
    """`; did you mean algos.DPO.beta?` for a misspelt key (its nearest sibling first, then
    the nearest key anywhere: `trainig.compile` -> `training.compile`), else ''."""
    leaves = known_keys()
    keys = sorted({".".join(k.split(".")[:n]) for k in leaves for n in range(1, k.count(".") + 2)})
    parent, _, leaf = key.rpartition(".")
    siblings = [k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == parent]
    near = difflib.get_close_matches(leaf, [k for k in siblings if k != leaf], n=1, cutoff=0.7)
    if near:
        return f"; did you mean {parent + '.' if parent else ''}{near[0]}?"
    near = difflib.get_close_matches(key, [k for k in leaves if k != key], n=1, cutoff=0.8)
    return f"; did you mean {near[0]}?" if near else ""


def with_hint(line: str) -> str:
    """An `<key>: unknown key ...` line with its "did you mean" added; for a key of an
    installed algorithm that this config does not hold (a plugin's, which only an experiment
    adds: a key of its schema that Hydra cannot override), how to add it instead."""
    key, sep, rest = line.partition(": ")
    if not (sep and rest == UNKNOWN_KEY):
        return line
    parts = key.split(".")
    row = ALGORITHMS.get(parts[1]) if len(parts) > 2 and parts[0] == "algos" else None
    if row is not None and parts[2] in {f.name for f in dataclasses.fields(row.schema)}:
        return (
            f"{key}: algorithm {parts[1]} is installed but not in this config; add it to your "
            f"experiment's defaults (`- /algo@algos.{parts[1]}: <its conf/algo file>`, "
            f"docs/extending.md)"
        )
    return f"{line}{did_you_mean(key)}"


def stage_override_errors(overrides: dict) -> list[str]:
    """executor.stage_overrides.<ALGO>.<stage>: a known algorithm, a 'module:function'."""
    errors = []
    for algo, stages in overrides.items():
        if algo not in ALGO_NAMES and algo != ANY:
            errors.append(
                f"executor.stage_overrides.{algo}={algo!r}: "
                f"an algorithm name ({', '.join(ALGO_NAMES)}) or 'any'"
            )
        for stage, target in stages.items():
            if ":" not in str(target):
                errors.append(
                    f"executor.stage_overrides.{algo}.{stage}={target!r}: "
                    "a 'module.path:function' string"
                )
    return errors


def algo_errors(algos: dict) -> list[str]:
    """algos.<NAME>: a row of the algorithm table, with only its own schema's keys (its
    values checked when it is enabled), and what relates its keys."""
    errors = []
    for name, algo in algos.items():
        if name not in ALGORITHMS and dict(algo) == {"enabled": False}:
            continue  # what `algos=[...]` writes for a plugin the config lacks: the run
            # resumes after the plugin is uninstalled (pita/experiment/cli_extras.py)
        if name not in ALGORITHMS:
            from pita.core.plugins import failure_hint

            errors.append(
                f"algos.{name}: unknown algorithm; allowed: {', '.join(ALGO_NAMES)}{failure_hint()}"
            )
            continue
        enabled = bool(algo.get("enabled"))
        errors += [
            with_hint(e)
            for e in schema_errors(algo, ALGORITHMS[name].schema, f"algos.{name}.", values=enabled)
        ]
        if not enabled:
            continue
        if "V_min" in algo and "V_max" in algo and not algo["V_min"] < algo["V_max"]:
            errors.append(
                f"algos.{name}.V_min={algo['V_min']!r}: "
                f"must be < algos.{name}.V_max ({algo['V_max']})"
            )
        if algo.get("value_head") == "v" and algo.get("loss_type") == "bradley_terry":
            errors.append(
                f"algos.{name}.value_head='v': v cannot train loss_type=bradley_terry "
                "(it scores one token per forward): use q"
            )
    return errors


def logger_errors(cfg: DictConfig) -> list[str]:
    """logger=<backend>: its package is installed (the schema checks the backend's name)."""
    from pita.training.tracking import missing_package

    lg = cfg.get("logger")
    if lg is None or lg.backend not in LOGGER_BACKENDS:
        return []
    need = missing_package(str(lg.backend))
    if need:
        return [f"logger={lg.backend}: the {lg.backend} package is not installed; {need}"]
    return []


def drop_retired_algo_keys(saved: DictConfig) -> DictConfig:
    """A run folder saved before each algorithm had its own schema carries every algorithm's
    keys under each `algos.<NAME>`; keep the ones its schema has (no stage read the others),
    so that run still resumes."""
    from omegaconf import open_dict

    with open_dict(saved):
        for name, algo in (saved.get("algos") or {}).items():
            if name in ALGORITHMS and isinstance(algo, DictConfig):
                keys = {f.name for f in dataclasses.fields(ALGORITHMS[name].schema)}
                for key in [k for k in algo if k not in keys]:
                    del algo[key]
    return saved


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
