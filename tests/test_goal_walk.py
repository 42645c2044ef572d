"""The goal-walk task: graph, prompts, reward, oracles, tokenizer, config validation."""

import itertools
import json
import random
import subprocess
import sys

import pytest

from pita.datasets import Task, build_task, validate_dataset_cfg
from pita.datasets.goal_walk import GoalWalkTask, draw_graph, is_strongly_connected
from pita.datasets.vocab import build_tokenizer
from pita.models.loading import load_tokenizer


@pytest.fixture(scope="module")
def task() -> GoalWalkTask:
    return build_task({"name": "goal_walk"})  # N=16, d=2, L=3, seed 0


def reachable_bruteforce(adj, s, steps):
    frontier = {s}
    for _ in range(steps):
        frontier = {v for u in frontier for v in adj[u]}
    return sorted(frontier)


@pytest.mark.parametrize("n,d,seed", [(16, 2, 0), (16, 2, 3), (20, 2, 0), (8, 3, 1), (5, 4, 0)])
def test_graph_shape(n, d, seed):
    adj = draw_graph(n, d, seed)
    assert len(adj) == n
    for u, vs in enumerate(adj):
        assert len(vs) == d and len(set(vs)) == d, "exactly d distinct out-neighbours"
        assert u not in vs, "no self-loops"
        assert all(0 <= v < n for v in vs)
    assert is_strongly_connected(adj)
    assert draw_graph(n, d, seed) == adj, "the seed fixes the graph"


def test_strong_connectivity_check():
    assert is_strongly_connected([[1], [2], [0]])
    assert not is_strongly_connected([[1], [0], [0]])  # nothing reaches 2


def test_reachability(task):
    for s in range(task.num_nodes):
        assert task.reachable(s) == reachable_bruteforce(task.graph, s, task.walk_length)
        probs = [task.reference_success_prob(s, g) for g in task.reachable(s)]
        assert sum(probs) == pytest.approx(1.0)
        assert all(p > 0 for p in probs)
    s = 0
    outside = [g for g in range(task.num_nodes) if g not in task.reachable(s)]
    assert all(task.reference_success_prob(s, g) == 0.0 for g in outside)


def test_prompt_format_and_tokenizer(task):
    ex = task.example(3, task.reachable(3)[0])
    text = task.tokenizer.decode(ex.prompt_ids)
    assert text == f"START 3 GOAL {ex.meta['goal']} ="
    assert task.tokenizer(text)["input_ids"] == ex.prompt_ids, (
        "no BOS, ids agree with the tokenizer"
    )
    assert task.max_new_tokens == task.walk_length + 1
    assert isinstance(task, Task)
    tok = task.tokenizer
    assert tok.padding_side == "left" and tok.pad_token_id is not None
    assert tok.eos_token_id == task.eos_id and tok.bos_token_id is None
    assert [tok.convert_tokens_to_ids(str(v)) for v in range(task.num_nodes)] == list(range(16))


def test_splits(task):
    train = task.train_examples()
    pairs = [(e.meta["source"], e.meta["goal"]) for e in train]
    expected = [(s, g) for s in range(16) for g in task.reachable(s)]
    assert pairs == expected and len(set(pairs)) == len(pairs)
    test = task.test_examples()
    assert len(test) == 1000
    assert all(e.meta["goal"] in task.reachable(e.meta["source"]) for e in test)
    assert [e.meta for e in test] == [e.meta for e in GoalWalkTask().test_examples()]
    assert all(e.target_ids is None for e in train + test)
    json.dumps([e.meta for e in test])
    sized = GoalWalkTask(train_size=50)
    assert len(sized.train_examples()) == 50


def walk_ids(task, *nodes):
    return [*nodes, task.eos_id]


