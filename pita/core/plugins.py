"""Packages that extend pita through entry points (docs/extending.md), each failing alone.

`pita_algorithms` entries load to `Algorithm` rows while pita/algos/registry.py builds its
table; `pita_datasets` entries name a task module, imported when a run selects it
(pita/datasets). Both are read in every pita process, so an installed package whose import
raises must not take pita down with it: its failure is one WARNING naming the package and
the error, the entry is skipped, and the commands that do not need it (a run of other
algorithms, `--help`, `aggregate`) work. A run that selects what it would have provided is
refused in one line that says why (`failure_hint`).
"""

from __future__ import annotations

import logging
from importlib.metadata import EntryPoint

log = logging.getLogger("pita")

FAILED: dict[str, str] = {}  # "<package> (<group> entry point <name> = <value>)" -> the error


def package_of(ep: EntryPoint) -> str:
    """The distribution that declares `ep` (its top-level module when unknown)."""
    dist = getattr(ep, "dist", None)
    name = getattr(dist, "name", None) if dist is not None else None
    return str(name or ep.value.split(":")[0].split(".")[0])


def describe(group: str, ep: EntryPoint) -> str:
    """`my-pita (pita_algorithms entry point copycat = my_pita.algorithm:COPYCAT)`."""
    return f"{package_of(ep)} ({group} entry point {ep.name} = {ep.value})"


def error_line(exc: BaseException) -> str:
    """`ImportError: No module named 'x'`: the exception's type and its first line."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[0][:300]}" if lines else type(exc).__name__


def skip(group: str, ep: EntryPoint, error: str) -> None:
    """Record `ep` as failed (for `failure_hint`) and say so once, as a WARNING."""
    where = describe(group, ep)
    if where not in FAILED:
        log.warning("plugin %s failed, skipped: %s", where, error)
    FAILED[where] = error


def load(group: str, ep: EntryPoint) -> object | None:
    """`ep.load()`, or None after a WARNING when it raises (anything: a plugin's import
    runs arbitrary code, SystemExit included)."""
    try:
        return ep.load()
    except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt is the only one let through
        if isinstance(exc, KeyboardInterrupt):
            raise
        skip(group, ep, error_line(exc))
        return None


def failure_hint() -> str:
    """`; installed plugins that failed to load: <package> (...): <error>` (empty when none
    failed): what a refusal of an unknown algorithm or dataset adds."""
    if not FAILED:
        return ""
    return "; installed plugin(s) that failed to load: " + "; ".join(
        f"{where}: {error}" for where, error in FAILED.items()
    )
