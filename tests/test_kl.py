"""The KL columns of every results row (docs/ALGORITHMS.md, "KL: the three columns"):
a policy that samples a token outside π_ref's top-k gets `kl` = +inf (as it is), a finite
`kl_full` against the untruncated π_ref and its `off_support` share, and such a row commits
(an infinite value never fails a task, NaN still does:
tests/test_task_folders.py::test_an_infinite_kl_commits_the_task). The report, the matched-KL table,
the frontier plot and the aggregate read the infinite value without breaking."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from pita.models.generation import generate
from pita.models.tiny import build_tiny_llama

PAD, BOS, EOS = 0, 1, 2
VOCAB = 16
TOP_K = 3


@pytest.fixture(scope="module")
def models():
    """π_ref (a tiny random Llama) and a "trained" policy: π_ref with one token planted
    far up the output bias — a token that is never in π_ref's top-3 at the prompts used."""
    ref = build_tiny_llama(
        VOCAB,
        n_layer=1,
        d_model=16,
        n_head=2,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
        seed=0,
        initializer_range=0.3,
    )
    prompts = [[BOS, 5 + i] for i in range(6)]
    with torch.no_grad():  # the token π_ref ranks lowest on the first step of every prompt
        logits = ref(input_ids=torch.tensor(prompts)).logits[:, -1]
        planted = int(logits.sum(0).argmin())
        assert all(planted not in row.topk(TOP_K).indices.tolist() for row in logits)
    policy = copy.deepcopy(ref)
    with torch.no_grad():
        policy.lm_head.weight[planted] = 0.0
        bias = torch.zeros(VOCAB)
        bias[planted] = 50.0  # always sampled first: off π_ref's top-3 support
        policy.lm_head.bias = torch.nn.Parameter(bias)
    return ref, policy, prompts, planted


def _rows(ref, policy_model, prompts, *, is_reference):
    from pita.stages.evaluate import EvalPolicy, SamplingRule, sample_kls

    rule = SamplingRule(top_k=TOP_K, temperature=1.0, top_p=1.0)
    policy = EvalPolicy(None, policy_model, rule, is_reference=is_reference)
    out = generate(
        policy_model,
        prompts,
        max_new_tokens=3,
        batch_size=4,
        pad_token_id=PAD,
        eos_token_id=EOS,
        generator=torch.Generator().manual_seed(0),
        **rule.kwargs(),
    )
    return out, sample_kls(policy, ref, prompts, out, batch_size=4, pad_token_id=PAD)


def test_a_token_outside_the_reference_support_gives_inf_kl_and_a_finite_full_kl(models):
    from pita.eval.metrics import kl_columns

    ref, policy, prompts, planted = models
    out, samples = _rows(ref, policy, prompts, is_reference=False)
    assert all(r[0] == planted for r in out.responses)  # the plant is really sampled
    assert all(s["kl"] == math.inf and s["off_support"] for s in samples)
    assert all(math.isfinite(s["kl_full"]) and s["kl_full"] > 0 for s in samples)
    row = kl_columns(samples)
    assert row["kl"] == math.inf and row["off_support"] == 1.0
    assert math.isfinite(row["kl_full"]) and row["kl_full"] > 1.0
    # π_ref's own row under the same rule: KL 0, nothing off the support, kl_full > 0 (the
    # truncation's own KL against the untruncated π_ref)
    _, ref_samples = _rows(ref, ref, prompts, is_reference=True)
    ref_row = kl_columns(ref_samples)
    assert ref_row["kl"] == 0.0 and ref_row["off_support"] == 0.0 and ref_row["kl_full"] > 0
    # π_ref scored as if it were a trained policy gives the same numbers by teacher forcing
    _, forced = _rows(ref, copy.deepcopy(ref), prompts, is_reference=False)
    assert kl_columns(forced)["kl"] == pytest.approx(0.0, abs=1e-4)
    assert kl_columns(forced)["kl_full"] == pytest.approx(ref_row["kl_full"], abs=1e-4)


