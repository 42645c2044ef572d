"""Batched reward-model scoring of (prompt, response) pairs in token space.

One forward per chunk of ``batch_size`` pairs (the original code scored one pair per call).
Prompt and response ids are concatenated as ids, never as joined strings, so they must
already be in the reward model's token space: a reward model with its own tokenizer (e.g.
DistilBERT-IMDB for a gpt2 policy) needs its inputs re-tokenized by the caller.

Scoring position: the model's own pooling is used, i.e. what TRL's reward trainer trained.
For decoder reward heads (``*ForSequenceClassification`` of Llama, Qwen, Mistral, ...)
HF pools at the rightmost token that is not ``config.pad_token_id``; we pad with exactly
that id, so padding on either side pools at the last real token. Caveat: when pad == EOS,
a response's trailing EOS counts as padding and the score is read one token earlier, in
training and scoring alike.
"""

from __future__ import annotations

from typing import Any

import torch

from pita.models.generation import model_device, position_ids_from_mask


class RewardScorer:
    """Scores (prompt ids, response ids) pairs with a sequence-classification model.

    ``tokenizer_or_pad`` gives the pad id (a tokenizer's ``pad_token_id``, else its EOS, or
    an int); it is used only when the model config has no ``pad_token_id`` (the config's
    id wins, since HF pooling looks for it). ``label_index`` picks the output column: by
    default 0 for a one-output head, else the label named ``POSITIVE``.
    ``padding_side="left"`` feeds explicit position ids (decoder models only).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer_or_pad: Any,
        batch_size: int,
        *,
        label_index: int | None = None,
        padding_side: str = "right",
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}: must be >= 1")
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side={padding_side!r}: expected 'left' or 'right'")
        self.model = model
        self.batch_size = batch_size
        self.padding_side = padding_side
        config = model.config
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        pad = text_config.pad_token_id
        if pad is None:
            pad = _pad_id(tokenizer_or_pad)
            text_config.pad_token_id = pad  # HF pooling needs it to find the last token
            config.pad_token_id = pad
        self.pad_token_id = int(pad)
        self.label_index = _label_index(config, label_index)

    def score(self, prompts: list[list[int]], responses: list[list[int]]) -> list[float]:
        """One float per pair, in input order."""
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        seqs = [list(p) + list(r) for p, r in zip(prompts, responses)]
        for i, s in enumerate(seqs):
            if not s:
                raise ValueError(f"pair {i}: prompt and response are both empty")
        scores: list[float] = [0.0] * len(seqs)
        order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))  # less padding per chunk
        device = model_device(self.model)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                for start in range(0, len(order), self.batch_size):
                    idx = order[start : start + self.batch_size]
                    values = self._forward([seqs[i] for i in idx], device)
                    for i, v in zip(idx, values):
                        scores[i] = v
        finally:
            self.model.train(was_training)
        return scores

    def _forward(self, rows: list[list[int]], device: torch.device) -> list[float]:
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for b, r in enumerate(rows):
            cols = (
                slice(0, len(r)) if self.padding_side == "right" else slice(width - len(r), width)
            )
            ids[b, cols] = torch.as_tensor(r, dtype=torch.long)
            mask[b, cols] = 1
        ids, mask = ids.to(device), mask.to(device)
        kwargs: dict[str, Any] = {"input_ids": ids, "attention_mask": mask}
        if self.padding_side == "left":
            kwargs["position_ids"] = position_ids_from_mask(mask)
        logits = self.model(**kwargs).logits  # [B, num_labels], pooled by the model
        return logits[:, self.label_index].float().tolist()


def _pad_id(tokenizer_or_pad: Any) -> int:
    if isinstance(tokenizer_or_pad, int):
        return tokenizer_or_pad
    pad = getattr(tokenizer_or_pad, "pad_token_id", None)
    if pad is None:
        pad = getattr(tokenizer_or_pad, "eos_token_id", None)
    if pad is None:
        raise ValueError("reward scoring needs a pad id: the tokenizer has neither pad nor EOS")
    return int(pad)


def _label_index(config: Any, label_index: int | None) -> int:
    num_labels = int(getattr(config, "num_labels", 1))
    if label_index is not None:
        if not 0 <= label_index < num_labels:
            raise ValueError(f"label_index={label_index}: the head has {num_labels} outputs")
        return label_index
    if num_labels == 1:
        return 0
    for i, name in (getattr(config, "id2label", None) or {}).items():
        if str(name).upper() == "POSITIVE":
            return int(i)
    raise ValueError(
        f"the reward head has {num_labels} outputs and none is labelled POSITIVE; "
        "pass label_index to pick the reward column"
    )


def text_scorer(scorer: RewardScorer, tokenizer: Any):
    """The `fn(prompts, responses) -> scores` a reward-scored hub task (IMDB, TL;DR) calls,
    from a reward model and *its own* tokenizer: each prompt + response text is tokenized
    as one text with that tokenizer's special tokens (a reward model need not share the
    policy's vocabulary: DistilBERT-IMDB scores gpt2 samples), then scored in batches."""

    def score(prompts: list[str], responses: list[str]) -> list[float]:
        ids = tokenizer([p + r for p, r in zip(prompts, responses)])["input_ids"]
        return scorer.score(ids, [[] for _ in ids])

    return score


def load_text_scorer(
    path: str,
    *,
    device: str = "cpu",
    dtype: str = "auto",
    batch_size: int = 32,
    trust_remote_code: bool = False,
):
    """`text_scorer` of a sequence-classification checkpoint (a family's `model.reward`)."""
    from pita.models.loading import load_reward_model, load_tokenizer

    model = load_reward_model(path, device=device, dtype=dtype, trust_remote_code=trust_remote_code)
    tok = load_tokenizer(path, trust_remote_code=trust_remote_code, padding_side="right")
    return text_scorer(RewardScorer(model, tok, batch_size, padding_side="right"), tok)
