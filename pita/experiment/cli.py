"""Command line of run_parallel.py: check the config before Hydra starts, then run.

Hydra creates the run folder (and interpolates `experiment.name` into its path) before
our code sees the config, and reports composition errors with exit code 1. So the
command line is first composed here with Hydra's compose API: any unknown key, bad type,
bad group option or invalid value becomes one line naming the key and what is allowed,
with exit code 2, before a folder or a process exists. Then `@hydra.main` runs as usual
(sweeps, launchers and `.hydra/` included).

`resume_from=<run dir>` bypasses composition: the run's saved config is reused, only
run-safe keys may be overridden, and the run continues in its own folder.
"""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from pita.core.errors import ConfigError
from pita.core.paths import RunPaths
from pita.experiment.config import register_configs, resume_path_errors, validate

PROJECT_ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = PROJECT_ROOT / "conf"
# Keys a resumed run may change: where and how it runs, never what it computes.
RESUME_SAFE_PREFIXES = ("system.devices", "system.threads_per_worker", "system.use_parallel_execution",
                        "executor.", "dry_run", "resume_from")


def _first_line(text: str) -> str:
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    return lines[0] if lines else ""


def format_compose_error(exc: BaseException, overrides: list[str]) -> str:
    """Hydra/OmegaConf composition errors -> one line naming the key and what is allowed."""
    text = str(exc)
    m = re.search(r"Could not override '([^']+)'", text)
    if m:
        return f"{m.group(1)}: unknown key (not in pita's config schema, see conf/ and pita/experiment/config.py)"
    m = re.search(r"Could not find '([^/']+)/([^']+)'", text)
    if m:
        group, name = m.group(1), m.group(2)
        options = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
        return f"{group}={name}: no such {group} config; available: {', '.join(options)}"
    m = re.search(r"Error merging override (\S+)", text)
    if m:
        cause = exc.__cause__ or exc.__context__
        detail = _first_line(cause) if cause else _first_line(text)
        return f"{m.group(1)}: {detail}"
    if "mismatched input" in text or "extraneous input" in text or "no viable alternative" in text:
        return f"{_unparsable(overrides)}: not a valid override (write key=value; quote values with brackets or " \
               f"commas, e.g. 'system.devices=\"fake:[80GB,40GB]\"')"
    cause = exc.__cause__
    key = getattr(cause, "full_key", None) if cause else None
    if key:
        return f"{key}: {_first_line(cause)}"
    return _first_line(text) or type(exc).__name__


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


def compose_config(overrides: list[str]) -> DictConfig:
    """Compose conf/config.yaml with overrides (no run folder); raises ConfigError."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    overrides = [o for o in overrides if not o.startswith(("hydra.", "+hydra.", "~hydra."))]
    try:
        overrides = _sweep_to_single(overrides)
    except Exception as exc:
        raise ConfigError(format_compose_error(exc, overrides)) from None
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
            return compose("config", overrides=overrides)
    except Exception as exc:
        raise ConfigError(format_compose_error(exc, overrides)) from None
    finally:
        GlobalHydra.instance().clear()


def load_resume_config(resume_dir: str, overrides: list[str]) -> tuple[DictConfig, Path]:
    """The saved config of `resume_dir` with only run-safe overrides applied."""
    errors = resume_path_errors(resume_dir, PROJECT_ROOT)
    if errors:
        raise ConfigError(errors)
    run_dir = Path(resume_dir).expanduser()
    if not run_dir.exists():
        run_dir = PROJECT_ROOT / resume_dir
    try:
        saved = OmegaConf.load(RunPaths(run_dir).saved_config)
    except Exception as exc:
        raise ConfigError(f"resume_from={resume_dir!r}: saved config unreadable ({_first_line(exc)})") from None
    from pita.experiment.config import PitaConfig

    cfg = OmegaConf.merge(OmegaConf.structured(PitaConfig), saved)
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if not key.startswith(RESUME_SAFE_PREFIXES):
            raise ConfigError(f"{key}: cannot change on resume (the run's saved config is reused); "
                              f"allowed: system.devices, executor.*, dry_run")
        if key == "resume_from":
            continue
        try:
            value = OmegaConf.from_dotlist([o.lstrip("+")])
            cfg = OmegaConf.merge(cfg, value)
        except Exception as exc:
            raise ConfigError(f"{o}: {_first_line(exc)}") from None
    cfg.resume_from = str(run_dir)
    return cfg, run_dir


def preflight(cfg: DictConfig) -> None:
    """Everything that can be checked before a folder or a process exists: values, the
    devices (NVML only, no CUDA context) and the plan (e.g. a task no device can hold)."""
    from pita.experiment.run import build_plan, make_gpu_manager

    validate(cfg, project_root=PROJECT_ROOT)
    build_plan(cfg, make_gpu_manager(cfg))


def _print_config_error(exc: ConfigError) -> None:
    for line in exc.messages:
        print(f"error: {line}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = [a for a in argv if not a.startswith("-")]
    flags = [a for a in argv if a.startswith("-")]
    info_only = any(f in ("--help", "-h", "--hydra-help", "--info", "--cfg", "-c", "--version") or
                    f.startswith(("--cfg", "--info", "--package", "-p")) for f in flags)
    resume = next((o.split("=", 1)[1] for o in overrides if o.startswith("resume_from=")), None)
    if resume not in (None, "", "null"):
        try:
            cfg, run_dir = load_resume_config(resume, [o for o in overrides if not o.startswith("resume_from=")])
            validate(cfg, project_root=PROJECT_ROOT)
            from pita.experiment.run import make_gpu_manager

            make_gpu_manager(cfg)
        except ConfigError as exc:
            _print_config_error(exc)
            sys.exit(2)
        _setup_resume_logging(run_dir)
        from pita.experiment.run import run

        sys.exit(_run_checked(lambda: run(cfg, run_dir, resumed=True)))

    if not info_only:
        try:
            preflight(compose_config(overrides))
        except ConfigError as exc:
            _print_config_error(exc)
            sys.exit(2)
    _hydra_main()


def _run_checked(fn) -> int:
    try:
        return fn()
    except ConfigError as exc:  # e.g. a device index that does not exist, a task too large
        _print_config_error(exc)
        return 2
    except KeyboardInterrupt:
        return 130


def _setup_resume_logging(run_dir: Path) -> None:
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    console = logging.StreamHandler(sys.stdout)
    console.setFormatter(logging.Formatter("%(message)s"))
    file = logging.FileHandler(RunPaths(run_dir).run_log, mode="a")
    file.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] %(message)s"))
    root.handlers[:] = [console, file]


def _hydra_main() -> None:
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    register_configs()
    worst = [0]  # a sweep exits with its worst job's code

    @hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
    def _main(cfg: DictConfig) -> int:
        from pita.experiment.run import run

        hc = HydraConfig.get()
        code = _run_checked(lambda: run(cfg, Path(hc.runtime.output_dir)))
        if hc.mode != RunMode.MULTIRUN or code in (2, 130):
            sys.exit(code)
        worst[0] = max(worst[0], code)
        return code

    _main()
    sys.exit(worst[0])
