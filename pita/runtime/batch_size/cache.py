"""The on-disk cache of probed batch sizes, keyed by GPU, model, dtype, stage and versions.

Part of pita.runtime.batch_size (see its docstring for how the probe works).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import time
from collections.abc import Mapping
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

    Reads and writes follow pita/core/user_cache.py (the control-file rules, one WARNING
    for a cache not to be trusted; writes under a `flock`, replaced atomically).
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
        from pita.core import user_cache

        data = user_cache.read_json(self.path, "batch size")
        if data and data.get("version") != self.VERSION:
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
        from pita.core import user_cache

        def add(data: dict[str, Any]) -> None:
            entries = data.get("entries") if data.get("version") == self.VERSION else None
            entries = entries if isinstance(entries, dict) else {}
            entries[self.key_id(key)] = entry
            data.clear()
            data.update({"version": self.VERSION, "entries": entries})

        user_cache.update_json(
            self.path,
            "batch size",
            add,
            dump=lambda data: json.dumps(data, indent=1, sort_keys=True, default=str),
        )
