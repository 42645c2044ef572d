"""The run's report: results/summary.csv, summary.md, the printed table and the plots.

Runs in the orchestrator after the DAG finished (matplotlib, no torch). One row per
(algo, dataset, family, round, eta) from every evaluate merge's `metrics.json`; the
columns of docs/DESIGN.md §6 first, then task-specific ones (e.g. `acc_after_first_step` on the
star graph, `valid_walk` and the analytic `optimum_pass@1` on goal-walk). `wall_s` is the
chain's cumulative task time (shared pretrain excluded) up to and including that round.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
from pathlib import Path

from pita.algos.registry import ALGO_NAMES
from pita.core.dag import Plan
from pita.core.paths import Artifact, RunPaths, atomic_write_text

log = logging.getLogger("pita.report")

COLUMNS = [
    "algo",
    "dataset",
    "family",
    "round",
    "eta",
    "n_prompts",
    "samples",
    "pass@1",
    "maj@k",
    "avg_reward",
    "kl",
    "kl_full",
    "off_support",
    "wall_s",
]
# What each column means: the legend the run's last lines print (one paragraph).
COLUMN_LEGEND = {
    "algo": "the algorithm (reference = the reference policy itself)",
    "dataset": "the task",
    "family": "the model family",
    "round": "the training round",
    "eta": "η, the guidance strength (- for unguided rows)",
    "n_prompts": "test prompts evaluated",
    "samples": "completions sampled in all",
    "pass@1": "mean correctness over all samples",
    "maj@k": "correctness of each prompt's majority answer",
    "avg_reward": "mean reward",
    "kl": "Monte-Carlo KL(π‖π_ref) per sequence, π_ref under the row's sampling rule"
    " (inf when a sample leaves its support)",
    "kl_full": "the same against the untruncated π_ref (always finite)",
    "off_support": "share of samples outside π_ref's support under the rule",
    "wall_s": "the chain's task seconds up to this round",
}
SE_COLUMN = "pass@1_se"  # binomial standard error of pass@1: sqrt(p (1 - p) / samples)
COLUMN_LEGEND[SE_COLUMN] = "its binomial standard error sqrt(p(1-p)/samples)"
ALGO_ORDER = list(ALGO_NAMES)  # the registry table's order


def legend(columns: list[str] | None = None) -> str:
    """One paragraph: `column` = meaning; ... for the columns that have one."""
    columns = columns if columns is not None else [*COLUMNS, SE_COLUMN]
    return (
        "Columns: "
        + "; ".join(f"{c} = {COLUMN_LEGEND[c]}" for c in columns if c in COLUMN_LEGEND)
        + "; further columns are the task's own metrics."
    )


def binomial_se(p: float, n: int) -> float | None:
    """Standard error of a proportion p measured on n samples (None without samples)."""
    if not isinstance(p, (int, float)) or not isinstance(n, (int, float)) or n <= 0:
        return None
    if math.isnan(p):
        return None
    return math.sqrt(max(0.0, p * (1 - p)) / n)


def collect_rows(plan: Plan, run_dir: Path) -> list[dict]:
    paths = RunPaths(run_dir)
    walls: dict[str, float] = {}
    for t in plan.tasks.values():
        result = paths.task(t.id).result
        if result.is_file():
            walls[t.id] = json.loads(result.read_text()).get("wall_s", 0.0)
    rows = []
    for t in plan.tasks.values():
        if t.stage != "evaluate_merge":
            continue
        metrics = paths.task(t.id).final / Artifact.METRICS
        if not metrics.is_file():
            continue
        chain_wall = sum(
            w
            for tid, w in walls.items()
            if plan.tasks[tid].chain == t.chain and plan.tasks[tid].round <= t.round
        )
        for row in json.loads(metrics.read_text()):
            row["wall_s"] = round(chain_wall, 1)
            se = binomial_se(row.get("pass@1"), row.get("samples"))
            if se is not None:
                row[SE_COLUMN] = se
            rows.append(row)
    rows.sort(
        key=lambda r: (
            r["dataset"],
            r["family"],
            ALGO_ORDER.index(r["algo"]) if r["algo"] in ALGO_ORDER else 99,
            r["round"],
            -1 if r["eta"] is None else r["eta"],
        )
    )
    return rows


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return (
            "nan" if math.isnan(value) else f"{value:.4g}" if abs(value) < 1000 else f"{value:.1f}"
        )
    return str(value)


def to_markdown(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def plot_accuracy(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["dataset"], r["family"]) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4), squeeze=False)
    for ax, (ds, fam) in zip(axes[0], groups):
        sub = [r for r in rows if r["dataset"] == ds and r["family"] == fam]
        labels, values, kls = [], [], []
        for r in sub:
            eta = "" if r["eta"] is None else f" η={_fmt(r['eta'])}"
            labels.append(f"{r['algo']} r{r['round']}{eta}")
            values.append(r["pass@1"])
            kls.append(r["kl"])
        bars = ax.bar(
            range(len(values)), values, color=[f"C{ALGO_ORDER.index(r['algo']) % 10}" for r in sub]
        )
        for bar, kl in zip(bars, kls):
            ax.text(
                bar.get_x() + bar.get_width() / 2,
                bar.get_height() + 0.01,
                f"KL {_fmt(kl)}",
                ha="center",
                fontsize=6,
                rotation=90,
            )
        ax.set_xticks(range(len(labels)), labels, rotation=75, fontsize=7)
        ax.set_ylim(0, 1.15)
        ax.set_ylabel("pass@1")
        ax.set_title(f"{ds} / {fam}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_gpu_memory(monitor_file: Path, path: Path) -> None:
    if not monitor_file.is_file():
        return
    samples = [json.loads(line) for line in monitor_file.read_text().splitlines() if line.strip()]
    if not samples:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = samples[0]["ts"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for dev in sorted({s["device"] for s in samples}):
        pts = [s for s in samples if s["device"] == dev]
        cpu = pts[0]["kind"] == "cpu"
        ys = [
            (
                s["worker_rss_mb"]
                if cpu
                else s["reserved_mb"] or (s["total_mb"] - (s["free_mb"] or s["total_mb"]))
            )
            / 1024
            for s in pts
        ]
        ax.plot(
            [s["ts"] - t0 for s in pts], ys, marker=".", label=f"{'CPU' if cpu else 'GPU'} {dev}"
        )
    ax.set_xlabel("seconds")
    ax.set_ylabel("GB (worker RSS on CPU, reserved on GPU)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(cfg, plan: Plan, run_dir: Path) -> list[dict]:
    paths = RunPaths(run_dir)
    rows = collect_rows(plan, run_dir)
    if not rows:
        return rows
    se = [SE_COLUMN] if any(SE_COLUMN in r for r in rows) else []
    extra = sorted({k for r in rows for k in r} - set(COLUMNS) - {"eval_wall_s", SE_COLUMN})
    columns = COLUMNS + se + extra
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore")
    writer.writeheader()
    for r in rows:
        writer.writerow({c: ("" if r.get(c) is None else r.get(c)) for c in columns})
    atomic_write_text(paths.results / "summary.csv", buf.getvalue())
    table = to_markdown(rows, columns)
    atomic_write_text(paths.results / "summary.md", table)
    paths.plots.mkdir(parents=True, exist_ok=True)
    plot_accuracy(rows, paths.plots / "accuracy.png")
    plot_gpu_memory(paths.gpu_monitor, paths.plots / "gpu_memory.png")
    from pita.results.aggregate import plot_frontier

    for dataset in sorted({r["dataset"] for r in rows}):  # reward–KL / pass@1–KL across η
        plot_frontier(
            [r for r in rows if r["dataset"] == dataset],
            paths.plots / f"frontier_{dataset}.png",
            title=f"{dataset} ({run_dir.name})",
        )
    log_results(cfg, rows, run_dir)
    log.info("Results (%s):\n%s", paths.results / "summary.csv", table)
    from pita.results.matched_kl import write_matched_kl

    matched = write_matched_kl(rows, paths.results)
    if matched is not None:
        log.info("Guided rows at matched KL (%s):\n%s", paths.results / "matched_kl.md", matched)
    return rows


RESULT_METRICS = ("pass@1", "maj@k", "avg_reward", "kl", "kl_full", "off_support")


def result_tag(row: dict, metric: str) -> str:
    """The tracker tag of one results cell: every column that tells rows apart (algo,
    dataset, family, sampling, η; the round is the step), so two reference rows that differ
    only by their sampling rule never share a curve. Sanitized once for every backend
    (`results/goal_walk/tiny/QSharp/top-2_T_1/eta_5/pass_at_1`)."""
    from pita.training.tracking import metric_name

    parts = ["results", row["dataset"], row["family"], row["algo"]]
    if row.get("sampling"):
        parts.append(metric_name(str(row["sampling"])))
    if row.get("eta") is not None:
        parts.append(f"eta_{_fmt(row['eta'])}")
    return metric_name("/".join(str(p) for p in parts + [metric]))


def log_results(cfg, rows: list[dict], run_dir: Path) -> None:
    """The results table to `logger.backend` (tracker "results"): one scalar per
    (dataset, family, algo, sampling, η, metric) against the round; an infinite `kl` is
    left out (trackers plot numbers; the summary says inf). A tracker that fails
    is a WARNING in run.log (`open_tracker` never raises): the summary is written anyway."""
    from pita.training.tracking import open_tracker

    if cfg is None:
        return
    tracker = open_tracker(cfg, run_dir, "results", logger=log)
    try:
        for r in rows:
            tracker.log(
                {
                    result_tag(r, m): r[m]
                    for m in RESULT_METRICS
                    if isinstance(r.get(m), (int, float)) and math.isfinite(r[m])
                },
                int(r["round"]),
            )
    finally:
        tracker.close()
