"""The star-graph path-finding task G(d, l, N) (Bachmann & Nagarajan 2024).

A star has d arms of l nodes each leaving a shared source; one arm ends at the goal. The
prompt lists the shuffled edges, then the source and goal; the answer is the goal arm:

    text     u,v|u,v|...|u,v/source,goal=p0,p1,...,p_{l-1}      (p0 = source, p_{l-1} = goal)
    tokens   u v | u v | ... | u v / s g =    then   p0 p1 ... p_{l-1} <eos>

Commas are dropped by the tokenizer; node i is token id i, then `|`, `=`, `/`, EOS, PAD, UNK.
A prompt is 3·d·(l−1) + 3 tokens, the target l + 1 (EOS included). Reward 1 iff the
response is exactly the target path followed by EOS.

On a hub or local family (`build(cfg, tokenizer=<the family's tokenizer>)`, e.g. gpt2, as
the official code's `--model gpt2`): the same text, commas kept, encoded by the family's
tokenizer (prompt with its special tokens, target without, then its EOS); the verifier
and the first-step metric decode the response and compare text (`vocab.FamilyText`). The
built-in number tokenizer stays the default (no tokenizer, or the one the tiny family
saved next to π_ref).

The trap: a model trained with teacher forcing on the target learns to follow the edge out
of the previous node and guesses the first step (the node after the source), so exact match
is ≈ 1/d while accuracy among responses whose first step is right is ≈ 1.
`extra_metrics` reports both; check both before claiming an improvement.

Splits are seeded and disjoint: no (edge set, source, goal) of the test split appears in the
train split or in `pretrain_batch`. Seeds: test random.Random(f"{seed}/test"), train
random.Random(f"{seed}/train"); `pretrain_batch` uses the rng it is given.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .base import Example, cfg_error, check_int, check_pairs, check_unknown_keys, cut_at_eos, is_int
from .offline import build_offline, checked, node_answers, task_tokens

NAME = "star_graph"
DEFAULTS: dict[str, Any] = {
    "degree": 2,
    "path_length": 5,
    "num_nodes": 20,
    "train_size": 10_000,
    "test_size": 1_000,
    "seed": 0,
}
SEP, EQ, SLASH = "|", "=", "/"

GraphKey = tuple[frozenset, int, int]


@dataclass(frozen=True)
class StarGraph:
    """One graph + query. `path` is the goal arm, source first, goal last (l nodes)."""

    edges: tuple[tuple[int, int], ...]
    source: int
    goal: int
    path: tuple[int, ...]

    def key(self) -> GraphKey:
        """Identity of graph + query; edge order does not matter."""
        return frozenset(self.edges), self.source, self.goal

    def prompt_text(self) -> str:
        edges = "|".join(f"{u},{v}" for u, v in self.edges)
        return f"{edges}/{self.source},{self.goal}="

    def to_text(self) -> str:
        """`u,v|…|u,v/source,goal=p0,…,p_{l-1}`."""
        return self.prompt_text() + ",".join(map(str, self.path))

    @classmethod
    def from_text(cls, text: str) -> StarGraph:
        """Parse `to_text` output. A prompt alone (ending at `=`) gets its path from the edges."""
        try:
            head, _, path_text = text.strip().partition("=")
            edges_text, _, query = head.partition("/")
            edges = tuple(
                (int(u), int(v)) for u, v in (e.split(",") for e in edges_text.split("|"))
            )
            source, goal = (int(x) for x in query.split(","))
        except ValueError as e:
            raise ValueError(f"not a star-graph text (u,v|...|u,v/s,g=p0,...): {text!r}") from e
        path = (
            tuple(int(x) for x in path_text.split(","))
            if path_text
            else _find_path(edges, source, goal)
        )
        return cls(edges, source, goal, path)


def _find_path(edges: Sequence[tuple[int, int]], source: int, goal: int) -> tuple[int, ...]:
    """The unique path source -> goal in a star (each non-source node has one out-edge)."""
    nxt: dict[int, list[int]] = {}
    for u, v in edges:
        nxt.setdefault(u, []).append(v)
    for first in nxt.get(source, []):
        path = [source, first]
        while path[-1] != goal and path[-1] in nxt:
            path.append(nxt[path[-1]][0])
        if path[-1] == goal:
            return tuple(path)
    raise ValueError(f"no path from {source} to {goal} in {edges}")


def generate_graph(rng: random.Random, degree: int, path_length: int, num_nodes: int) -> StarGraph:
    """G(d, l, N): source ≠ goal uniform; goal arm source, l−2 fresh nodes, goal; d−1 other
    arms of l−1 fresh nodes each; all arms disjoint; directed edges shuffled."""
    d, l = degree, path_length
    nodes = rng.sample(range(num_nodes), d * (l - 1) + 1)
    source, goal, fresh = nodes[0], nodes[1], nodes[2:]
    goal_arm = [source, *fresh[: l - 2], goal]
    arms = [goal_arm]
    rest = fresh[l - 2 :]
    for i in range(d - 1):
        arms.append([source, *rest[i * (l - 1) : (i + 1) * (l - 1)]])
    edges = [(a[j], a[j + 1]) for a in arms for j in range(l - 1)]
    rng.shuffle(edges)
    return StarGraph(tuple(edges), source, goal, tuple(goal_arm))


def num_distinct_graphs(degree: int, path_length: int, num_nodes: int) -> int:
    """How many distinct (edge set, source, goal) G(d, l, N) can produce."""
    d, l, n = degree, path_length, num_nodes
    goal_arm = n * (n - 1) * math.perm(n - 2, l - 2)
    other_arms = math.perm(n - l, (d - 1) * (l - 1)) // math.factorial(d - 1)
    return goal_arm * other_arms


def validate_cfg(cfg: Mapping) -> list[str]:
    errors: list[str] = []
    check_unknown_keys(cfg, {"name", *DEFAULTS}, errors)
    check_int(cfg, "degree", errors, minimum=2)
    check_int(cfg, "path_length", errors, minimum=2)
    check_int(cfg, "num_nodes", errors, minimum=3)
    check_int(cfg, "train_size", errors, minimum=1)
    check_int(cfg, "test_size", errors, minimum=1)
    check_int(cfg, "seed", errors)
    c = {**DEFAULTS, **cfg}
    d, l, n, test_size = c["degree"], c["path_length"], c["num_nodes"], c["test_size"]
    if all(is_int(x) for x in (d, l, n, test_size)) and d >= 2 and l >= 2:
        need = d * (l - 1) + 1
        if n < need:
            errors.append(
                cfg_error(
                    "num_nodes", n, f"must be >= degree*(path_length-1)+1 = {need} for G({d},{l})"
                )
            )
        elif 2 * test_size > (count := num_distinct_graphs(d, l, n)):
            errors.append(
                cfg_error(
                    "test_size",
                    test_size,
                    f"must be at most half the {count} distinct graphs of G({d},{l},{n}); "
                    "increase dataset.num_nodes",
                )
            )
    return errors


class StarGraphTask:
    """See the module docstring. Build with `StarGraphTask(**cfg)` or `build_task(cfg)`."""

    name = NAME

    def __init__(
        self,
        degree: int = 2,
        path_length: int = 5,
        num_nodes: int = 20,
        train_size: int = 10_000,
        test_size: int = 1_000,
        seed: int = 0,
        tokenizer: Any = None,
    ):
        checked({k: v for k, v in locals().items() if k in DEFAULTS}, validate_cfg)
        self.degree, self.path_length, self.num_nodes = degree, path_length, num_nodes
        self.train_size, self.test_size, self.seed = train_size, test_size, seed

        self.vocab, self.tokenizer, self.eos_id, self.text, self.max_new_tokens = task_tokens(
            num_nodes, (SEP, EQ, SLASH), path_length, tokenizer, drop=",", isolate="|/="
        )
        self._sep, self._eq, self._slash = (self.vocab.ids[t] for t in (SEP, EQ, SLASH))
        self.prompt_length = 3 * degree * (path_length - 1) + 3
        self._train: list[Example] | None = None
        self._test: list[Example] | None = None
        self._test_keys: set[GraphKey] | None = None

    # --- data ---------------------------------------------------------------------------

    def generate(self, rng: random.Random) -> StarGraph:
        return generate_graph(rng, self.degree, self.path_length, self.num_nodes)

    def prompt_ids(self, graph: StarGraph) -> list[int]:
        if self.text is not None:
            return self.text.prompts([graph.prompt_text()])[0]
        ids: list[int] = []
        sep = self._sep
        for u, v in graph.edges:
            ids += (u, v, sep)
        ids[-1] = self._slash  # the last edge is followed by "/" instead of "|"
        ids += (graph.source, graph.goal, self._eq)
        return ids

    def target_ids(self, graph: StarGraph) -> list[int]:
        if self.text is not None:
            return self.text.targets([path_text(graph.path)])[0]
        return [*graph.path, self.eos_id]

    def example(self, graph: StarGraph) -> Example:
        """meta: source, goal and path; the edges are in prompt_ids (see `graph_of`)."""
        return self.examples([graph])[0]

    def examples(self, graphs: Sequence[StarGraph]) -> list[Example]:
        """`example` of each graph; a family's tokenizer encodes them in one batch."""
        metas = [{"source": g.source, "goal": g.goal, "path": list(g.path)} for g in graphs]
        if self.text is None:
            return [
                Example(self.prompt_ids(g), self.target_ids(g), m) for g, m in zip(graphs, metas)
            ]
        prompts = self.text.prompts([g.prompt_text() for g in graphs])
        targets = self.text.targets([path_text(g.path) for g in graphs])
        return [Example(p, t, m) for p, t, m in zip(prompts, targets, metas)]

    def graph_of(self, example: Example) -> StarGraph:
        """Rebuild the StarGraph from an example (edges read back from the prompt ids; on a
        family's tokenizer, from the decoded prompt text)."""
        ids, m = example.prompt_ids, example.meta
        if self.text is not None:
            graph = StarGraph.from_text(self.text.decode_prompt(ids))
            return StarGraph(graph.edges, graph.source, graph.goal, tuple(m["path"]))
        edges = tuple((ids[i], ids[i + 1]) for i in range(0, len(ids) - 4, 3))
        return StarGraph(edges, m["source"], m["goal"], tuple(m["path"]))

    def _draw_outside_test(self, rng: random.Random, count: int, what: str) -> list[StarGraph]:
        test_keys = self.test_keys()
        out: list[StarGraph] = []
        tries = 0
        while len(out) < count:
            g = self.generate(rng)
            if g.key() not in test_keys:
                out.append(g)
            tries += 1
            if tries > 20 * count + 10_000:
                raise RuntimeError(
                    f"star_graph: only {len(out)}/{count} {what} graphs outside the test split "
                    f"after {tries} draws; increase dataset.num_nodes or reduce dataset.test_size"
                )
        return out

    def test_keys(self) -> set[GraphKey]:
        if self._test_keys is None:
            rng = random.Random(f"{self.seed}/test")
            graphs = [self.generate(rng) for _ in range(self.test_size)]
            self._test = self.examples(graphs)
            self._test_keys = {g.key() for g in graphs}
        return self._test_keys

    def test_examples(self) -> list[Example]:
        self.test_keys()
        assert self._test is not None
        return list(self._test)

    def train_examples(self) -> list[Example]:
        """`train_size` graphs from random.Random(f"{seed}/train"), none in the test split."""
        if self._train is None:
            rng = random.Random(f"{self.seed}/train")
            graphs = self._draw_outside_test(rng, self.train_size, "train")
            self._train = self.examples(graphs)
        return list(self._train)

    def pretrain_batch(
        self, rng: random.Random, batch_size: int
    ) -> list[tuple[list[int], list[int]]]:
        """Fresh graphs (never a test graph): (prompt ids, path + EOS) for teacher forcing."""
        graphs = self._draw_outside_test(rng, batch_size, "pretrain")
        if self.text is not None:
            return [(e.prompt_ids, e.target_ids or []) for e in self.examples(graphs)]
        return [(self.prompt_ids(g), self.target_ids(g)) for g in graphs]

    # --- verifier -----------------------------------------------------------------------

    def rewards(
        self, examples: Sequence[Example], responses: Sequence[Sequence[int]]
    ) -> list[float]:
        """1.0 iff the response is exactly the goal path, then EOS (tokens after EOS ignored)."""
        check_pairs(examples, responses)
        out = []
        for ex, resp in zip(examples, responses):
            nodes, has_eos = cut_at_eos(resp, self.eos_id)
            if self.text is not None:
                out.append(float(has_eos and self.text.decode(nodes) == path_text(ex.meta["path"])))
            else:
                out.append(float(has_eos and nodes == ex.meta["path"]))
        return out

    def answers(self, examples: Sequence[Example], responses: Sequence[Sequence[int]]) -> list[str]:
        """The generated path in text form ("3,7,12,..."), up to EOS; "" without an EOS."""
        check_pairs(examples, responses)
        return node_answers(self, responses, ",")

    def first_step_correct(self, example: Example, response: Sequence[int]) -> bool:
        """The response starts with the source and then the goal arm's first node.

        That node is the only decision in the task: every later node is the unique
        out-neighbour of the previous one. On a family's tokenizer: the decoded text's
        first two comma-separated fields.
        """
        if self.text is not None:
            nodes, _ = cut_at_eos(response, self.eos_id)
            fields = self.text.decode(nodes).split(",")
            return fields[:2] == [str(v) for v in example.meta["path"][:2]]
        return [int(t) for t in response[:2]] == example.meta["path"][:2]

    def accuracy_after_first_step(
        self, examples: Sequence[Example], responses: Sequence[Sequence[int]]
    ) -> float:
        """Exact-match accuracy among responses whose first step is right (nan if none is)."""
        check_pairs(examples, responses)
        rewards = self.rewards(examples, responses)
        kept = [
            r
            for ex, resp, r in zip(examples, responses, rewards)
            if self.first_step_correct(ex, resp)
        ]
        return sum(kept) / len(kept) if kept else float("nan")

    def extra_metrics(
        self, examples: Sequence[Example], responses: Sequence[Sequence[int]]
    ) -> dict[str, float]:
        """first_step_acc (≈ 1/d for a trapped model) and acc_after_first_step (≈ 1 for it).
        A metric with no sample to average (no responses; no right first step) is left out,
        not NaN: a stage's result must be finite, and the table shows it blank."""
        check_pairs(examples, responses)
        if not responses:
            return {}
        first = sum(self.first_step_correct(e, r) for e, r in zip(examples, responses))
        out = {"first_step_acc": first / len(responses)}
        if first:
            out["acc_after_first_step"] = self.accuracy_after_first_step(examples, responses)
        return out

    def save_tokenizer(self, path: str) -> None:
        self.tokenizer.save_pretrained(path)


def path_text(path: Sequence[int]) -> str:
    """The target's text form: "p0,p1,...,p_{l-1}" (the official format)."""
    return ",".join(map(str, path))


def build(cfg: Mapping, tokenizer: Any = None, **_: Any) -> StarGraphTask:
    """The task (`offline.build_offline`)."""
    return build_offline(StarGraphTask, cfg, tokenizer)
