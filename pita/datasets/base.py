"""The task interface every dataset implements, and small helpers they share.

A task owns its prompt format, its tokenizer (or uses the model family's one), its
verifier and its reward. Algorithms and stages only see `Example`s, token ids and the
methods of `Task`; they never parse task text themselves.

Conventions shared by every task:
- `prompt_ids` carry no BOS unless the tokenizer itself adds one (the in-code tokenizers of
  goal_walk and star_graph have no BOS; hub tasks use whatever the model family adds).
- A response is the list of generated ids. Everything after the first EOS is ignored
  (padding, or tokens generated after EOS by a batched sampler). Whether a missing EOS costs
  the reward is task-specific: goal_walk and star_graph demand it, hub tasks do not.
- `answers()` returns "" for a response with no final answer; two responses to the same
  prompt with the same non-empty answer get the same reward, so maj@k can vote on answers.

This module must stay importable without torch/transformers (the orchestrator imports the
package to validate configs).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedTokenizerFast


@dataclass(frozen=True)
class Example:
    """One prompt of a task.

    prompt_ids: token ids of the prompt.
    target_ids: a reference answer in token ids, ending with EOS, or None if the task has none.
    meta: task-specific, JSON-serialisable facts about the prompt (e.g. {"source": 3, "goal": 7}).
    """

    prompt_ids: list[int]
    target_ids: list[int] | None
    meta: dict


@runtime_checkable
class Task(Protocol):
    """What every task provides. A plain class per task; no inheritance needed."""

    name: str
    tokenizer: PreTrainedTokenizerFast
    max_new_tokens: int  # longest response, EOS included

    def train_examples(self) -> list[Example]: ...

    def test_examples(self) -> list[Example]: ...

    def pretrain_batch(
        self, rng: random.Random, batch_size: int
    ) -> list[tuple[list[int], list[int]]]: ...

    def rewards(
        self, examples: Sequence[Example], responses: Sequence[Sequence[int]]
    ) -> list[float]: ...

    def answers(
        self, examples: Sequence[Example], responses: Sequence[Sequence[int]]
    ) -> list[str]: ...

    def extra_metrics(
        self, examples: Sequence[Example], responses: Sequence[Sequence[int]]
    ) -> dict[str, float]: ...

    def save_tokenizer(self, path: str) -> None: ...


def cut_at_eos(response: Sequence[int], eos_ids: int | Sequence[int]) -> tuple[list[int], bool]:
    """Split a generated response at its first EOS.

    Returns (tokens before the first EOS, whether an EOS was found). Tokens after the first
    EOS are dropped: they are padding or tokens a batched sampler produced after stopping.
    """
    stops = {eos_ids} if isinstance(eos_ids, int) else set(eos_ids)
    out: list[int] = []
    for t in response:
        if t in stops:
            return out, True
        out.append(int(t))
    return out, False


def check_pairs(examples: Sequence[Example], responses: Sequence[Sequence[int]]) -> None:
    """Raise if examples and responses do not pair up one to one."""
    if len(examples) != len(responses):
        raise ValueError(
            f"got {len(examples)} examples but {len(responses)} responses; pass one example "
            "per response (repeat an example for each of its samples)"
        )


# --- config validation helpers (stdlib only) -------------------------------------------


def cfg_error(key: str, value: Any, allowed: str) -> str:
    """The one-line message format every dataset validation error uses."""
    return f"dataset.{key}={value!r}: {allowed}"


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(
    cfg: Mapping, key: str, errors: list[str], *, minimum: int | None = None, optional: bool = False
) -> None:
    """Append an error if cfg[key] is present and not an int >= minimum (None ok if optional)."""
    if key not in cfg:
        return
    value = cfg[key]
    if value is None and optional:
        return
    if not is_int(value) or (minimum is not None and value < minimum):
        bound = f" >= {minimum}" if minimum is not None else ""
        none = " or null" if optional else ""
        errors.append(cfg_error(key, value, f"must be an integer{bound}{none}"))


def check_unknown_keys(cfg: Mapping, allowed: set[str], errors: list[str]) -> None:
    """Append an error for each key a task does not know (keys starting with '_' are skipped)."""
    for key in cfg:
        if str(key).startswith("_") or key in allowed:
            continue
        errors.append(
            cfg_error(
                key,
                cfg[key],
                f"unknown key for dataset {cfg.get('name')!r}; "
                f"allowed keys: {', '.join(sorted(allowed))}",
            )
        )
