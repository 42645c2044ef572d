"""Model families: which hub checkpoints play reference, guide and reward for an alias.

A *family* names the three roles an experiment needs:

- ``reference``: the frozen policy π_ref that is sampled from and guided;
- ``guide``: the checkpoint the value / preference model starts from (it must share the
  reference's tokenizer, because guided decoding adds offsets token by token);
- ``reward``: an optional reward model (a sequence-classification checkpoint).

An alias may end in ``-8bit`` / ``-4bit`` to load the hub checkpoints quantized
(bitsandbytes, CUDA only; :func:`pita.models.loading.load_causal_lm` raises a clear error
elsewhere). The ``tiny`` family is offline: its models are built and trained inside the run,
so its hub ids are the :data:`BUILTIN` marker.

This module imports no torch, so configuration code can validate a family cheaply.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

BUILTIN = "built-in"
"""Marker used instead of a hub id for models built inside the run (the ``tiny`` family)."""

QUANT_SUFFIXES = ("8bit", "4bit")


@dataclass(frozen=True)
class Family:
    """Checkpoints for one model family (hub ids or local folders)."""

    reference: str
    guide: str
    reward: str | None = None
    dtype: str = "auto"
    trust_remote_code: bool = False
    quantization: str | None = None  # None, "8bit" or "4bit"; set from the alias suffix

    @property
    def is_builtin(self) -> bool:
        """True when the reference is built in the run (no hub download)."""
        return self.reference == BUILTIN


FAMILIES: dict[str, Family] = {
    # Offline: reference and guide are tiny Llamas built and trained by the run itself.
    "tiny": Family(reference=BUILTIN, guide=BUILTIN, reward=None),
    # Llama 3.1 / 3.2 share one tokenizer (128,256 entries); so does the Skywork reward model.
    "llama3.2-1b": Family(
        reference="meta-llama/Llama-3.1-8B-Instruct",
        guide="meta-llama/Llama-3.2-1B-Instruct",
        reward="Skywork/Skywork-Reward-Llama-3.1-8B-v0.2",
    ),
    # Same tokenizer across Qwen2.5 sizes; note the embedding matrices are padded to
    # different sizes (151,936 for 1.5B vs 152,064 for 7B), so logits widths differ.
    "qwen2.5-1.5b": Family(
        reference="Qwen/Qwen2.5-7B-Instruct",
        guide="Qwen/Qwen2.5-1.5B-Instruct",
        reward=None,
    ),
    # The classic TRL sentiment setting. The IMDB classifier has its own (DistilBERT)
    # tokenizer: its inputs must be re-tokenized from text, not concatenated as gpt2 ids.
    "gpt2": Family(reference="gpt2", guide="gpt2", reward="lvwerra/distilbert-imdb"),
    # The official star-graph model for G(3, 8) (experiment=star_graph_gpt2).
    "gpt2-medium": Family(reference="gpt2-medium", guide="gpt2-medium", reward=None),
}

_OVERRIDABLE = tuple(f.name for f in fields(Family))


def parse_alias(alias: str) -> tuple[str, str | None]:
    """Split ``"llama3.2-1b-4bit"`` into ``("llama3.2-1b", "4bit")``; no suffix -> None."""
    for quant in QUANT_SUFFIXES:
        suffix = f"-{quant}"
        if alias.endswith(suffix) and len(alias) > len(suffix):
            return alias[: -len(suffix)], quant
    return alias, None


def known_aliases() -> list[str]:
    """Every alias :func:`resolve_family` accepts without explicit ids."""
    names = []
    for base, fam in FAMILIES.items():
        names.append(base)
        if not fam.is_builtin:
            names.extend(f"{base}-{q}" for q in QUANT_SUFFIXES)
    return names


def resolve_family(name: str, overrides: Mapping[str, Any] | None = None) -> Family:
    """The :class:`Family` for alias ``name`` with explicit ``overrides`` applied.

    ``overrides`` may set any :class:`Family` field (``reference``, ``guide``, ``reward``,
    ``dtype``, ``trust_remote_code``, ``quantization``); ``None`` values mean "keep the
    catalog's" and other keys are ignored, so the whole ``model`` config section can be
    passed as is. An alias outside the catalog is accepted only when the overrides give
    both ``reference`` and ``guide`` (a custom family named ``name``).
    """
    overrides = {k: v for k, v in (overrides or {}).items() if k in _OVERRIDABLE and v is not None}
    base, quant = parse_alias(name)
    if base in FAMILIES:
        family = FAMILIES[base]
    elif "reference" in overrides and "guide" in overrides:
        family = Family(reference=overrides["reference"], guide=overrides["guide"])
    else:
        raise ValueError(
            f"model.name={name!r} is not a known model family; known aliases: "
            f"{', '.join(known_aliases())} (or set model.reference and model.guide "
            "to hub ids / local folders for a custom family)"
        )
    if quant is not None:
        if family.is_builtin:
            raise ValueError(
                f"model.name={name!r}: the built-in family {base!r} cannot be quantized; "
                f"drop the -{quant} suffix"
            )
        overrides.setdefault("quantization", quant)
    family = replace(family, **overrides)
    if family.quantization not in (None, *QUANT_SUFFIXES):
        raise ValueError(
            f"model.quantization={family.quantization!r}: expected one of "
            f"{list(QUANT_SUFFIXES)} or null"
        )
    return family
