"""The on-disk cache of probed batch sizes, keyed by GPU, model, dtype, stage and versions.

Part of pita.runtime.batch_size (see its docstring for how the probe works).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from pita.runtime.batch_size.search import DEFAULT_REDUCTION, SearchResult

_log = logging.getLogger("pita.runtime.batch_size")


# --------------------------------------------------------------------------------------
# Cache
# --------------------------------------------------------------------------------------


def library_versions() -> dict[str, str | None]:
    """Versions that change memory use (kernels, cache layout), read without importing."""
    out: dict[str, str | None] = {}
    for name in ("torch", "transformers", "accelerate", "bitsandbytes", "pita"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


class BatchSizeCache:
    """Probe results in one JSON file, shared by the workers of a machine.

    An entry is keyed by everything that changes the answer (GPU name and memory, model,
    dtype, stage kind, lengths, library versions — the caller's key) and reused only when

    * the free memory now is at least what it was (``free_tolerance``, 0.5% by default,
      absorbs jitter well inside the 5% safety reduction),
    * the safety margin now is at least the one probed with (a lower margin asks for more
      headroom than the entry was found with), and
    * the entry was not limited by a smaller cap than today's.

    Writes take an advisory lock where the OS has one and replace the file atomically.
    """

    VERSION = 1

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        free_tolerance: float = 0.005,
        logger: logging.Logger | None = None,
    ) -> None:
        self.path = Path(path)
        self.free_tolerance = free_tolerance
        self.log = logger or _log

    @staticmethod
    def key_id(key: Mapping[str, Any]) -> str:
        blob = json.dumps(key, sort_keys=True, default=str, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:32]

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            self.log.warning("Ignoring unreadable batch size cache %s: %s", self.path, exc)
            return {}
        if not isinstance(data, dict) or data.get("version") != self.VERSION:
            return {}
        entries = data.get("entries")
        return entries if isinstance(entries, dict) else {}

    def lookup(
        self, key: Mapping[str, Any], *, free_bytes: float, safety_margin: float, cap: int
    ) -> dict[str, Any] | None:
        """The cached entry (with ``batch_size`` adjusted to ``cap``) or None on a miss."""
        entry = self._read().get(self.key_id(key))
        if not isinstance(entry, dict):
            return None
        try:
            if free_bytes < entry["free_bytes"] * (1 - self.free_tolerance):
                return None
            if safety_margin < entry["safety_margin"] - 1e-9:
                return None
            found, cached_cap = int(entry["found"]), int(entry["cap"])
            if found >= cached_cap and cap > cached_cap:
                return None  # it stopped at the old cap; a larger batch may fit now
            out = dict(entry)
            if found > cap:
                out["found"] = cap
                out["batch_size"] = max(1, int(cap * DEFAULT_REDUCTION))
            return out
        except (KeyError, TypeError, ValueError):
            return None

    def store(
        self,
        key: Mapping[str, Any],
        result: SearchResult,
        *,
        free_bytes: float,
        safety_margin: float,
        cap: int,
    ) -> None:
        entry = {
            "key": dict(key),
            "batch_size": result.batch_size,
            "found": result.found,
            "bytes_at_found": result.bytes_at_found,
            "budget_bytes": result.budget_bytes,
            "free_bytes": free_bytes,
            "safety_margin": safety_margin,
            "cap": cap,
            "probes": result.probes,
            "method": result.method,
            "created": time.time(),
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._locked():
            entries = self._read()
            entries[self.key_id(key)] = entry
            blob = json.dumps(
                {"version": self.VERSION, "entries": entries}, indent=1, sort_keys=True, default=str
            )
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(blob)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        try:
            import fcntl
        except ImportError:  # not POSIX: atomic replace still keeps the file whole
            yield
            return
        with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
