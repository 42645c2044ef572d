"""Command line of run_parallel.py: check the config before Hydra starts, then run.

Hydra creates the run folder (and interpolates `experiment.name` into its path) before
our code sees the config, and reports composition errors with exit code 1. So the
command line is first composed here with Hydra's compose API: any unknown key, bad type,
bad group option or invalid value becomes one line naming the key and what is allowed,
with exit code 2, before a folder or a process exists. Then `@hydra.main` runs as usual
(sweeps, launchers and `.hydra/` included), except for a single local run whose composition
is already Hydra's: Hydra's `run_job` runs it on that config (`_hydra_main`).

`resume_from=<run dir>` bypasses composition: the run's saved config is reused, any key
may be overridden (the tasks it touches run again, the rest is kept:
pita/experiment/resume_fix.py), and the run continues in its own folder.
`resume_from=auto` resumes the newest run of `experiment.name` if it did not finish (a
SLURM requeue finishes its run), else starts a new one; so does rerunning into an existing
run folder (`hydra.run.dir=<run dir>`).

Hydra's own flags keep working because the command line is parsed with Hydra's parser:
`-cn NAME` / `--config-dir DIR` / `hydra.searchpath=[...]` (your experiment files outside
the repo) are composed the same way in the pre-check, `-sc install=bash` and `--cfg`,
`--info`, `--hydra-help` start nothing, `--help` lists pita's keys with their help.
With a non-local launcher (`hydra/launcher=submitit_slurm|slurm|...`) the pre-check
checks values only: devices and placement are checked in the job, on its node.
"""

from __future__ import annotations

import copy
import difflib
import json
import logging
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from pita.core.errors import ConfigError
from pita.core.paths import RunPaths
from pita.core.schema import resume_safe
from pita.experiment.cli_extras import (
    PROJECT_ROOT,
    conf_dir,
    config_differences,
    expand_algos,
    find_resumable,
    help_text,
)
from pita.experiment.config import (
    register_configs,
    resume_path_errors,
    set_search_dirs,
    validate,
)

CONF_DIR = conf_dir()
LOCAL_LAUNCHERS = ("BasicLauncher",)  # Hydra's launcher classes that run jobs in this process
LAST_COMPOSE: dict[str, str] = {}
# Hydra's job name for `@hydra.main` in this module (hydra._internal.utils.detect_task_name)
JOB_NAME = __name__.rsplit(".", 1)[-1]
T = TypeVar("T")
HELD_LOCKS: list[Any] = []  # run folder locks taken before Hydra or run() write anything
EXIT_CODE_FILE = "exit_code"  # a remote job's exit code, read by the sweep's end (aggregate.py)


def _first_line(text: object) -> str:
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    return lines[0] if lines else ""


def format_compose_error(exc: BaseException, overrides: list[str]) -> str:
    """Hydra/OmegaConf composition errors -> one line naming the key and what is allowed."""
    text = str(exc)
    yaml_error = _yaml_error(exc)
    if yaml_error:
        return yaml_error
    m = re.search(r"In '([^']+)': \w+ raised while composing config", text)
    cause = exc.__cause__ or exc.__context__
    full_key = getattr(cause, "full_key", None)
    if m and full_key:  # a bad key or value inside a config file
        from pita.experiment.config import did_you_mean

        hint = did_you_mean(str(full_key)) if type(cause).__name__ == "ConfigKeyError" else ""
        return f"conf/{m.group(1)}.yaml: {full_key}: {_first_line(cause)}{hint}"
    odd = next((o for o in overrides if not o.isascii()), None)
    if odd is not None and ("LexerNoViableAlt" in text or "token recognition error" in text):
        key, _, value = odd.partition("=")
        if not key.isascii():
            return f"{key}: keys are ASCII names (see conf/ and pita/core/schema.py)"
        return (
            f"{odd}: not a valid override: a value with non-ASCII characters must be quoted, e.g. "
            f"'{key}=\"{value}\"'"
        )
    m = re.search(r"Could not override '([^']+)'", text)
    if m:
        from pita.core.schema import UNKNOWN_KEY
        from pita.experiment.config import with_hint

        return with_hint(f"{m.group(1)}: {UNKNOWN_KEY}")
    m = re.search(r"Could not find '(hydra/launcher)/([^']+)'", text)
    if m:
        have = sorted(p.stem for p in (CONF_DIR / "hydra" / "launcher").glob("*.yaml"))
        return (
            f"hydra/launcher={m.group(2)}: no such launcher; available: basic, {', '.join(have)}, "
            "submitit_local, submitit_slurm (the submitit ones need: pip install hydra-submitit-launcher)"
        )
    m = re.search(r"Could not find '([^/']+)/([^']+)'", text)
    if m:
        group, name = m.group(1), m.group(2)
        options = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
        near = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
        hint = f"; did you mean {group}={near[0]}?" if near else ""
        return f"{group}={name}: no such {group} config; available: {', '.join(options)}{hint}"
    m = re.search(r"Error merging override (\S+)", text)
    if m:
        cause = exc.__cause__ or exc.__context__
        detail = _first_line(cause) if cause else _first_line(text)
        return f"{m.group(1)}: {detail}"
    if "mismatched input" in text or "extraneous input" in text or "no viable alternative" in text:
        return (
            f"{_unparsable(overrides)}: not a valid override (write key=value; quote values with brackets or "
            f"commas, e.g. 'system.devices=\"fake:[80GB,40GB]\"')"
        )
    cause = exc.__cause__
    full_key = getattr(cause, "full_key", None) if cause else None
    if full_key:
        return f"{full_key}: {_first_line(cause)}"
    return _first_line(text) or type(exc).__name__


