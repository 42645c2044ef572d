"""Tiny randomly initialised Llamas for the offline tasks and for tests.

They are ordinary ``transformers`` models (``LlamaForCausalLM``), so ``save_pretrained`` / ``from_pretrained``, the
generation engine and TRL trainers treat them exactly like hub checkpoints.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama_config(
    vocab_size: int,
    *,
    n_layer: int = 1,
    d_model: int = 64,
    n_head: int = 4,
    d_ff: int | None = None,
    max_position: int = 64,
    pad_token_id: int | None = None,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    initializer_range: float = 0.02,
    attn_impl: str = "eager",
    **extra: object,
) -> LlamaConfig:
    """The ``LlamaConfig`` of a tiny Llama (multi-head attention, untied embeddings)."""
    if d_model % n_head:
        raise ValueError(f"d_model={d_model} must be divisible by n_head={n_head}")
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=d_model,
        intermediate_size=d_ff if d_ff is not None else 4 * d_model,
        num_hidden_layers=n_layer,
        num_attention_heads=n_head,
        num_key_value_heads=n_head,
        max_position_embeddings=max_position,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        initializer_range=initializer_range,
        tie_word_embeddings=False,
        **extra,
    )
    config._attn_implementation = attn_impl
    return config


def _build(cls: type, config: LlamaConfig, seed: int) -> torch.nn.Module:
    # fork_rng: seeding must not disturb the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    return model.to(torch.float32).eval()


# The keywords build_tiny_llama passes on to tiny_llama_config (anything else is a typo).
_SHAPE_KEYS = frozenset(
    {"n_layer", "d_model", "n_head", "d_ff", "max_position", "bos_token_id"}
    | {"initializer_range", "attn_impl"}
)


def build_tiny_llama(
    vocab_size: int, *, pad_token_id: int, eos_token_id: int, seed: int = 0, **shape: Any
) -> LlamaForCausalLM:
    """A randomly initialised fp32 ``LlamaForCausalLM`` (eval mode; call ``.train()`` to
    train). ``seed`` makes the initial weights reproducible; ``shape`` is tiny_llama_config's
    keywords (n_layer, d_model, n_head, d_ff, max_position, bos_token_id, initializer_range,
    attn_impl), so the two cannot drift apart."""
    if unknown := sorted(set(shape) - _SHAPE_KEYS):
        raise TypeError(f"build_tiny_llama() got unexpected keyword arguments {unknown}")
    config = tiny_llama_config(
        vocab_size, pad_token_id=pad_token_id, eos_token_id=eos_token_id, **shape
    )
    return _build(LlamaForCausalLM, config, seed)
