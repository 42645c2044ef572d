"""The model layer: family catalog, loading, tiny models, batched generation, reward scoring.

Importing this package does not import torch: only the catalog is loaded eagerly; the
torch-backed names below are resolved from their modules on first access.
"""

from __future__ import annotations

import importlib
from typing import Any

from pita.models.catalog import (
    BUILTIN,
    FAMILIES,
    Family,
    known_aliases,
    parse_alias,
    resolve_family,
)

_LAZY = {
    "GenerationOutput": "generation",
    "OffsetHook": "generation",
    "generate": "generation",
    "sequence_logprobs": "generation",
    "select_tokens": "generation",
    "load_causal_lm": "loading",
    "load_reward_model": "loading",
    "load_tokenizer": "loading",
    "check_shared_vocab": "loading",
    "resolve_dtype": "loading",
    "empty_device_cache": "loading",
    "reset_peak_memory": "loading",
    "peak_memory_bytes": "loading",
    "build_tiny_llama": "tiny",
    "build_tiny_reward_model": "tiny",
    "RewardScorer": "reward_scorer",
}

__all__ = [
    "BUILTIN",
    "FAMILIES",
    "Family",
    "GenerationOutput",
    "OffsetHook",
    "RewardScorer",
    "build_tiny_llama",
    "build_tiny_reward_model",
    "check_shared_vocab",
    "empty_device_cache",
    "generate",
    "known_aliases",
    "load_causal_lm",
    "load_reward_model",
    "load_tokenizer",
    "parse_alias",
    "peak_memory_bytes",
    "reset_peak_memory",
    "resolve_dtype",
    "resolve_family",
    "select_tokens",
    "sequence_logprobs",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = importlib.import_module(f"pita.models.{_LAZY[name]}")
        return getattr(module, name)
    raise AttributeError(f"module 'pita.models' has no attribute {name!r}")