def test_rewards(task):
    s = 0
    a = task.graph[s][0]
    b = task.graph[a][1]
    c = task.graph[b][0]
    ex = task.example(s, c)
    wrong_goal = next(g for g in task.reachable(s) if g != c)
    not_edge = next(v for v in range(16) if v not in task.graph[s])
    eos, pad = task.eos_id, task.tokenizer.pad_token_id
    cases = {
        "valid walk to g": (walk_ids(task, a, b, c), 1.0),
        "valid walk, junk after EOS ignored": ([a, b, c, eos, 5, pad, pad], 1.0),
        "wrong end": (walk_ids(task, a, b, c), 0.0),  # scored against ex_wrong below
        "invalid edge": (walk_ids(task, not_edge, b, c), 0.0),
        "missing EOS": ([a, b, c], 0.0),
        "too long": (walk_ids(task, a, b, c, task.graph[c][0]), 0.0),
        "too short": (walk_ids(task, a, b), 0.0),
        "non-node token": (walk_ids(task, a, b, task.vocab.ids["GOAL"]), 0.0),
        "empty": ([], 0.0),
    }
    examples = [task.example(s, wrong_goal) if k == "wrong end" else ex for k in cases]
    got = task.rewards(examples, [r for r, _ in cases.values()])
    assert dict(zip(cases, got)) == {k: v for k, (_, v) in cases.items()}
    answers = task.answers(examples, [r for r, _ in cases.values()])
    assert answers[0] == f"{a} {b} {c}" and answers[4] == ""
    metrics = task.extra_metrics(examples, [r for r, _ in cases.values()])
    assert metrics["valid_walk"] == pytest.approx(3 / 9)  # the two valid walks + wrong end
    with pytest.raises(ValueError, match="responses"):
        task.rewards(examples, [])


def test_analytic_reference(task):
    p = task.reference_pass_at_1()
    inverse_reach = sum(1 / len(task.reachable(s)) for s in range(16)) / 16
    assert p == pytest.approx(inverse_reach), "E_s E_g p(s,g) equals E_s 1/|reach(s)|"
    assert p == pytest.approx(0.1532, abs=5e-4)  # docs/ALGORITHMS.md: ≈ 0.15
    assert task.optimal_pass_at_1(0.0) == pytest.approx(p)
    values = [task.optimal_pass_at_1(eta) for eta in (0, 1, 2, 5, 10, 50, 800)]
    assert all(a < b for a, b in itertools.pairwise(values[:-1])), "increasing in η"
    assert values[-2] <= values[-1] <= 1.0, "no overflow at large η"
    assert values[2] == pytest.approx(0.557, abs=0.01)  # η = 2, cf. measured 0.52–0.55
    assert task.optimal_kl(0.0) == pytest.approx(0.0)
    assert 1.8 < task.optimal_kl(10.0) < 2.0  # docs/ALGORITHMS.md: optimum ≈ 1.9–1.96
    test = task.test_examples()
    assert task.reference_pass_at_1(test) == pytest.approx(p, abs=0.02)


def test_ideal_random_walk_policy_matches_analytic(task):
    """A python 'policy' walking uniformly over out-edges (ignoring g) gets the oracle pass@1."""
    rng = random.Random(123)
    examples = [task.example(*task.sample_pair(rng)) for _ in range(4000)]
    responses = []
    for ex in examples:
        cur, walk = ex.meta["source"], []
        for _ in range(task.walk_length):
            cur = rng.choice(task.graph[cur])
            walk.append(cur)
        responses.append([*walk, task.eos_id])
    rewards = task.rewards(examples, responses)
    assert sum(rewards) / len(rewards) == pytest.approx(task.reference_pass_at_1(), abs=0.03)
    assert task.extra_metrics(examples, responses)["valid_walk"] == 1.0


def test_pretrain_batch_is_valid_random_walks(task):
    rng = random.Random(0)
    batch = task.pretrain_batch(rng, 300)
    assert len(batch) == 300
    examples = []
    for prompt, target in batch:
        assert len(prompt) == 5 and len(target) == task.walk_length + 1
        examples.append(task.example(prompt[1], prompt[3]))
        assert prompt[3] in task.reachable(prompt[1])
    assert task.extra_metrics(examples, [t for _, t in batch])["valid_walk"] == 1.0
    # the walk ignores the goal: success rate is the reference's, not 1
    rate = sum(task.rewards(examples, [t for _, t in batch])) / 300
    assert rate < 0.4
    assert task.pretrain_batch(random.Random(0), 300) == batch, "deterministic given the rng"


