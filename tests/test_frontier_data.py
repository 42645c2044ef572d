"""The frontier plot's data apart from its drawing (`aggregate.frontier_data`): rows with a
KL become one line per (config, algo, family, round), in the report's algorithm order,
each line's points sorted by KL, a metric's missing values left out, KL = ∞ at its edge."""

from __future__ import annotations

import math

from pita.results.aggregate import frontier_data


def test_rows_become_lines_sorted_by_kl_with_aggregated_errors():
    rows = [
        {
            "algo": "QSharp",
            "family": "tiny",
            "round": 0,
            "eta": 5.0,
            "kl": math.inf,
            "avg_reward": 0.8,
            "pass@1": 0.7,
        },
        {
            "algo": "QSharp",
            "family": "tiny",
            "round": 0,
            "eta": 0.0,
            "kl": 0.0,
            "avg_reward": 0.5,
            "pass@1": math.nan,
        },
        {"algo": "reference", "family": "tiny", "round": 0, "kl": math.nan, "avg_reward": 0.5},
        {
            "algo": "DPO",
            "family": "tiny",
            "round": 1,
            "config": "lr=1",
            "kl_mean": 0.4,
            "kl_std": 0.1,
            "avg_reward_mean": 0.6,
            "avg_reward_std": 0.05,
        },
    ]
    data = frontier_data(rows)
    assert data is not None and data.configs == ["lr=1"]
    assert [line.label for line in data.lines] == ["QSharp tiny r0", "DPO tiny r1 c1"]
    qsharp, dpo = data.lines
    assert data.inf_edge is not None and data.inf_edge > 0.4  # right of every finite KL
    assert [p.x for p in qsharp.points["avg_reward"]] == [0.0, data.inf_edge]
    assert [p.eta for p in qsharp.points["avg_reward"]] == [0.0, 5.0]
    assert [p.y for p in qsharp.points["pass@1"]] == [0.7]  # the NaN is left out
    (point,) = dpo.points["avg_reward"]
    assert (point.x, point.x_err, point.y, point.y_err) == (0.4, 0.1, 0.6, 0.05)
    assert dpo.points["pass@1"] == []
    assert frontier_data([{"algo": "DPO", "family": "t", "round": 0, "avg_reward": 1}]) is None