def _yaml_error(exc: BaseException | None) -> str | None:
    """`conf/experiment/x.yaml:3:9: expected ',' or ']', but got ':'` for a YAML syntax
    error anywhere in the cause chain (Hydra's own message names neither file nor line)."""
    import yaml

    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, yaml.MarkedYAMLError):
            mark = exc.problem_mark or exc.context_mark
            where = "YAML"
            if mark is not None:
                name = Path(str(mark.name))
                try:
                    name = name.relative_to(CONF_DIR.parent)
                except ValueError:
                    pass
                where = f"{name}:{mark.line + 1}:{mark.column + 1}"
            label = "YAML" if isinstance(exc, yaml.constructor.ConstructorError) else "YAML syntax"
            return f"{where}: {label} error: {exc.problem or exc.context}"
        exc = exc.__cause__ or exc.__context__
    return None


def _unparsable(overrides: list[str]) -> str:
    """The first override Hydra's grammar rejects (its error names the whole list)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for o in overrides:
        try:
            parser.parse_overrides([o])
        except Exception:
            return o
    return " ".join(overrides)


def _sweep_to_single(overrides: list[str]) -> list[str]:
    """For validation, a sweep `k=a,b` is checked with its first value."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    out = []
    for raw, o in zip(overrides, parsed):
        if o.is_sweep_override():
            first = next(iter(o.sweep_string_iterator()))
            out.append(f"{o.get_key_element()}={first}")
        else:
            out.append(raw)
    return out


def _without_hydra_keys(overrides: list[str]) -> list[str]:
    """The overrides the pre-check composes: Hydra's own keys left out, its search path kept."""
    return [
        o
        for o in overrides
        if not o.startswith(("hydra.", "+hydra.", "~hydra.")) or o.startswith("hydra.searchpath=")
    ]