def test_tokenizer_save_load_round_trip(task, tmp_path):
    task.save_tokenizer(str(tmp_path / "tok"))
    tok = load_tokenizer(str(tmp_path / "tok"))
    assert tok.padding_side == "left"
    assert (tok.pad_token_id, tok.eos_token_id) == (task.tokenizer.pad_token_id, task.eos_id)
    ids = [*task.example(1, task.reachable(1)[0]).prompt_ids, 4, 5, 6, task.eos_id]
    assert tok.convert_tokens_to_ids(tok.convert_ids_to_tokens(ids)) == ids
    assert tok(tok.decode(ids))["input_ids"] == ids
    batch = tok(["START 1 GOAL 2 =", "1 2"], padding=True)["input_ids"]
    assert batch[1][:3] == [tok.pad_token_id] * 3, "left padding"


def test_build_tokenizer_rejects_bad_vocab():
    with pytest.raises(ValueError, match="duplicate"):
        build_tokenizer(["a", "a"])
    with pytest.raises(ValueError, match="whitespace"):
        build_tokenizer(["a b"])


@pytest.mark.parametrize(
    "cfg,key",
    [
        ({"num_nodes": 1}, "num_nodes"),
        ({"num_nodes": "16"}, "num_nodes"),
        ({"out_degree": 0}, "out_degree"),
        ({"out_degree": 16}, "out_degree"),
        ({"out_degree": 1}, "out_degree"),  # never strongly connected in 1000 draws
        ({"walk_length": 0}, "walk_length"),
        ({"test_size": 0}, "test_size"),
        ({"train_size": -1}, "train_size"),
        ({"seed": 1.5}, "seed"),
        ({"walk_len": 3}, "walk_len"),
    ],
)
def test_validation_names_the_key(cfg, key):
    with pytest.raises(ValueError) as e:
        validate_dataset_cfg({"name": "goal_walk", **cfg})
    msg = str(e.value)
    assert msg.startswith(f"dataset.{key}=") and "\n" not in msg


def test_validation_of_name_and_defaults():
    validate_dataset_cfg({"name": "goal_walk", "train_size": None})
    with pytest.raises(ValueError, match=r"^dataset.name='nope': must be one of goal_walk"):
        validate_dataset_cfg({"name": "nope"})


def test_package_import_loads_no_torch():
    code = (
        "import sys, pita.datasets as d; d.validate_dataset_cfg({'name': 'goal_walk'}); "
        "d.validate_dataset_cfg({'name': 'star_graph'}); d.validate_dataset_cfg({'name': 'gsm8k'}); "
        "print([m for m in ('torch', 'transformers', 'datasets') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_build_from_omegaconf():
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"name": "goal_walk", "num_nodes": 20, "train_size": None, "seed": 3})
    task = build_task(cfg)
    assert task.num_nodes == 20 and task.seed == 3 and task.train_size is None
    assert task.reference_pass_at_1() == pytest.approx(0.1415, abs=5e-4)


def test_the_optimum_column_is_only_on_rows_whose_eta_is_its_scale(task):
    """issue 45: `optimum_pass@1` (π* ∝ π_ref·e^{η r}) is on the reference's rows and on the
    guided rows whose offset is that optimum's soft-Q (guidance.mode bernoulli, mle: Q#,
    Q#-HF); PITA's `expectation*` modes scale η otherwise, so its rows have none (0.558 at
    η = 2 beside PITA's 0.684 read as a bound PITA beat); unguided rows have none."""
    from omegaconf import OmegaConf

    from pita.experiment.cli_extras import conf_dir
    from pita.stages.evaluate import _oracle

    examples = task.test_examples()[:50]
    assert _oracle(task, examples, "reference", 0.0) == task.reference_pass_at_1(examples)
    assert _oracle(task, examples, "QSharp", 2.0, "bernoulli") == task.optimal_pass_at_1(
        2.0, examples
    )
    assert _oracle(task, examples, "QSharp-HF", 2.0, "mle") is not None
    pita_mode = OmegaConf.load(conf_dir() / "algo" / "pita.yaml").guidance.mode  # PITA's own
    assert pita_mode.startswith("expectation")
    assert _oracle(task, examples, "PITA", 2.0, pita_mode) is None
    assert _oracle(task, examples, "GRPO", None) is None
