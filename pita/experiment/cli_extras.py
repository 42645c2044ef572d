"""Command-line conveniences on top of Hydra's overrides (used by pita/experiment/cli.py).

- `conf_dir()`: the config tree: `conf/` of a source checkout, else `pita/conf/` inside an
  installed wheel (pyproject.toml maps one onto the other).
- `expand_algos`: `algos=[QSharp,DPO]` (one override) -> `algos.<NAME>.enabled=true|false`
  for every algorithm, names checked.
- `help_text`: `--help`, pita's keys with the defaults that run and the schema's help and rules.
- `find_resumable`: `resume_from=auto`, the newest unfinished run of an experiment.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pita.core.errors import ConfigError

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def conf_dir() -> Path:
    packaged = Path(__file__).resolve().parents[1] / "conf"  # pita/conf in a wheel
    return packaged if (packaged / "config.yaml").is_file() else PROJECT_ROOT / "conf"


# --- algos=[A,B] ----------------------------------------------------------------------------

_ALGOS_RE = re.compile(r"^algos=\[?(?P<names>[^\]]*)\]?$")


def expand_algos(
    overrides: list[str], names: tuple[str, ...], in_config: tuple[str, ...] | None = None
) -> list[str]:
    """Replace `algos=[A,B]` with enabled flags: A and B on, every other algorithm off.
    `algos=all` enables every algorithm. An unknown name is a ConfigError.
    `in_config`: the algorithms every composed config holds (pita's own, conf/config.yaml);
    an installed plugin's algorithm is only there when an experiment adds it, so it is
    switched off with `++` (set, or added as off), never refused as an unknown key
    (issue 45: a plugin installed broke the README's `algos=[QSharp,GRPO,DPO]`)."""
    from pita.core.plugins import failure_hint

    in_config = names if in_config is None else in_config
    out: list[str] = []
    for o in overrides:
        m = _ALGOS_RE.match(o)
        if not m:
            out.append(o)
            continue
        raw = m.group("names").strip()
        chosen = (
            list(names)
            if raw == "all"
            else [n.strip().strip("'\"") for n in raw.split(",") if n.strip()]
        )
        bad = [n for n in chosen if n not in names]
        if bad or not chosen:
            raise ConfigError(
                f"{o}: {'unknown algorithm ' + ', '.join(map(repr, bad)) if bad else 'empty list'}; "
                f"allowed: {', '.join(names)} (e.g. algos=[QSharp,DPO] or algos=all)"
                + (failure_hint() if bad else "")
            )
        for n in names:
            on = n in chosen
            plus = "" if on or n in in_config else "++"
            out.append(f"{plus}algos.{n}.enabled={'true' if on else 'false'}")
    return out


# --- --help ---------------------------------------------------------------------------------


def _default(value: Any) -> str:
    return "" if value is None else json.dumps(value, default=str)


def _hint(f: dataclasses.Field) -> str:
    """A field's help with what its rule allows (the schema's metadata, one copy)."""
    from pita.core.schema import rule_of

    rule = rule_of(f)
    text = f.metadata.get("help", "")
    return f"{text} [{rule.text()}]" if rule is not None else text


def _value(tree: Any, key: str) -> Any:
    for part in key.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def _key_rows(composed: dict | None) -> list[tuple[str, str, str]]:
    """(key, default, help) of every key outside algos: the composed default when given."""
    from pita.core.schema import PitaConfig, leaf_fields

    rows = []
    for key, f in leaf_fields(PitaConfig):
        if key == "algos":
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        if f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        rows.append((key, _default(_value(composed, key) if composed else default), _hint(f)))
    return rows


def _algo_rows(composed: dict | None) -> list[tuple[str, str, str]]:
    """Per algorithm family (one schema, pita/core/schema.py): its keys, with the defaults
    each of its algorithms actually runs with (conf/algo/*.yaml, as composed)."""
    from pita.algos.registry import ALGORITHMS
    from pita.core.schema import leaf_fields

    families: dict[type, list[str]] = {}
    for name, algo in ALGORITHMS.items():
        families.setdefault(algo.schema, []).append(name)
    algos = (composed or {}).get("algos") or {}
    rows: list[tuple[str, str, str]] = []
    for schema, names in families.items():
        doc = (schema.__doc__ or "").strip().splitlines()[0]
        rows.append((f"algos.<{'|'.join(names)}>", "", doc))
        schema_defaults = dataclasses.asdict(schema())  # when nothing composed
        for key, f in leaf_fields(schema):
            values = [_default(_value(algos.get(n) or schema_defaults, key)) for n in names]
            shown = values[0] if len(set(values)) == 1 else "/".join(values)
            rows.append((f"  .{key}", shown, _hint(f)))
    return rows


def help_text(prog: str = "run_parallel.py", composed: dict | None = None) -> str:
    """`--help`: pita's keys, their defaults (`composed`: the config that would run, so the
    per-algorithm values of conf/algo/*.yaml; else the schema's) and what each allows."""
    cmd = prog if prog == "pita" else f"python {prog}"
    conf = conf_dir()
    groups = {
        p.name: sorted(q.stem for q in p.glob("*.yaml"))
        for p in sorted(conf.iterdir())
        if p.is_dir() and p.name != "hydra" and any(p.glob("*.yaml"))
    }
    lines = [
        "pita: LLM post-training experiments (PITA, Q#, Q#-HF, DPO, GRPO, GRPO-HF) on every device of a machine.",
        "",
        f"usage: {cmd} [key=value ...] [-m] [-cn NAME] [--config-dir DIR] [--cfg job]",
        f"       {cmd} -sc install=bash      # tab completion (bash/zsh/fish)",
        "       python -m pita.results.aggregate <sweep dir>   # mean ± std over a sweep's runs",
        "",
        "Exit codes: 0 all tasks done, 1 some failed, 2 bad config (nothing started), 130 interrupted.",
        "",
        "Config groups (choose with group=option):",
    ]
    lines += [f"  {g:12s} {', '.join(opts)}" for g, opts in groups.items()]
    lines += [
        "  hydra/launcher  basic, submitit_local, submitit_slurm, slurm, slurm_1gpu",
        "",
        "Shortcuts:",
        "  algos=[QSharp,DPO]          run only these algorithms (algos=all: every one)",
        "  resume_from=auto            resume the newest unfinished run of experiment.name, else start one",
        "",
        "Keys (key  default  help [allowed]):",
    ]
    rows = _key_rows(composed)
    algo_rows = _algo_rows(composed)
    width = max(len(k) for k, _, _ in rows + algo_rows)
    lines += [f"  {key:{width}s}  {default:>10s}  {text}" for key, default, text in rows]
    lines += ["", "Algorithm keys, algos.<NAME>.<key> (defaults per algorithm, a/b in row order):"]
    lines += [f"  {key:{width}s}  {default:>10s}  {text}" for key, default, text in algo_rows]
    lines += ["", "Hydra's own options: --hydra-help. Docs: README.md (Cookbook)."]
    return "\n".join(lines)


# --- resume_from=auto -----------------------------------------------------------------------


def run_finished(run_dir: Path) -> bool:
    """True when the run's journal ends with a clean `run_finished`: no failed task, and
    the report written (it is journaled after the report)."""
    from pita.core.journal import read_events
    from pita.core.paths import RunPaths

    try:
        events = read_events(RunPaths(run_dir).journal)
    except OSError:
        return False
    last = next((e for e in reversed(events) if str(e.get("event", "")).startswith("run_")), None)
    return bool(
        last
        and last.get("event") == "run_finished"
        and not last.get("failed")
        and not last.get("skipped")
        and last.get("report", True) is not False  # a failed report is finished by a resume
    )


def find_resumable(outputs: Path, experiment: str) -> Path | None:
    """The newest planned run folder of `experiment` if it did not finish cleanly (else
    None: a finished experiment is not resumed, a new run starts)."""
    folder = outputs / experiment
    if not folder.is_dir():
        return None
    from pita.core.paths import RunPaths

    candidates = sorted(
        (
            p
            for p in folder.iterdir()
            if p.is_dir() and RunPaths(p).plan.is_file() and RunPaths(p).saved_config.is_file()
        ),
        key=lambda p: p.name,
        reverse=True,
    )
    return candidates[0] if candidates and not run_finished(candidates[0]) else None


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted leaf keys of a resolved config (lists are leaves; an empty mapping has none)."""
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: node}


def config_differences(saved: Any, composed: Any, safe: Callable[[str], bool]) -> list[str]:
    """`key: saved -> now` for every key (but the `safe` ones) whose value differs."""
    from omegaconf import OmegaConf

    a = flatten(OmegaConf.to_container(saved, resolve=True))
    b = flatten(OmegaConf.to_container(composed, resolve=True))
    return [
        f"{k}: {a.get(k)!r} -> {b.get(k)!r}"
        for k in sorted(set(a) | set(b))
        if not safe(k) and a.get(k) != b.get(k)
    ]
