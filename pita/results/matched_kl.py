"""Guided algorithms compared at matched KL: `results/matched_kl.{csv,md}`.

Two value-guided rows at the same η are not comparable: one guide may move the policy
much further from π_ref than the other (goal-walk: Q# at η = 10 spends KL 1.85, a V-type
head at η = 10 only 1.24). The papers compare methods at equal KL(π‖π_ref). Each guided
algorithm's η sweep (`evaluation.etas`) gives a curve of (KL, pass@1) points; this module
reads every curve at common KL levels — by default the KLs the guided rows of that group
reached — interpolating linearly between the two nearest measured points and never
extrapolating past an algorithm's largest measured KL (the cell stays empty).

Groups are (config, dataset, family, round): a single run's rows, or `aggregate`'s
(`<metric>_mean` columns; the config label keeps sweeps apart). Only guided algorithms
(`pita.algos.registry.GUIDED`) have curves; DPO / GRPO rows are one point each and stay
in the main table and the frontier plot. Orchestrator side: no torch.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from typing import Any

from pita.algos.registry import ALGO_NAMES, GUIDED

GROUP = ("dataset", "family", "round", "sampling")  # curves under one sampling rule only
METRIC = "pass@1"


def _value(row: dict[str, Any], metric: str) -> float | None:
    """A single run's `<metric>` or an aggregate's `<metric>_mean`; None when missing or
    not finite: a row whose `kl` is +inf (a sample off π_ref's support under the rule;
    docs/ALGORITHMS.md, "KL: the three columns") is on no curve."""
    v = row.get(f"{metric}_mean", row.get(metric))
    if isinstance(v, (int, float)) and math.isfinite(v):
        return float(v)
    return None


def curves(rows: Sequence[dict[str, Any]]) -> dict[tuple, dict[str, list[tuple[float, float]]]]:
    """{(config, dataset, family, round, sampling): {algo: [(kl, pass@1), ...] sorted by kl}} of the
    guided algorithms' rows."""
    out: dict[tuple, dict[str, list[tuple[float, float]]]] = {}
    for r in rows:
        kl, y = _value(r, "kl"), _value(r, METRIC)
        if r.get("algo") not in GUIDED or kl is None or y is None:
            continue
        key = (r.get("config") or "",) + tuple(r.get(k) for k in GROUP)
        out.setdefault(key, {}).setdefault(r["algo"], []).append((kl, y))
    for by_algo in out.values():
        for points in by_algo.values():
            points.sort()
    return out


def interpolate(points: Sequence[tuple[float, float]], x: float) -> float | None:
    """Piecewise-linear y at x along points sorted by x; None outside [first x, last x]."""
    if not points or x < points[0][0] or x > points[-1][0]:
        return None
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]  # a single point at exactly x


def matched_kl_rows(
    rows: Sequence[dict[str, Any]], levels: Sequence[float] | None = None
) -> list[dict[str, Any]]:
    """One row per (group, KL level) with each guided algorithm's pass@1 at that KL, for
    groups where at least two guided algorithms have a curve (≥ 2 points). Levels: `levels`,
    or the positive KLs measured on those curves (each algorithm then has its own
    points exactly, and the others are read between theirs)."""
    out = []
    for key, by_algo in sorted(curves(rows).items(), key=lambda kv: tuple(map(str, kv[0]))):
        usable = {a: p for a, p in by_algo.items() if len(p) >= 2}
        if len(usable) < 2:
            continue
        grid = (
            sorted(set(levels))
            if levels is not None
            else sorted({kl for p in usable.values() for kl, _ in p if kl > 0})
        )
        algos = [a for a in ALGO_NAMES if a in usable]
        for level in grid:
            row: dict[str, Any] = dict(zip(("config",) + GROUP, key))
            row["kl"] = level
            row.update({a: interpolate(usable[a], level) for a in algos})
            out.append(row)
    return out


def _columns(rows: Sequence[dict[str, Any]]) -> list[str]:
    show_config = any(r.get("config") for r in rows)
    algos = [a for a in ALGO_NAMES if any(a in r for r in rows)]
    return (["config"] if show_config else []) + list(GROUP) + ["kl"] + algos


def to_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The table: one column per guided algorithm (pass@1 at that KL; `-` past its curve)."""
    columns = _columns(rows)
    head = [c if c in GROUP or c == "config" else f"{c} pass@1" for c in columns]
    head[columns.index("kl")] = "KL(π‖π_ref)"
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        cells = []
        for c in columns:
            v = r.get(c)
            cells.append("-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def to_csv(rows: Sequence[dict[str, Any]]) -> str:
    columns = _columns(rows)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore")
    writer.writeheader()
    for r in rows:
        writer.writerow({c: "" if r.get(c) is None else r.get(c) for c in columns})
    return buf.getvalue()


def write_matched_kl(rows: Sequence[dict[str, Any]], folder: Any) -> str | None:
    """Write `matched_kl.csv` / `matched_kl.md` into `folder` (atomically) when some group
    has two guided curves; returns the markdown table, or None when there is nothing to
    compare."""
    from pathlib import Path

    from pita.core.paths import atomic_write_text

    table_rows = matched_kl_rows(rows)
    if not table_rows:
        return None
    folder = Path(folder)
    atomic_write_text(folder / "matched_kl.csv", to_csv(table_rows))
    table = to_markdown(table_rows)
    atomic_write_text(folder / "matched_kl.md", table)
    return table