def compose_config(
    overrides: list[str],
    config_name: str | None = None,
    config_dir: str | None = None,
    *,
    keep_hydra: bool = False,
) -> DictConfig:
    """Compose the config (pita's conf/ + `--config-dir` + `hydra.searchpath`) with overrides,
    without a run folder, as `@hydra.main` will; raises ConfigError. `keep_hydra`: with
    Hydra's own node (`hydra.*`), for `_hydra_main` to run the job without composing again."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    overrides = _without_hydra_keys(overrides)
    try:
        overrides = _sweep_to_single(overrides)
    except Exception as exc:
        raise ConfigError(format_compose_error(exc, overrides)) from None
    if config_dir and not Path(config_dir).expanduser().is_dir():
        raise ConfigError(f"--config-dir {config_dir}: no such folder")
    GlobalHydra.instance().clear()
    search_path = create_config_search_path(str(CONF_DIR))
    if config_dir:  # what Hydra does for --config-dir
        search_path.prepend("command-line", f"file://{Path(config_dir).expanduser().resolve()}")
    try:
        hydra = Hydra.create_main_hydra2(task_name=JOB_NAME, config_search_path=search_path)
        cfg = hydra.compose_config(
            config_name or "config", overrides, run_mode=RunMode.RUN, with_log_configuration=False
        )
        LAST_COMPOSE["launcher"] = str(
            OmegaConf.select(cfg, "hydra.launcher._target_", default="") or ""
        )
        try:  # where Hydra will put the run (locked before Hydra writes there)
            run_dir = OmegaConf.select(cfg, "hydra.run.dir", default="")
        except Exception:  # an interpolation error: validate() reports it, with its file
            run_dir = ""
        LAST_COMPOSE["run_dir"] = str(run_dir or "")
        _refuse_hydra_secrets(cfg)
        set_search_dirs(  # where an interpolation error's file is looked for
            [CONF_DIR, *([Path(config_dir).expanduser()] if config_dir else [])]
            + [Path(str(p).removeprefix("file://")) for p in cfg.hydra.get("searchpath", [])]
        )
        from pita.experiment.dataset_choice import record_dataset_file

        record_dataset_file(cfg, OmegaConf.select(cfg, "hydra.runtime.choices"))
        if not keep_hydra:  # as hydra.compose(return_hydra_config=False)
            _drop_hydra_node(cfg)
        return cfg
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(format_compose_error(exc, overrides)) from None
    finally:
        GlobalHydra.instance().clear()


def _drop_hydra_node(cfg: DictConfig) -> None:
    """`cfg` without Hydra's own node: what a job's task function gets."""
    if "hydra" in cfg:
        with read_write(cfg), open_dict(cfg):
            del cfg["hydra"]


def _refuse_hydra_secrets(cfg: DictConfig) -> None:
    """Hydra's own settings from config files, and the run folder they resolve to, hold no
    secret: Hydra writes them into `.hydra/` (ConfigError). `hydra.runtime` is Hydra's record
    of this process (its folder, the command line's config folders): checked as the run
    folder's path and the command line."""
    from pita.experiment.config import hydra_secret_errors, path_secret_error

    settings = OmegaConf.to_container(cfg.hydra, resolve=False)
    assert isinstance(settings, dict)  # Hydra's node is a mapping
    settings.pop("runtime", None)
    errors = hydra_secret_errors(settings)
    try:
        folder = OmegaConf.select(cfg, "hydra.run.dir", default="")
    except Exception:  # an interpolation error: validate() reports it, with its file
        folder = ""
    line = path_secret_error(folder) if folder else None
    if line or errors:
        raise ConfigError([*errors, *([line] if line else [])])


def load_saved_config(path: Path) -> Any:
    """A run's saved `.hydra/config.yaml`, read as a control file (no symlink, yours, at most
    16 MB: pita/core/safe_files.py)."""
    from pita.core.safe_files import read_control_text

    return OmegaConf.create(read_control_text(path))


def load_resume_config(resume_dir: str, overrides: list[str]) -> tuple[DictConfig, Path]:
    """The saved config of `resume_dir` with only run-safe overrides applied."""
    errors = resume_path_errors(resume_dir, PROJECT_ROOT)
    if errors:
        raise ConfigError(errors)
    run_dir = Path(resume_dir).expanduser()
    if not run_dir.exists():
        run_dir = PROJECT_ROOT / resume_dir
    run_dir = run_dir.absolute()  # workers run from pita's folder: a relative one means another
    from pita.core.safe_files import share_with_group

    # a teammate's saved config is read only when this command line trusts the group
    share_with_group(any(o.lstrip("+").lower() == "system.trust_group=true" for o in overrides))
    try:
        saved = load_saved_config(RunPaths(run_dir).saved_config)
    except Exception as exc:
        raise ConfigError(
            f"resume_from={resume_dir!r}: saved config unreadable ({_first_line(exc)})"
        ) from None
    from pita.experiment.config import PitaConfig, drop_retired_algo_keys

    if not isinstance(saved, DictConfig):
        raise ConfigError(f"resume_from={resume_dir!r}: saved config is not a mapping")
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(PitaConfig), drop_retired_algo_keys(saved))
    except Exception as exc:  # a hand-edited value of the wrong type: one line, not a traceback
        key = getattr(exc, "full_key", "") or "?"
        raise ConfigError(
            f"resume_from={resume_dir!r}: saved config {RunPaths(run_dir).saved_config}: "
            f"{key}: {_first_line(exc)}"
        ) from None
    assert isinstance(cfg, DictConfig)
    cfg = apply_resume_overrides(cfg, overrides)
    from pita.experiment.strategy import keep_run_strategy

    keep_run_strategy(cfg, saved)  # `training.parallel_strategy=auto`: what the run resolved
    cfg.resume_from = str(run_dir)
    return cfg, run_dir


