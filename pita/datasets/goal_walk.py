"""The goal-walk task: walk exactly L edges from s and end at g (the CPU default).

A fixed random directed graph (N nodes, each with exactly d distinct out-neighbours, no
self-loops, redrawn until strongly connected) is drawn from `dataset.seed`. A prompt asks
for a walk of exactly L steps from a source s to a goal g:

    prompt   START s GOAL g =          (5 tokens, no BOS)
    response v1 v2 ... vL <eos>        (L nodes, then EOS)

s is uniform over the nodes and g uniform over the nodes reachable from s in exactly L steps.
Reward 1 iff v1..vL follow edges starting at s, vL = g, and EOS comes right after vL.

The reference policy is trained on uniform random walks from s that ignore g
(`pretrain_batch`), so its ideal success probability on (s, g) is
p(s, g) = P(an L-step uniform random walk from s ends at g) = ((A/d)^L)[s, g]. The
KL-regularised optimum π* ∝ π_ref·e^{η r} then succeeds with p e^η / (1 − p + p e^η).
These oracles are methods below, so tests and reports can compare against them.

On a hub or local family (`build(cfg, tokenizer=<the family's tokenizer>)`): the prompt is
the text "START s GOAL g=" and the response "v1,v2,...,vL" in that tokenizer, then its
EOS; the verifier decodes the response and parses the node numbers (`vocab.FamilyText`).

Seeds: the graph uses random.Random(seed); test prompts random.Random(seed + 1); training
prompts, when `train_size` is set, random.Random(f"{seed}/train").
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from typing import Any

from .base import Example, cfg_error, check_int, check_pairs, check_unknown_keys, cut_at_eos, is_int
from .offline import build_offline, checked, node_answers, task_tokens

NAME = "goal_walk"
DEFAULTS: dict[str, Any] = {
    "num_nodes": 16,
    "out_degree": 2,
    "walk_length": 3,
    "seed": 0,
    "train_size": None,  # None: every distinct reachable (s, g) pair once
    "test_size": 1000,
}
MAX_GRAPH_DRAWS = 1000
MAX_EDGES = 1_000_000  # the graph is drawn in validation: keep that to seconds
DRAW_BUDGET_EDGES = 2_000_000  # edges sampled over all redraws of a large graph
START, GOAL, EQ = "START", "GOAL", "="


def draw_graph(num_nodes: int, out_degree: int, seed: int) -> list[list[int]]:
    """Adjacency lists (sorted) of a strongly connected graph with out-degree exactly d.

    Each node picks d distinct out-neighbours uniformly among the other nodes; the whole
    graph is redrawn until it is strongly connected. Raises RuntimeError after
    MAX_GRAPH_DRAWS failures (e.g. d = 1 with many nodes needs one Hamiltonian cycle).
    """
    rng = random.Random(seed)
    others = range(num_nodes - 1)  # node u's candidates, i -> i + (i >= u): no list per node
    # large graphs get fewer redraws: validation draws the graph, and must stay seconds
    draws = min(MAX_GRAPH_DRAWS, max(5, DRAW_BUDGET_EDGES // max(1, num_nodes * out_degree)))
    for _ in range(draws):
        # rng.sample picks positions from the length alone: the same draw as sampling the
        # list of the other nodes, without building it (O(d) per node, not O(n))
        adj = [
            sorted(i + (i >= u) for i in rng.sample(others, out_degree)) for u in range(num_nodes)
        ]
        if is_strongly_connected(adj):
            return adj
    raise RuntimeError(
        f"no strongly connected graph with num_nodes={num_nodes}, out_degree={out_degree} in "
        f"{draws} draws (seed {seed}); increase dataset.out_degree"
    )


def is_strongly_connected(adj: Sequence[Sequence[int]]) -> bool:
    """Every node reaches node 0 and node 0 reaches every node."""
    n = len(adj)
    radj: list[list[int]] = [[] for _ in range(n)]
    for u, vs in enumerate(adj):
        for v in vs:
            radj[v].append(u)

    def covers(graph: Sequence[Sequence[int]]) -> bool:
        seen, stack = {0}, [0]
        while stack:
            for v in graph[stack.pop()]:
                if v not in seen:
                    seen.add(v)
                    stack.append(v)
        return len(seen) == n

    return covers(adj) and covers(radj)


def walk_distribution(adj: Sequence[Sequence[int]], source: int, steps: int) -> dict[int, float]:
    """P(a uniform random walk of `steps` steps from `source` ends at v), for every v > 0."""
    dist = {source: 1.0}
    for _ in range(steps):
        nxt: dict[int, float] = {}
        for u, p in dist.items():
            share = p / len(adj[u])
            for v in adj[u]:
                nxt[v] = nxt.get(v, 0.0) + share
        dist = nxt
    return dist


def validate_cfg(cfg: Mapping) -> list[str]:
    """One-line error messages for every bad key (empty list: fine)."""
    errors: list[str] = []
    check_unknown_keys(cfg, {"name", *DEFAULTS}, errors)
    c = {**DEFAULTS, **cfg}
    check_int(cfg, "num_nodes", errors, minimum=2)
    check_int(cfg, "walk_length", errors, minimum=1)
    check_int(cfg, "seed", errors)
    check_int(cfg, "train_size", errors, minimum=1, optional=True)
    check_int(cfg, "test_size", errors, minimum=1)
    n, d = c["num_nodes"], c["out_degree"]
    if not is_int(d) or d < 1 or (is_int(n) and d >= n):
        bound = f"1 <= out_degree < num_nodes={n}" if is_int(n) else "an integer >= 1"
        errors.append(cfg_error("out_degree", d, f"must be {bound}"))
    if not errors and n * d > MAX_EDGES:
        errors.append(
            cfg_error("num_nodes", n, f"num_nodes × out_degree must be <= {MAX_EDGES:_} edges")
        )
    if not errors:
        try:
            draw_graph(n, d, c["seed"])
        except RuntimeError as e:
            errors.append(cfg_error("out_degree", d, str(e)))
    return errors


class GoalWalkTask:
    """See the module docstring. Build with `GoalWalkTask(**cfg)` or `build_task(cfg)`."""

    name = NAME

    def __init__(
        self,
        num_nodes: int = 16,
        out_degree: int = 2,
        walk_length: int = 3,
        seed: int = 0,
        train_size: int | None = None,
        test_size: int = 1000,
        tokenizer: Any = None,
    ):
        checked({k: v for k, v in locals().items() if k in DEFAULTS}, validate_cfg)
        self.num_nodes, self.out_degree, self.walk_length = num_nodes, out_degree, walk_length
        self.seed, self.train_size, self.test_size = seed, train_size, test_size

        self.graph: list[list[int]] = draw_graph(num_nodes, out_degree, seed)
        self._adj_sets = [set(vs) for vs in self.graph]
        # walk probabilities from every source; their support is the reachable set
        self._walk = [walk_distribution(self.graph, s, walk_length) for s in range(num_nodes)]
        self._reach = [sorted(w) for w in self._walk]

        self.vocab, self.tokenizer, self.eos_id, self.text, self.max_new_tokens = task_tokens(
            num_nodes, (START, GOAL, EQ), walk_length, tokenizer
        )
        self._train: list[Example] | None = None
        self._test: list[Example] | None = None

    # --- prompts --------------------------------------------------------------------

    def reachable(self, source: int) -> list[int]:
        """Nodes reachable from `source` in exactly L steps, sorted."""
        return list(self._reach[source])

    def prompt_ids(self, source: int, goal: int) -> list[int]:
        if self.text is not None:
            return self.text.prompts([f"{START} {source} {GOAL} {goal}{EQ}"])[0]
        ids = self.vocab.ids
        return [ids[START], source, ids[GOAL], goal, ids[EQ]]

    def example(self, source: int, goal: int) -> Example:
        return Example(self.prompt_ids(source, goal), None, {"source": source, "goal": goal})

    def sample_pair(self, rng: random.Random) -> tuple[int, int]:
        """s uniform over nodes, then g uniform over the nodes reachable from s in L steps."""
        s = rng.randrange(self.num_nodes)
        return s, rng.choice(self._reach[s])

    def train_examples(self) -> list[Example]:
        """Every distinct reachable (s, g) pair, ordered by (s, g); or `train_size` draws."""
        if self._train is None:
            if self.train_size is None:
                pairs = [(s, g) for s in range(self.num_nodes) for g in self._reach[s]]
            else:
                rng = random.Random(f"{self.seed}/train")
                pairs = [self.sample_pair(rng) for _ in range(self.train_size)]
            self._train = [self.example(s, g) for s, g in pairs]
        return list(self._train)

    def test_examples(self) -> list[Example]:
        """`test_size` draws from the prompt distribution, seeded by seed + 1."""
        if self._test is None:
            rng = random.Random(self.seed + 1)
            self._test = [self.example(*self.sample_pair(rng)) for _ in range(self.test_size)]
        return list(self._test)

    def pretrain_batch(
        self, rng: random.Random, batch_size: int
    ) -> list[tuple[list[int], list[int]]]:
        """(prompt, uniform random walk from s + EOS) pairs; the walk ignores g on purpose."""
        out = []
        for _ in range(batch_size):
            s, g = self.sample_pair(rng)
            walk, cur = [], s
            for _ in range(self.walk_length):
                cur = rng.choice(self.graph[cur])
                walk.append(cur)
            out.append((self.prompt_ids(s, g), [*walk, self.eos_id]))
        if self.text is not None:  # the same draws, re-encoded as the family's text
            targets = self.text.targets([",".join(map(str, t[:-1])) for _, t in out])
            out = [(p, t) for (p, _), t in zip(out, targets)]
        return out

    # --- verifier ---------------------------------------------------------------------

    def _follows_edges(self, source: int, nodes: Sequence[int]) -> bool:
        prev = source
        for v in nodes:
            # a non-node token (START, pad, ...) never lies in an adjacency set
            if v not in self._adj_sets[prev]:
                return False
            prev = v
        return True

    def _nodes(self, response: Sequence[int]) -> tuple[list[int], bool]:
        """(the nodes before the first EOS, whether there was one). On a family's tokenizer
        the decoded text's comma-separated numbers; text that is not one gives [-1]."""
        nodes, has_eos = cut_at_eos(response, self.eos_id)
        if self.text is None:
            return nodes, has_eos
        fields = self.text.decode(nodes).split(",")
        if not all(f.isdigit() and f == str(int(f)) for f in fields):
            return [-1], has_eos
        return [int(f) for f in fields], has_eos

    def _valid_walk(self, ex: Example, response: Sequence[int]) -> tuple[bool, list[int]]:
        """(exactly L edge-following nodes from s, then EOS; the nodes before EOS)."""
        nodes, has_eos = self._nodes(response)
        ok = has_eos and len(nodes) == self.walk_length
        return ok and self._follows_edges(ex.meta["source"], nodes), nodes

    def rewards(
        self, examples: Sequence[Example], responses: Sequence[Sequence[int]]
    ) -> list[float]:
        """1.0 iff the response is L edge-following nodes from s ending at g, then EOS."""
        check_pairs(examples, responses)
        out = []
        for ex, resp in zip(examples, responses):
            ok, nodes = self._valid_walk(ex, resp)
            out.append(float(ok and nodes[-1] == ex.meta["goal"]))
        return out

    def answers(self, examples: Sequence[Example], responses: Sequence[Sequence[int]]) -> list[str]:
        """The walk as text ("3 5 7"), up to the first EOS; "" without an EOS."""
        check_pairs(examples, responses)
        return node_answers(self, responses, " ")

    def extra_metrics(
        self, examples: Sequence[Example], responses: Sequence[Sequence[int]]
    ) -> dict[str, float]:
        """valid_walk: fraction of responses that are L edge-following nodes then EOS."""
        check_pairs(examples, responses)
        if not responses:
            return {"valid_walk": float("nan")}
        valid = sum(self._valid_walk(ex, r)[0] for ex, r in zip(examples, responses))
        return {"valid_walk": valid / len(responses)}

    def save_tokenizer(self, path: str) -> None:
        self.tokenizer.save_pretrained(path)

    # --- analytic oracles -------------------------------------------------------------

    def reference_success_prob(self, source: int, goal: int) -> float:
        """p(s, g): chance that the ideal reference (uniform over out-edges, ignoring g) wins."""
        return self._walk[source].get(goal, 0.0)

    def _expect(self, f, examples: Sequence[Example] | None) -> float:
        """E f(p(s, g)) over the prompt distribution, or the mean over `examples`."""
        if examples is not None:
            if not examples:
                raise ValueError("no examples to average over")
            ps = [self.reference_success_prob(e.meta["source"], e.meta["goal"]) for e in examples]
            return sum(map(f, ps)) / len(ps)
        total = 0.0
        for s in range(self.num_nodes):
            reach = self._reach[s]
            total += sum(f(self._walk[s][g]) for g in reach) / len(reach)
        return total / self.num_nodes

    def reference_pass_at_1(self, examples: Sequence[Example] | None = None) -> float:
        """Expected pass@1 of the ideal reference: E_s E_{g ~ U(reach(s))} p(s, g).

        Every L-step walk from s ends inside reach(s), so Σ_{g ∈ reach(s)} p(s, g) = 1 and the
        inner mean is exactly 1/|reach(s)|: this equals E_s[1/|reach(s)|] (docs/ALGORITHMS.md),
        even though p(s, g) itself is not uniform over g. With `examples`, the mean of
        p(s, g) over those prompts instead (e.g. the actual test set).
        """
        return self._expect(lambda p: p, examples)

    def optimal_pass_at_1(self, eta: float, examples: Sequence[Example] | None = None) -> float:
        """Pass@1 of π* ∝ π_ref·e^{η r}: E[p e^η / (1 − p + p e^η)]; η = 0 gives the reference."""
        return self._expect(lambda p: _tilted_success(p, eta), examples)

    def optimal_kl(self, eta: float, examples: Sequence[Example] | None = None) -> float:
        """Per-sequence KL(π*‖π_ref) = E[η·p* − log(1 − p + p e^η)], p* the tilted success."""
        return self._expect(lambda p: eta * _tilted_success(p, eta) - _log_z(p, eta), examples)


def _log_z(p: float, eta: float) -> float:
    """log(1 − p + p e^η), computed without overflow for large η."""
    if p <= 0.0:
        return 0.0
    if p >= 1.0:
        return eta
    a, b = math.log1p(-p), math.log(p) + eta
    hi = max(a, b)
    return hi + math.log(math.exp(a - hi) + math.exp(b - hi))


def _tilted_success(p: float, eta: float) -> float:
    """p e^η / (1 − p + p e^η)."""
    if p <= 0.0:
        return 0.0
    return math.exp(math.log(p) + eta - _log_z(p, eta))


def build(cfg: Mapping, tokenizer: Any = None, **_: Any) -> GoalWalkTask:
    """The task (`offline.build_offline`)."""
    return build_offline(GoalWalkTask, cfg, tokenizer)
