"""The per-user caches under `$PITA_CACHE_DIR`, read and written under the control-file rules.

pita keeps measurements across runs there (`task_durations.json`, `task_peaks.json`,
`batch_sizes.json`), and a team may point `PITA_CACHE_DIR` at a shared disk. A cache is a
hint, never a reason to stop, so every read goes through `safe_files.read_control` (no link,
a regular file, yours, at most `MAX_CACHE_BYTES`: a link to `/dev/zero` is not read, a FIFO
does not hang) and anything wrong with it (unsafe, unreadable, not JSON, nested deeper than
the parser's stack, not the expected shape) is one WARNING per file and process, and the
cache counts as empty. A non-finite or overlong number (`Infinity`, `1e999`) reads as None,
so the entry holding it fails its shape check and is dropped with that WARNING.

`update_json` is the only writer: under an advisory `flock` on `<name>.lock` (opened like a
control file, so a planted link is not followed) it re-reads the cache, lets the caller
change the dict, and replaces the file atomically (a link or a foreign file in its place is
replaced, never written through). A cache that cannot be written is a WARNING too.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pita.core.paths import atomic_write_text
from pita.core.safe_files import UnsafeFile, open_control, read_control_text

log = logging.getLogger("pita.cache")

MAX_CACHE_BYTES = 32 * 2**20  # ~100k entries of any of pita's caches; more is not pita's file

_warned: set[tuple[str, str]] = set()  # (path, what): one WARNING per file and problem


def _warn_once(path: Path, what: str, why: str) -> None:
    key = (str(path), what)
    if key in _warned:
        return
    _warned.add(key)
    log.warning("ignoring the %s cache %s: %s", what, path, why)


MAX_INT_DIGITS = 30  # no count, byte size or seed pita caches comes near it


def _no_number(name: str) -> None:
    """`NaN`, `Infinity`, `-Infinity` (Python's json accepts them): not a measurement, so
    None, which the entry's shape check then drops with the file's WARNING."""
    return None


def _finite_float(text: str) -> float | None:
    value = float(text)  # `1e999` is inf
    return value if math.isfinite(value) else None


def _bounded_int(text: str) -> int | None:
    """An int a float can hold (a 400-digit one overflows float() in the caller)."""
    return int(text) if len(text.lstrip("-")) <= MAX_INT_DIGITS else None


def read_json(path: Path, what: str, limit: int = MAX_CACHE_BYTES) -> dict[str, Any]:
    """The cache's top-level mapping, or {} when it is absent or not to be trusted (one
    WARNING saying why). Callers still check each entry's shape: a wrong entry is skipped."""
    try:
        text = read_control_text(path, limit)
    except FileNotFoundError:
        return {}
    except UnsafeFile as exc:
        _warn_once(path, what, str(exc))
        return {}
    except OSError as exc:
        _warn_once(path, what, exc.strerror or str(exc))
        return {}
    try:
        data = json.loads(
            text, parse_constant=_no_number, parse_float=_finite_float, parse_int=_bounded_int
        )
    except ValueError as exc:
        _warn_once(path, what, f"not JSON ({exc})")
        return {}
    except RecursionError:  # [[[[...]]]] 400 KB deep: the parser's stack, not pita's problem
        _warn_once(path, what, "nested deeper than any cache pita writes")
        return {}
    if not isinstance(data, dict):
        _warn_once(path, what, f"a JSON {type(data).__name__}, not an object")
        return {}
    return data


def entries(
    data: dict[str, Any], path: Path, what: str, parse: Callable[[Any], Any]
) -> dict[str, Any]:
    """`parse` applied to each entry; entries it rejects (any exception) are dropped with
    one WARNING for the file."""
    out: dict[str, Any] = {}
    bad = 0
    for key, value in data.items():
        try:
            out[str(key)] = parse(value)
        except Exception:  # noqa: BLE001 - a cache's junk entry is skipped, never raised
            bad += 1
    if bad:
        _warn_once(path, what, f"{bad} entr{'y' if bad == 1 else 'ies'} of the wrong shape")
    return out


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive advisory lock for updating `path` (`<name>.lock` next to it)."""
    import fcntl

    fd = open_control(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the flock


def update_json(
    path: Path,
    what: str,
    change: Callable[[dict[str, Any]], None],
    dump: Callable[[dict[str, Any]], str] | None = None,
) -> bool:
    """Read, `change` in place, write back atomically under the lock; False (and a
    WARNING) when it cannot be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with locked(path):
            data = read_json(path, what)
            change(data)
            text = dump(data) if dump else json.dumps(data, indent=2, sort_keys=True) + "\n"
            atomic_write_text(path, text)
        return True
    except (OSError, UnsafeFile) as exc:
        _warn_once(path, what + " (write)", str(exc))
        return False
