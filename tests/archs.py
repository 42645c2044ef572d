"""Llama architectures for tests and benches, one line each (meta-device or tiny, nothing
downloaded): `llama(...)` spells a `LlamaConfig` by its shape, so a test says which model it
sizes without restating `LlamaConfig`'s keyword names each time."""

from __future__ import annotations

from transformers import LlamaConfig


def llama(
    vocab: int, hidden: int, ff: int, layers: int, heads: int, kv_heads: int, **extra: object
) -> LlamaConfig:
    """A `LlamaConfig` of that shape; `extra` goes to `LlamaConfig` as is (anything unset
    keeps `LlamaConfig`'s own default)."""
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ff,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        **extra,
    )


def llama_8b() -> LlamaConfig:
    """meta-llama/Llama-3.1-8B's architecture (no download)."""
    return llama(
        128256, 4096, 14336, 32, 32, 8, max_position_embeddings=131072, tie_word_embeddings=False
    )


def llama_1b(**extra: object) -> LlamaConfig:
    """meta-llama/Llama-3.2-1B's architecture (tied embeddings)."""
    return llama(128256, 2048, 8192, 16, 32, 8, tie_word_embeddings=True, **extra)


def llama_70b_judge() -> LlamaConfig:
    """A Llama-3.1-70B-sized reward model (sequence classification, one output)."""
    judge = ["LlamaForSequenceClassification"]
    return llama(
        128256, 8192, 28672, 80, 64, 8, tie_word_embeddings=False, num_labels=1, architectures=judge
    )
