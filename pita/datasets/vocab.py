"""Word-level tokenizers built in code for the synthetic tasks (nothing downloads).

A `tokenizers` WordLevel model with a whitespace pre-tokenizer, wrapped in a
`PreTrainedTokenizerFast`, so models, `generate` and `save_pretrained` treat it like any
hub tokenizer. Task tokens get ids 0..n-1 in the order given (so node i of a graph task is
token id i), then the specials: EOS, PAD, UNK. There is no BOS: prompts start with their
first task token, and `tokenizer(text)` adds nothing.

Text form: tokens separated by single spaces, e.g. "START 3 GOAL 7 =".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedTokenizerFast

EOS = "<eos>"
PAD = "<pad>"
UNK = "<unk>"
SPECIALS = (EOS, PAD, UNK)


def build_tokenizer(
    tokens: Sequence[str], *, drop: str = "", isolate: str = ""
) -> PreTrainedTokenizerFast:
    """A left-padding word-level tokenizer over `tokens` plus EOS/PAD/UNK (ids in that order).

    Text is split on whitespace; then each character in `drop` is a separator that is
    removed (star graph: ",") and each character in `isolate` becomes a token of its own
    (star graph: "|/="), so "3,4|5,6" encodes like "3 4 | 5 6".
    """
    import re

    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = list(tokens)
    if len(set(tokens)) != len(tokens):
        raise ValueError(f"duplicate tokens in vocabulary: {tokens}")
    for t in tokens:
        if not t or any(c.isspace() for c in t) or t in SPECIALS:
            raise ValueError(f"token {t!r} is empty, contains whitespace or is a special token")
    vocab = {t: i for i, t in enumerate([*tokens, *SPECIALS])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    steps: list[Any] = [pre_tokenizers.WhitespaceSplit()]
    if drop:
        steps.append(pre_tokenizers.Split(Regex(f"[{re.escape(drop)}]"), "removed"))
    if isolate:
        steps.append(pre_tokenizers.Split(Regex(f"[{re.escape(isolate)}]"), "isolated"))
    backend.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    # No decoder: `tokenizers` then joins tokens with one space, the text form we want.
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",
    )


class Vocab:
    """Fast id <-> token lookups for a task vocabulary, without calling the tokenizer.

    The tasks build ids through this table (it is much faster than the tokenizer for
    hundreds of thousands of tiny sequences); tests check it agrees with the tokenizer.
    """

    def __init__(self, tokens: Sequence[str]):
        self.tokens = [*tokens, *SPECIALS]
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        self.eos_id = self.ids[EOS]

    def __len__(self) -> int:
        return len(self.tokens)

    def token(self, i: int) -> str:
        """Token string of id i; out-of-range ids become UNK."""
        return self.tokens[i] if 0 <= i < len(self.tokens) else UNK

    def decode(self, ids: Sequence[int]) -> list[str]:
        return [self.token(int(i)) for i in ids]


class FamilyText:
    """An offline task rendered as text in a model family's own tokenizer (gpt2, a local
    folder): prompts and targets are encoded from their text form, responses are read
    back by decoding. Why text and not ids: a family's BPE may split a node number into
    several tokens, and a sampled response need not use the canonical split, so the
    verifier compares text (decoded without cleanup, special tokens kept, so neither a
    stray BOS nor a re-spaced comma can pass for the right answer).

    Prompts get the tokenizer's own special tokens (a Llama BOS; nothing for GPT-2);
    targets get none, then the family's EOS.
    """

    def __init__(self, tokenizer):
        if tokenizer.eos_token_id is None:
            raise ValueError("the family's tokenizer has no EOS token; offline tasks need one")
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.tokenizer = tokenizer
        self.eos_id = int(tokenizer.eos_token_id)

    def prompts(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(x) for x in self.tokenizer(list(texts))["input_ids"]] if texts else []

    def targets(self, texts: Sequence[str]) -> list[list[int]]:
        if not texts:
            return []
        ids = self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]
        return [[*x, self.eos_id] for x in ids]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(
            [int(i) for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    def decode_prompt(self, ids: Sequence[int]) -> str:
        """The prompt's text without the tokenizer's special tokens (a BOS)."""
        return self.tokenizer.decode(
            [int(i) for i in ids], skip_special_tokens=True, clean_up_tokenization_spaces=False
        )

    def max_tokens(self, text: str) -> int:
        """A bound on the tokens of any text at most as long as `text` (byte-level BPE: at
        most one token per byte), and never below the canonical encoding of `text`."""
        canonical = len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return max(canonical, len(text.encode("utf-8")))


def family_text(tokenizer, builtin) -> FamilyText | None:
    """None when `tokenizer` is absent or is the task's own built-in tokenizer (the tiny
    family saves it next to π_ref); else the family's tokenizer (a path or an object)."""
    import os

    if tokenizer is None:
        return None
    if isinstance(tokenizer, (str, os.PathLike)):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
    if tokenizer.get_vocab() == builtin.get_vocab():
        return None
    return FamilyText(tokenizer)
