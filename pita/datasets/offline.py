"""What the two offline tasks (goal_walk, star_graph) share: their tokens (node i is
token i, then the task's separators, then EOS / PAD / UNK; or a model family's own
tokenizer reading the same text), the answers column of the results and `build`.

Each task keeps what is its own: the prompt format, the data and the verifier.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

from .base import cut_at_eos
from .vocab import FamilyText, Vocab, build_tokenizer, family_text

T = TypeVar("T")


class TaskTokens(NamedTuple):
    vocab: Vocab
    tokenizer: Any
    eos_id: int
    text: FamilyText | None  # the family's tokenizer, None for the built-in one
    max_new_tokens: int  # the answer's budget, EOS included


def task_tokens(
    num_nodes: int,
    separators: Sequence[str],
    answer_nodes: int,
    family_tokenizer: Any,
    **tokenizer_kw: str,
) -> TaskTokens:
    """The built-in number tokenizer over `num_nodes` nodes and `separators`, or (when
    `family_tokenizer` is given and is not the built-in one the tiny family saved) the
    family's; the answer budget is `answer_nodes` nodes and EOS in whichever reads it."""
    vocab = Vocab([*(str(v) for v in range(num_nodes)), *separators])
    tokenizer = build_tokenizer(vocab.tokens[: num_nodes + len(separators)], **tokenizer_kw)
    eos_id, max_new = vocab.eos_id, answer_nodes + 1
    text = family_text(family_tokenizer, tokenizer)
    if text is not None:
        tokenizer, eos_id = text.tokenizer, text.eos_id
        max_new = text.max_tokens(",".join([str(num_nodes - 1)] * answer_nodes)) + 1
    return TaskTokens(vocab, tokenizer, eos_id, text, max_new)


def node_answers(tokens: Any, responses: Sequence[Sequence[int]], sep: str) -> list[str]:
    """Each response's nodes up to its first EOS joined by `sep` ("" without an EOS);
    `tokens` is a task (its vocab, eos_id and text)."""
    out = []
    for resp in responses:
        nodes, has_eos = cut_at_eos(resp, tokens.eos_id)
        if not has_eos:
            out.append("")
        elif tokens.text is not None:
            out.append(sep.join(tokens.text.decode(nodes).split(",")))
        else:
            out.append(sep.join(tokens.vocab.decode(nodes)))
    return out


def checked(cfg: dict[str, Any], validate: Callable[[dict[str, Any]], list[str]]) -> None:
    """Raise one ValueError naming every bad value of a task's keyword arguments."""
    errors = validate(cfg)
    if errors:
        raise ValueError("; ".join(errors))


def build_offline(task_class: Callable[..., T], cfg: Mapping, tokenizer: Any) -> T:
    """The task of `cfg` (`dataset.*` without `name`); `tokenizer` (a family's tokenizer or
    its folder) renders it as text in that tokenizer, unless it is the built-in one the tiny
    family saved."""
    kwargs = {k: v for k, v in cfg.items() if k != "name" and not str(k).startswith("_")}
    return task_class(**kwargs, tokenizer=tokenizer)
