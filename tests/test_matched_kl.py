"""Guided rows read at matched KL (pita/results/matched_kl.py) against hand-computed numbers."""

from __future__ import annotations

import csv

import pytest

from pita.results.matched_kl import interpolate, matched_kl_rows, write_matched_kl


def _row(algo: str, eta: float, kl: float, pass1: float, **kw) -> dict:
    return {
        "algo": algo,
        "dataset": "goal_walk",
        "family": "tiny",
        "round": 0,
        "eta": eta,
        "kl": kl,
        "pass@1": pass1,
    } | kw


ROWS = [
    _row("reference", 0.0, 0.0, 0.16),
    _row("QSharp", 0.0, 0.0, 0.5),
    _row("QSharp", 2.0, 1.0, 0.7),
    _row("QSharp", 10.0, 3.0, 0.9),
    _row("PITA", 0.0, 0.0, 0.5),
    _row("PITA", 10.0, 2.0, 0.6),
    _row("DPO", None, 1.5, 0.3),  # one point: not a curve, not in the table
]


def test_interpolation_is_piecewise_linear_and_never_extrapolates():
    points = [(0.0, 0.5), (1.0, 0.7), (3.0, 0.9)]
    assert interpolate(points, 2.0) == pytest.approx(0.8)
    assert interpolate(points, 0.5) == pytest.approx(0.6)
    assert interpolate(points, 3.0) == pytest.approx(0.9)
    assert interpolate(points, 3.5) is None
    assert interpolate(points, -0.1) is None


def test_table_reads_each_guided_curve_at_the_kls_the_guided_rows_reached():
    table = matched_kl_rows(ROWS)
    assert [r["kl"] for r in table] == [1.0, 2.0, 3.0]
    by_kl = {r["kl"]: r for r in table}
    assert by_kl[1.0]["QSharp"] == pytest.approx(0.7)
    assert by_kl[1.0]["PITA"] == pytest.approx(0.55)
    assert by_kl[2.0]["QSharp"] == pytest.approx(0.8)
    assert by_kl[2.0]["PITA"] == pytest.approx(0.6)
    assert by_kl[3.0]["QSharp"] == pytest.approx(0.9)
    assert by_kl[3.0]["PITA"] is None  # past PITA's largest KL
    assert all("DPO" not in r and "reference" not in r for r in table)
    assert [r["kl"] for r in matched_kl_rows(ROWS, levels=[0.5])] == [0.5]


def test_no_table_without_two_guided_curves(tmp_path):
    one_curve = [r for r in ROWS if r["algo"] != "PITA"]
    assert matched_kl_rows(one_curve) == []
    assert write_matched_kl(one_curve, tmp_path) is None
    assert not (tmp_path / "matched_kl.md").exists()
    # groups are kept apart: PITA on another dataset does not pair with QSharp here
    other = [r | {"dataset": "star_graph"} if r["algo"] == "PITA" else r for r in ROWS]
    assert matched_kl_rows(other) == []


def test_files_written_and_aggregated_means_are_read(tmp_path):
    table = write_matched_kl(ROWS, tmp_path)
    assert table is not None and "QSharp pass@1" in table and "| 3 | - | 0.9 |" in table
    with open(tmp_path / "matched_kl.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["kl"] for r in rows] == ["1.0", "2.0", "3.0"] and rows[2]["PITA"] == ""
    means = [
        {k: v for k, v in r.items() if k not in ("kl", "pass@1")}
        | {"kl_mean": r["kl"], "pass@1_mean": r["pass@1"], "config": "lr=1"}
        for r in ROWS
    ]
    [first, *_] = matched_kl_rows(means)
    assert first["config"] == "lr=1" and first["QSharp"] == pytest.approx(0.7)
