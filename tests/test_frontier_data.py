"""The frontier plot's data apart from its drawing (`aggregate.frontier_lines`): rows with a
KL become one line per (config, algo, family, round), in the report's algorithm order,
each line's points sorted by KL, a metric's missing values left out."""

from __future__ import annotations

import math

from pita.experiment.aggregate import frontier_lines


def test_rows_become_lines_sorted_by_kl_with_aggregated_errors():
    rows = [
        {
            "algo": "QSharp",
            "family": "tiny",
            "round": 0,
            "eta": 5.0,
            "kl": 0.9,
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
            "config": "b",
            "kl_mean": 0.4,
            "kl_std": 0.1,
            "avg_reward_mean": 0.6,
            "avg_reward_std": 0.05,
        },
    ]
    lines = frontier_lines(rows)
    assert [line.label for line in lines] == ["QSharp tiny r0", "DPO tiny r1 [b]"]
    qsharp, dpo = lines
    assert [p.kl for p in qsharp.points["avg_reward"]] == [0.0, 0.9]
    assert [p.eta for p in qsharp.points["avg_reward"]] == [0.0, 5.0]
    assert [p.y for p in qsharp.points["pass@1"]] == [0.7]  # the NaN is left out
    (point,) = dpo.points["avg_reward"]
    assert (point.kl, point.kl_std, point.y, point.y_std) == (0.4, 0.1, 0.6, 0.05)
    assert dpo.points["pass@1"] == []
    assert frontier_lines([{"algo": "DPO", "family": "t", "round": 0, "avg_reward": 1}]) == []