def test_kl_columns_share_and_mean():
    from pita.eval.metrics import kl_columns, sample_kl

    inside = sample_kl([-0.1, -0.2], [-0.5, -0.5], [-1.0, -1.0])
    outside = sample_kl([-0.1, -0.2], [-0.5, -math.inf], [-1.0, -9.0])
    assert inside == {"kl": pytest.approx(0.7), "kl_full": pytest.approx(1.7), "off_support": False}
    row = kl_columns([inside, inside, inside, outside])
    assert row["kl"] == math.inf and row["off_support"] == 0.25
    assert row["kl_full"] == pytest.approx((3 * 1.7 + 9.7) / 4)
    assert kl_columns([inside])["kl"] == pytest.approx(0.7)


ROWS = [
    {
        "algo": "reference",
        "dataset": "d",
        "family": "f",
        "round": 0,
        "eta": None,
        "sampling": "top-3, T=1",
        "pass@1": 0.3,
        "avg_reward": 0.3,
        "kl": 0.0,
        "kl_full": 2.0,
        "off_support": 0.0,
    },
    *[
        {
            "algo": algo,
            "dataset": "d",
            "family": "f",
            "round": 0,
            "eta": eta,
            "sampling": "top-3, T=1",
            "pass@1": 0.3 + 0.05 * eta * s,
            "avg_reward": 0.3,
            "kl": 0.2 * eta * s,
            "kl_full": 2.0 + eta,
            "off_support": 0.0,
        }
        for algo, s in (("QSharp", 1.0), ("PITA", 0.5))
        for eta in (0.0, 1.0, 2.0)
    ],
    {
        "algo": "PITA",
        "dataset": "d",
        "family": "f",
        "round": 0,
        "eta": 5.0,
        "sampling": "top-3, T=1",
        "pass@1": 0.9,
        "avg_reward": 0.9,
        "kl": math.inf,
        "kl_full": 9.0,
        "off_support": 0.1,
    },
    {
        "algo": "DPO",
        "dataset": "d",
        "family": "f",
        "round": 0,
        "eta": None,
        "sampling": "top-3, T=1",
        "pass@1": 0.2,
        "avg_reward": 0.2,
        "kl": math.inf,
        "kl_full": 30.0,
        "off_support": 0.5,
    },
]


def test_readers_of_the_kl_keep_infinite_rows_apart(tmp_path):
    """matched KL: an infinite point is off every curve (no NaN cells); frontier plot: the
    row stays on it, at the ∞ edge; aggregate: inf is the mean, its spread unknown."""
    from pita.results.aggregate import aggregate_rows, frontier_x, plot_frontier
    from pita.results.matched_kl import matched_kl_rows

    table = matched_kl_rows(ROWS)
    assert table and all(r["kl"] != math.inf for r in table)
    assert not any(isinstance(v, float) and math.isnan(v) for r in table for v in r.values())
    xs, edge = frontier_x([r["kl"] for r in ROWS])
    assert edge is not None and edge > 0.8 and xs[-1] == edge and xs[-2] == edge
    assert xs[:-2] == [r["kl"] for r in ROWS[:-2]]
    assert plot_frontier(ROWS, tmp_path / "frontier.png")
    from pita.results.aggregate import clean_rows

    kept, bad_cells, _ = clean_rows([dict(ROWS[-1], avg_reward=math.inf)])
    assert kept[0]["kl"] == math.inf and "avg_reward" not in kept[0] and bad_cells == 1
    runs = [dict(r, config="", run=str(i)) for i in range(2) for r in ROWS]
    agg = {(r["algo"], r["eta"]): r for r in aggregate_rows(runs)}
    assert agg[("DPO", None)]["kl_mean"] == math.inf and agg[("DPO", None)]["kl_std"] is None
    assert agg[("DPO", None)]["off_support_mean"] == 0.5
    assert agg[("QSharp", 2.0)]["kl_mean"] == pytest.approx(0.4)


def test_report_writes_inf_and_the_legend_names_the_columns():
    from pita.results.report import COLUMNS, legend, to_markdown

    assert COLUMNS.index("kl") < COLUMNS.index("kl_full") < COLUMNS.index("off_support")
    text = legend()
    assert "kl_full = " in text and "off_support = " in text
    assert "| inf |" in to_markdown([ROWS[-1]], ["algo", "kl"])