def apply_resume_overrides(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """A resume's `key=value` overrides onto the saved config. Any key may change (the
    tasks it touches run again: pita/experiment/resume_fix.py); a config group
    (`dataset=gsm8k`) selects another experiment and Hydra's own keys fix the run folder,
    so both are refused with one line."""
    from pita.core.schema import UNKNOWN_KEY
    from pita.experiment.config import with_hint

    for o in overrides:
        key, _, value = o.partition("=")
        bare = key.lstrip("+~")
        if bare == "resume_from":
            continue
        if bare.startswith("hydra") or "/" in bare or (CONF_DIR / bare).is_dir():
            raise ConfigError(
                f"{o}: a config group or Hydra setting cannot change on resume (it describes "
                f"another run); set its keys one by one (e.g. {bare.split('/')[0]}.<key>=...), "
                f"or start a new run"
            )
        if key.startswith("~"):
            raise ConfigError(f"{o}: a key cannot be removed on resume; set it to another value")
        dot = OmegaConf.from_dotlist([f"{bare}={value}"])
        try:
            merged = OmegaConf.merge(cfg, dot)
        except Exception as exc:
            if type(exc).__name__ == "ConfigKeyError":
                raise ConfigError(with_hint(f"{bare}: {UNKNOWN_KEY}")) from None
            merged = _update_typed(cfg, bare, dot, f"{o}: {_first_line(exc)}")
        assert isinstance(merged, DictConfig)  # a mapping merged into a mapping
        cfg = merged
    return cfg


def _update_typed(cfg: DictConfig, key: str, dot: DictConfig, why: str) -> DictConfig:
    """A copy of `cfg` with `key` set to its value in `dot` by `OmegaConf.update`: merging a
    dotlist into a typed dict of a saved config (`executor.stage_overrides`, Dict[str, Dict[
    str, str]]) fails in OmegaConf ("Value 'AnyNode' is not a supported primitive type"),
    so a resume could not state such a key again. ConfigError(`why`) when that fails too."""
    from omegaconf import ListConfig

    leaf = OmegaConf.select(dot, key)
    value = OmegaConf.to_container(leaf) if isinstance(leaf, (DictConfig, ListConfig)) else leaf
    out = copy.deepcopy(cfg)
    try:
        OmegaConf.update(out, key, value, merge=True)
    except Exception:
        raise ConfigError(why) from None
    return out


def preflight(
    cfg: DictConfig,
    overrides: list[str] | None = None,
    *,
    run_dir: Path | None = None,
    devices: bool = True,
) -> None:
    """Everything that can be checked before a folder or a process exists: values, the
    devices (NVML only, no CUDA context), the plan (e.g. a task no device can hold) and the
    world (pita/experiment/preflight.py: dataset files, families, hub cache, output folder).
    `run_dir`: a resumed run's folder (its plan is reused, so none is built here).
    `devices=False` (jobs that run elsewhere, e.g. on SLURM nodes): values only; each job
    checks devices, placement and its node's files itself (`run` does)."""
    from pita.experiment.preflight import absolutize_paths, environment_errors, planned_run_dir
    from pita.experiment.run import build_plan, check_plan_fits, make_gpu_manager

    absolutize_paths(cfg)
    validate(cfg, project_root=PROJECT_ROOT)
    from pita.core.paths import path_length_errors

    folder = run_dir or _planned_folder(cfg, overrides or [])
    _check_run_folder(folder)
    from pita.experiment.preflight import check_launcher  # SLURM without sbatch: exit 2 now

    check_launcher(remote_launcher(), overrides)
    if not devices:
        return
    gpu = make_gpu_manager(cfg)
    if run_dir is None:
        too_long = path_length_errors(folder, build_plan(cfg, gpu).tasks)
        if too_long:
            raise ConfigError(too_long)
    else:
        from pita.core.dag import Plan

        try:
            plan = Plan.load(RunPaths(run_dir).plan)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(
                f"resume_from={str(run_dir)!r}: plan.json is unreadable ({_first_line(exc)}); "
                f"start the run afresh"
            ) from None
        check_plan_fits(plan, gpu, cfg)
    errors = environment_errors(
        cfg,
        gpu.kind,
        output_dir=run_dir if run_dir is not None else planned_run_dir(cfg, overrides or []),
    )
    if errors:
        raise ConfigError(errors)


def _planned_folder(cfg: DictConfig, overrides: list[str]) -> Path:
    """Where a new run will be: a typed `hydra.run.dir` (the composition leaves Hydra's keys
    out), else the composed one, resolved."""
    from pita.experiment.preflight import planned_run_dir

    if any(o.startswith("hydra.run.dir=") for o in overrides):
        return planned_run_dir(cfg, overrides)
    return Path(LAST_COMPOSE.get("run_dir") or planned_run_dir(cfg, []))


def _check_run_folder(folder: Path) -> None:
    """The run folder's path holds no secret (pita writes it into run_info.json, run.log and
    its caches) and fits its file system's name and path limits (ConfigError)."""
    from pita.core.paths import path_length_errors
    from pita.experiment.config import path_secret_error

    secret = path_secret_error(folder)
    errors = [secret] if secret else path_length_errors(folder)
    if errors:
        raise ConfigError(errors)


def remote_launcher() -> str | None:
    """The launcher of the last composed config when it runs the jobs elsewhere (SLURM,
    submitit; set by `hydra/launcher=X` or by an experiment's defaults), else None."""
    target = LAST_COMPOSE.get("launcher", "")
    return None if not target or target.endswith(LOCAL_LAUNCHERS) else target


def _print_config_error(exc: ConfigError) -> None:
    for line in exc.messages:
        print(f"error: {line}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    """The command line: --help, a resume (typed, `resume_from=auto`, or a rerun into an
    existing run folder), or a new run or sweep handed to Hydra. Every refusal of the
    command line is one line and exit 2, before any process starts."""
    from hydra._internal.utils import get_args_parser

    argv = list(sys.argv[1:] if argv is None else argv)
    # as typed, for run_info.json: set before any branch (a resume too), so no path records
    # a command this process inherited from the one that started it
    os.environ["PITA_COMMAND"] = json.dumps([sys.argv[0], *argv])
    args = get_args_parser().parse_args(argv)  # Hydra's own parser: -cn NAME, -sc install=bash, ...
    if args.help:
        _print_help(args)
        sys.exit(0)
    _exit_2_on_config_error(lambda: _check_arguments(argv))
    overrides = _exit_2_on_config_error(lambda: _expanded_algos(args))
    info_only = bool(args.hydra_help or args.cfg or args.info or args.shell_completion)
    cfg: DictConfig | None = None  # Hydra's --info / --cfg / completion need no run config
    composed: DictConfig | None = None
    if not info_only:
        resume, implicit, overrides = _which_run(overrides, args)
        if resume is not None:
            sys.exit(_resume(resume, implicit, overrides, args))
        cfg, composed = _exit_2_on_config_error(lambda: _new_run_config(overrides, args))
    folder: str | None = None  # where a single local run was locked and pinned
    if cfg is not None and not args.multirun and remote_launcher() is None:
        overrides, folder = _lock_before_hydra(cfg, overrides)
    given = set(args.overrides)
    sys.argv = [sys.argv[0], *[a for a in argv if a not in given], *overrides]  # Hydra reads it
    job = None  # the composition Hydra's run_job takes as it is
    if composed is not None and folder is not None and _composed_as_hydra(args):
        job = _pinned(composed, folder)
    _hydra_main(job)


def _print_help(args: Any) -> None:
    try:
        name = Path(sys.argv[0]).name if sys.argv else "pita"
        prog = "-m pita" if name == "__main__.py" else name
        print(help_text(prog, _composed_for_help(list(args.overrides), args)))
    except BrokenPipeError:  # `--help | head`
        pass


def _exit_2_on_config_error(fn: Callable[[], T]) -> T:
    try:
        return fn()
    except ConfigError as exc:
        _print_config_error(exc)
        sys.exit(2)


FOLDER_KEYS = ("hydra.run.dir", "hydra.sweep.dir", "resume_from")  # run folders, as typed


def _check_arguments(argv: list[str]) -> None:
    """No argument holds a secret (pita/experiment/config.py), before anything composes,
    prints or writes the command line; no run folder typed is too long a name or path for
    its file system (pita/core/paths.py), before anything stats it (ENAMETOOLONG)."""
    from pita.core.paths import path_length_errors
    from pita.experiment.config import command_line_secret_errors

    errors = command_line_secret_errors(argv)
    for arg in argv if not errors else []:
        key, sep, value = arg.partition("=")
        if sep and key.lstrip("+") in FOLDER_KEYS and value not in ("", "auto", "null"):
            errors += path_length_errors(value.strip("'\""))
    if errors:
        raise ConfigError(errors)


def _expanded_algos(args: Any) -> list[str]:
    from pita.algos.registry import BUILTIN_NAMES
    from pita.experiment.config import ALGO_NAMES

    return expand_algos(list(args.overrides), ALGO_NAMES, BUILTIN_NAMES)


def _which_run(overrides: list[str], args: Any) -> tuple[str | None, bool, list[str]]:
    """(the run folder to resume or None, whether the resume is implicit, the overrides
    left): a typed `resume_from=<run>`; `resume_from=auto` (the newest unfinished run of the
    experiment, else a new run); or `hydra.run.dir=<a run folder with a plan>` (rerunning
    into a run folder finishes that run). An implicit resume must describe the same run."""
    resume = next((o.split("=", 1)[1] for o in overrides if o.startswith("resume_from=")), None)
    implicit = False
    if resume == "auto":
        resume, overrides = _resolve_auto_resume(overrides, args)
        implicit = resume is not None
    run_dir = next((o.split("=", 1)[1] for o in overrides if o.startswith("hydra.run.dir=")), None)
    if resume in (None, "", "null") and run_dir and not args.multirun:
        if RunPaths(run_dir).plan.is_file():
            resume, implicit = run_dir, True
            overrides = [o for o in overrides if not o.startswith("hydra.run.dir=")]
    return (None if resume in (None, "", "null") else resume), implicit, overrides


def _resume(resume: str, implicit: bool, overrides: list[str], args: Any) -> int:
    """Resume `resume` (its saved config with the run-safe overrides), under its lock; a
    dry run touches no file of the run. The exit code."""
    from pita.experiment.run import lock_run_folder, run

    def resumed_config() -> tuple[DictConfig, Path]:
        rest = [o for o in overrides if not o.startswith("resume_from=")]
        if implicit:  # the same command line again (a requeue): it must describe the same run
            rest = _same_run_overrides(resume, rest, args)
        cfg, run_dir = load_resume_config(resume, rest)
        preflight(cfg, run_dir=run_dir)
        from pita.experiment.code_keys import foreign_code_errors, stated_keys

        foreign = foreign_code_errors(cfg, run_dir, stated_keys(rest))  # a teammate's code
        if foreign:
            raise ConfigError(foreign)
        return cfg, run_dir

    cfg, run_dir = _exit_2_on_config_error(resumed_config)
    if cfg.dry_run:
        _setup_console_logging()
        return _run_checked(lambda: run(cfg, run_dir, resumed=True))
    lock = _run_checked(lambda: lock_run_folder(cfg, run_dir, share=True))
    if isinstance(lock, int):
        return lock
    HELD_LOCKS.append(lock)
    _setup_console_logging(run_dir)
    return _run_checked(lambda: run(cfg, run_dir, resumed=True))


def _new_run_config(overrides: list[str], args: Any) -> tuple[DictConfig, DictConfig]:
    """The composed, checked config of a new run (devices checked here unless a remote
    launcher's job will check them where it runs), and the same composition with Hydra's
    node, as the checks found it (they make paths absolute, which `run` does itself)."""
    composed = compose_config(overrides, args.config_name, args.config_dir, keep_hydra=True)
    cfg = copy.deepcopy(composed)
    _drop_hydra_node(cfg)
    preflight(cfg, overrides, devices=remote_launcher() is None)
    return cfg, composed


def _composed_as_hydra(args: Any) -> bool:
    """Whether the pre-check's composition is the one `@hydra.main` would make: no Hydra
    key typed but the run folder (the pre-check leaves them out), no sweep (it takes each
    sweep's first value), no `--config-path` (it reads pita's conf/ and `--config-dir`)."""
    typed = [o for o in args.overrides if not o.startswith("hydra.run.dir=")]  # pinned anyway
    return (
        args.config_path is None
        and _without_hydra_keys(typed) == typed
        and _sweep_to_single(typed) == typed
    )


def _pin(folder: str) -> str:
    """The override that pins Hydra's run folder to `folder` (locked by `_lock_before_hydra`)."""
    return f"hydra.run.dir='{folder}'"


def _pinned(composed: DictConfig, folder: str) -> DictConfig | None:
    """`composed` run in `folder`, as `@hydra.main` would compose it with `_pin(folder)`;
    None where an experiment asks for `hydra.mode: MULTIRUN` (Hydra's path then)."""
    if composed.hydra.get("mode") not in (None, RunMode.RUN):
        return None
    with read_write(composed.hydra):
        composed.hydra.run.dir = folder
        composed.hydra.overrides.hydra.append(_pin(folder))
        if composed.hydra.get("mode") is None:  # what Hydra's _run_app adds then
            composed.hydra.overrides.hydra.append("hydra.mode=RUN")
        composed.hydra.mode = RunMode.RUN
    return composed


def _lock_before_hydra(cfg: DictConfig, overrides: list[str]) -> tuple[list[str], str | None]:
    """A single local run: Hydra writes `.hydra/` into the run folder before `run()` starts,
    so the folder is checked and locked here first (a refused second orchestrator changes
    nothing), and `hydra.run.dir` is pinned to the folder locked: (the overrides with the
    pin, the folder; None when it is left to Hydra). A dry run never reaches Hydra: it
    prints the plan here and creates no folder."""
    from pita.experiment.run import lock_run_folder, run

    given = next((o.split("=", 1)[1] for o in overrides if o.startswith("hydra.run.dir=")), None)
    run_dir = given.strip("'\"") if given is not None else LAST_COMPOSE.get("run_dir") or ""
    if cfg.dry_run:
        _setup_console_logging()
        sys.exit(_run_checked(lambda: run(cfg, Path(run_dir or "outputs/dry_run"))))
    if not run_dir or "'" in run_dir or "${" in run_dir:
        return overrides, None  # an interpolated folder: Hydra resolves it, run() locks it
    lock = _run_checked(lambda: lock_run_folder(cfg, Path(run_dir), share=True))
    if isinstance(lock, int):
        sys.exit(lock)
    HELD_LOCKS.append(lock)  # held until this process exits (the kernel drops it then)
    rest = [o for o in overrides if not o.startswith("hydra.run.dir=")]
    return [*rest, _pin(run_dir)], run_dir


def _composed_for_help(overrides: list[str], args: Any) -> dict | None:
    """The config the command line would run (for `--help`'s defaults; without the
    overrides when they do not compose), or None."""
    from pita.algos.registry import BUILTIN_NAMES
    from pita.experiment.config import ALGO_NAMES

    for attempt in (overrides, []):
        try:
            cfg = compose_config(
                expand_algos(attempt, ALGO_NAMES, BUILTIN_NAMES), args.config_name, args.config_dir
            )
            resolved = OmegaConf.to_container(cfg, resolve=True)
        except Exception:  # noqa: BLE001 - a bad command line still gets its --help
            continue
        return resolved if isinstance(resolved, dict) else None
    return None


def _same_run_overrides(run_dir: str, overrides: list[str], args) -> list[str]:
    """The run-safe part of `overrides`, after checking that the whole command line composes
    to the config `run_dir` was started with (else a ConfigError naming the differences)."""
    composed = compose_config(overrides, args.config_name, args.config_dir)
    from pita.experiment.config import drop_retired_algo_keys
    from pita.experiment.preflight import absolutize_paths

    absolutize_paths(composed)  # the saved config holds them absolute (run() wrote it so)

    loaded = load_saved_config(RunPaths(run_dir).saved_config)
    assert isinstance(loaded, DictConfig)  # a run's saved config is a mapping
    saved = drop_retired_algo_keys(loaded)
    from pita.experiment.strategy import keep_run_strategy

    keep_run_strategy(composed, saved)  # the default `auto` is what the run resolved it to
    diff = config_differences(saved, composed, resume_safe)
    if diff:
        raise ConfigError(
            f"resume of {run_dir}: this command line describes another run ("
            f"{'; '.join(diff[:4])}{' ...' if len(diff) > 4 else ''}); pass resume_from={run_dir} "
            f"alone to finish it as it was, resume_from={run_dir} <key>=<value> to finish it with "
            f"other values (the tasks they touch run again), or change experiment.name for a new run"
        )
    return [o for o in overrides if resume_safe(o.split("=", 1)[0].lstrip("+~"))]


def _resolve_auto_resume(overrides: list[str], args) -> tuple[str | None, list[str]]:
    """resume_from=auto -> (the run folder to resume, overrides) or (None, overrides without it)."""
    rest = [o for o in overrides if not o.startswith("resume_from=")]
    try:
        name = str(compose_config(rest, args.config_name, args.config_dir).experiment.name)
    except ConfigError as exc:
        _print_config_error(exc)
        sys.exit(2)
    found = find_resumable(Path.cwd() / "outputs", name)
    if found is not None:
        print(f"resume_from=auto: resuming the unfinished run {found}")
        return str(found), rest
    print(f"resume_from=auto: no unfinished run of {name!r} in outputs/{name}/; starting a new one")
    return None, rest


def _run_checked(fn) -> int:
    try:
        return fn()
    except ConfigError as exc:  # e.g. a device index that does not exist, a task too large
        _print_config_error(exc)
        return 2
    except KeyboardInterrupt:
        return 130


def _setup_console_logging(run_dir: Path | None = None) -> None:
    """Short lines on the console, and `run.log` of `run_dir` appended when one is given
    (a resume; a dry run writes no file). Hydra's job logging does the same for new runs."""
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    console = logging.StreamHandler(sys.stdout)
    console.setFormatter(logging.Formatter("%(message)s"))
    root.handlers[:] = [console]
    if run_dir is not None:
        from pita.core.paths import writable_log

        file = logging.FileHandler(writable_log(RunPaths(run_dir).run_log), mode="a")
        file.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] %(message)s"))
        root.handlers.append(file)


def _hydra_main(composed: DictConfig | None = None) -> None:
    """Hydra runs the job(s): `@hydra.main` (sweeps, launchers), or, for a single local run
    whose config the pre-check composed as Hydra would (`composed`), Hydra's `run_job` on
    that config. `@hydra.main` composes the command line twice more (once to read
    `hydra.mode`, once to run), 0.3 s of CPU each on a 2-core machine: a third of what a
    run's command line costs before its first task (docs/DESIGN.md §8)."""
    import hydra

    worst = [0]  # a sweep exits with its worst job's code
    if composed is not None:
        _run_job(composed, lambda cfg: _job(cfg, worst))
        return
    register_configs()

    @hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
    def _main(cfg: DictConfig) -> int:
        return _job(cfg, worst)

    _main()
    from pita.results.aggregate import LAST_SWEEP

    sys.exit(max(worst[0], LAST_SWEEP.get("worst_exit_code", 0)))


def _job(cfg: DictConfig, worst: list[int]) -> int:
    """One Hydra job: pita's run in Hydra's output folder. Its exit code, or exit with it."""
    from hydra.core.hydra_config import HydraConfig

    from pita.experiment.run import run

    hc = HydraConfig.get()
    out = Path(hc.runtime.output_dir)
    code = _run_checked(lambda: run(cfg, out))
    remote = "BasicLauncher" not in str(hc.launcher.get("_target_", "BasicLauncher"))
    if remote:  # the job ran elsewhere (SLURM, submitit): its code reaches us through a file
        from pita.core.paths import atomic_write_text

        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / EXIT_CODE_FILE, f"{code}\n")
        return code  # sys.exit here would lose the job's result in the launcher
    if hc.mode != RunMode.MULTIRUN or code in (2, 130):
        sys.exit(code)
    worst[0] = max(worst[0], code)
    return code


def _run_job(composed: DictConfig, task: Callable[[DictConfig], int]) -> None:
    """What Hydra's `Hydra.run` does after it composes: its logging, the run callbacks,
    `run_job` (`.hydra/`, the job's logging, the task) and its report of a failed job."""
    from hydra._internal.callbacks import Callbacks
    from hydra._internal.utils import run_and_report
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.utils import JobRuntime, configure_log, run_job
    from hydra.types import HydraContext

    def run() -> None:
        JobRuntime.instance().set("name", JOB_NAME)
        configure_log(composed.hydra.hydra_logging, composed.hydra.verbose)
        callbacks = Callbacks(composed)
        callbacks.on_run_start(config=composed, config_name="config")
        ret = run_job(
            hydra_context=HydraContext(config_loader=None, callbacks=callbacks),  # type: ignore[arg-type]
            task_function=task,
            config=composed,
            job_dir_key="hydra.run.dir",
            job_subdir_key=None,
        )
        callbacks.on_run_end(config=composed, config_name="config", job_return=ret)
        _ = ret.return_value  # raises the job's exception, as Hydra.run does

    try:
        run_and_report(run)
    finally:
        GlobalHydra.instance().clear()
