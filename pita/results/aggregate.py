"""Combine the results of several runs: mean and spread over seeds, reward–KL frontiers.

After a sweep (`python run_parallel.py -m dataset.seed=0,1,2`) every job has its own run
folder with `results/summary.csv`. `aggregate(run_dirs, out_dir)` reads them and writes

- `aggregate.csv` / `aggregate.md`: one row per (config, algo, dataset, family, round, η,
  sampling rule)
  with `n_runs` and, per metric, `<metric>_mean`, `<metric>_std` (sample std, ddof=1) and
  `<metric>_min` / `<metric>_max`; `aggregate.md` shows `mean ± std`. `config` is what
  the jobs' overrides set apart from seeds (empty when only seeds vary), so a sweep over
  `seed × lr` gives one group per lr, each averaged over its seeds.
- `matched_kl.csv` / `matched_kl.md`: the guided algorithms' mean pass@1 read at common
  KL levels along their η curves (pita/results/matched_kl.py), when two have curves.
- `plots/frontier_<dataset>.png`: avg reward against KL(π‖π_ref) and pass@1 against KL,
  one line per (algorithm, family, round) through its η values, with ±std error bars: the
  figure these papers are read by. `plot_frontier` draws the same for a single run.

`AggregateCallback` is a Hydra callback (conf/config.yaml registers it): at the end of a
multirun it aggregates the sweep folder (`outputs/<name>/multirun/<timestamp>/`).
By hand: `python -m pita.results.aggregate outputs/goal_walk/multirun/<ts> [more run dirs]
[--out DIR] [--trust-group]` (default: a new `aggregate-<time>/` folder inside the first
path, beside it when that path is a run folder).

It reads run folders under the run's own rules (pita/core/safe_files.py): no links inside
them, yours (or your group's with `--trust-group`, as `system.trust_group=true`), capped
reads; a refusal is one line and exit 2, as is an `--out` that is not a folder you can
write (a file, `/proc/...`, `/dev/full`, an immutable folder) or lies inside a run folder
(aggregate never writes a byte into a run). Cells that are not finite numbers (nan, inf,
text, a non-numeric round) are skipped with one WARNING that counts them.
Orchestrator side: csv + matplotlib, no torch.
"""

from __future__ import annotations

import csv
import io
import logging
import math
import os
import re
import statistics
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pita.algos.registry import ALGO_NAMES
from pita.core.errors import ConfigError
from pita.core.paths import RunPaths
from pita.core.safe_files import check_folder, read_control_text

log = logging.getLogger("pita.aggregate")

# every column that tells rows apart: two reference rows (full and top-2 sampling) of one
# run are two rows, never pooled into one with a doubled n_runs
KEYS = ("config", "algo", "dataset", "family", "round", "eta", "sampling")
NOT_METRICS = {"algo", "dataset", "family", "round", "eta", "sampling", "n_prompts", "samples"}
SEED_KEY = re.compile(r"(^|\.)seed$")
ALGO_ORDER = list(ALGO_NAMES)  # the registry table's order


def _number(text: str) -> float | str | None:
    if text is None or text == "":
        return None
    try:
        return float(text)
    except ValueError:
        return text


def find_run_dirs(paths: Iterable[Path | str]) -> list[Path]:
    """Run folders (those with results/summary.csv) at or directly below each path."""
    found: list[Path] = []
    for p in map(Path, paths):
        if RunPaths(p).summary_csv.is_file():
            found.append(p)
            continue
        found += (
            sorted(
                (c for c in p.iterdir() if RunPaths(c).summary_csv.is_file()),
                key=lambda c: (len(c.name), c.name),
            )
            if p.is_dir()
            else []
        )
    return found


def check_run_folder(run_dir: Path, trust_group: bool = False) -> None:
    """The run's own rules for a folder aggregate reads (pita/core/safe_files.py): the run
    folder and its results/ are yours (or your group's with `trust_group`), nobody else
    can write them, and results/ is no link. The path you typed may itself be a link (your
    choice), never a folder found below it. Raises UnsafeFile (one line, exit 2)."""
    for folder in (run_dir, RunPaths(run_dir).results):
        if folder == run_dir and folder.is_symlink():
            check_folder(folder.resolve(), trust_group)
            continue
        check_folder(folder, trust_group)


def config_label(run_dir: Path, trust_group: bool = False) -> str:
    """What this job's command line set besides seeds (Hydra's .hydra/overrides.yaml)."""
    path = RunPaths(run_dir).saved_overrides
    if not path.is_file() and not path.is_symlink():
        return ""
    from omegaconf import OmegaConf

    text = read_control_text(path, trust_group=trust_group)  # a link or a foreign file: exit 2
    try:
        overrides = OmegaConf.to_container(OmegaConf.create(text)) or []
    except Exception as exc:  # a hand-edited or torn overrides.yaml: say so, keep going
        log.warning("%s: unreadable (%s); its runs are grouped as one config", path, exc)
        return f"<unreadable {path.name}>"
    if not isinstance(overrides, list):
        return f"<unreadable {path.name}>"
    keep = []
    for o in overrides:
        key = str(o).split("=", 1)[0].lstrip("+~")
        if SEED_KEY.search(key) or key.startswith(
            ("hydra", "executor.", "system.devices", "dry_run")
        ):
            continue
        keep.append(str(o))
    return " ".join(sorted(keep))


def read_rows(run_dir: Path, trust_group: bool = False) -> list[dict[str, Any]]:
    """The rows of a run's results/summary.csv, read as a control file (no link, yours,
    at most 16 MB), each tagged with its run and config. A file that is not a summary
    (random bytes, another table) gives no rows and a WARNING."""
    path = RunPaths(run_dir).summary_csv
    text = read_control_text(path, trust_group=trust_group)
    try:
        reader = csv.DictReader(io.StringIO(text, newline=""))
        rows = [{k: _number(v) for k, v in r.items() if isinstance(k, str)} for r in reader]
        header = set(reader.fieldnames or ())
    except csv.Error as exc:
        log.warning("%s is not a csv (%s); skipped", path, exc)
        return []
    if not set(SUMMARY_KEYS) <= header:
        log.warning(
            "%s is not a results summary (no %s column); skipped",
            path,
            ", ".join(sorted(set(SUMMARY_KEYS) - header)),
        )
        return []
    label = config_label(run_dir, trust_group)
    for r in rows:
        r["config"] = label
        r["run"] = str(run_dir)
    return rows


SUMMARY_KEYS = ("algo", "dataset", "family", "round", "eta")  # what every summary row has


def clean_rows(rows: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], int, int]:
    """(rows, bad cells, bad rows): a metric cell that is not a number pita writes (nan, inf
    outside `kl`, text in a column of numbers) is dropped from its row; a row whose round is not a whole number, whose η is
    neither empty nor a finite number, or which names no algo / dataset / family is
    dropped whole. The caller says how many in one WARNING."""
    numeric = {k for r in rows for k, v in r.items() if _finite(v)}  # text columns stay text
    kept, bad_cells, bad_rows = [], 0, 0
    for r in rows:
        rnd, eta = r.get("round"), r.get("eta")
        names_ok = all(
            isinstance(r.get(k), str) and r.get(k) for k in ("algo", "dataset", "family")
        )
        if (
            not names_ok
            or not _finite(rnd)
            or float(rnd) != int(rnd)  # type: ignore[arg-type]
            or not (eta is None or _finite(eta))
        ):
            bad_rows += 1
            continue
        row = dict(r, round=int(rnd))  # type: ignore[arg-type]
        for k, v in r.items():
            if k in NOT_METRICS or k in KEYS or k == "run" or v is None:
                continue
            if isinstance(v, str) and k in numeric or not _finite(v) and _bad_number(k, v):
                del row[k]
                bad_cells += 1
        kept.append(row)
    return kept, bad_cells, bad_rows


def skipped_line(bad_cells: int, bad_rows: int, n_runs: int) -> str:
    """The one WARNING line that counts what `clean_rows` skipped."""
    parts = [f"{bad_cells} cell(s) that are not numbers pita writes (nan, inf, text)"] * bool(
        bad_cells
    )
    parts += [f"{bad_rows} row(s) whose round, η or names are not valid"] * bool(bad_rows)
    return f"skipped {' and '.join(parts)} in the summaries of {n_runs} run(s)"


INFINITE_OK = ("kl",)  # kl = inf is a result (samples off π_ref's support: ALGORITHMS.md)


def _bad_number(column: str, v: Any) -> bool:
    """A float cell that is no result: nan anywhere, ±inf outside INFINITE_OK (+inf only)."""
    if not isinstance(v, float):
        return False
    return math.isnan(v) or not (column in INFINITE_OK and v == math.inf)


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _sortable(value: Any) -> tuple[int, float, str]:
    """Numbers before text, each in its own order: a hand-edited csv with `eta` = "x" in
    one run must not make the sort compare str with float."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return (0, float(value), "")
    return (1, 0.0, str(value))


def aggregate_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Group by KEYS; mean / std / min / max of every numeric metric over the group's runs."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(tuple(r.get(k) for k in KEYS), []).append(r)
    metrics = sorted(
        {
            k
            for r in rows
            for k, v in r.items()
            if isinstance(v, float) and k not in NOT_METRICS and k not in KEYS
        }
    )
    out = []
    for key, members in groups.items():
        row: dict[str, Any] = dict(zip(KEYS, key))
        row["n_runs"] = len({m["run"] for m in members})
        for m in metrics:
            values = [x[m] for x in members if isinstance(x.get(m), float) and not math.isnan(x[m])]
            if not values:
                continue
            finite = all(math.isfinite(v) for v in values)  # an infinite KL: docs/ALGORITHMS.md
            row[f"{m}_mean"] = statistics.fmean(values)
            row[f"{m}_std"] = (
                (statistics.stdev(values) if len(values) > 1 else 0.0) if finite else None
            )
            row[f"{m}_min"], row[f"{m}_max"] = min(values), max(values)
        out.append(row)
    out.sort(
        key=lambda r: (
            _sortable(r["config"]),
            _sortable(r["dataset"]),
            _sortable(r["family"]),
            ALGO_ORDER.index(r["algo"]) if r["algo"] in ALGO_ORDER else 99,
            _sortable(r["round"]),
            _sortable(-1 if r["eta"] is None else r["eta"]),
            _sortable(r.get("sampling")),
        )
    )
    return out


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def to_markdown(rows: Sequence[dict[str, Any]]) -> str:
    metrics = [m[:-5] for m in (rows[0] if rows else {}) if m.endswith("_mean")]
    metrics = [m for m in ("pass@1", "maj@k", "avg_reward", "kl") if m in metrics] + [
        m for m in metrics if m not in ("pass@1", "maj@k", "avg_reward", "kl")
    ]
    show_config = any(r["config"] for r in rows)
    keys = [k for k in KEYS if k != "config" or show_config]
    head = keys + ["n_runs"] + metrics
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        cells = [_fmt(r.get(k)) for k in keys] + [str(r["n_runs"])]
        cells += [
            f"{_fmt(r.get(f'{m}_mean'))} ± {_fmt(r.get(f'{m}_std'))}" if f"{m}_mean" in r else "-"
            for m in metrics
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def to_csv(rows: Sequence[dict[str, Any]]) -> str:
    columns = (
        list(KEYS) + ["n_runs"] + sorted({k for r in rows for k in r} - set(KEYS) - {"n_runs"})
    )
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=columns)
    w.writeheader()
    for r in rows:
        w.writerow({c: "" if r.get(c) is None else r.get(c) for c in columns})
    return buf.getvalue()


OUTLIER_GAP = 0.5  # an empty stretch this large a share of the KL axis squashes the rest
OUTLIER_SHARE = 0.25  # ... when at most this share of the points lies beyond it


def kl_axis(kls: Sequence[float]) -> tuple[str, float | None]:
    """("linear", None), or ("symlog", linthresh) when a few KLs dwarf the rest (DPO's 18.7
    next to guided rows at 0-2.6 leaves every other curve in a sliver of the plot): the
    axis is linear up to the largest of the rest (`linthresh`) and logarithmic above it, so
    the curves stay readable and the outliers stay on the plot."""
    values = sorted(abs(k) for k in kls if isinstance(k, (int, float)) and math.isfinite(k))
    if len(values) < 4 or values[-1] <= values[0]:
        return "linear", None
    gap, cut = max((b - a, i) for i, (a, b) in enumerate(zip(values, values[1:])))
    beyond = len(values) - 1 - cut
    if gap < OUTLIER_GAP * (values[-1] - values[0]) or beyond > OUTLIER_SHARE * len(values):
        return "linear", None
    return "symlog", max(1e-2, values[cut])


INF_EDGE = 1.25  # an infinite KL is drawn at this multiple of the largest finite one


def frontier_x(kls: Sequence[float]) -> tuple[list[float], float | None]:
    """The frontier plot's x of each KL: finite values as they are, +inf (a row with
    samples off π_ref's support under its rule; docs/ALGORITHMS.md, "KL: the three
    columns") at the `∞` edge right of every finite one; the edge is None without one."""
    finite = [k for k in kls if math.isfinite(k)]
    if len(finite) == len(kls):
        return list(kls), None
    edge = INF_EDGE * max([abs(k) for k in finite] + [0.8])
    return [k if math.isfinite(k) else edge for k in kls], edge


def plot_frontier(rows: Sequence[dict[str, Any]], path: Path, title: str = "") -> bool:
    """avg reward vs KL and pass@1 vs KL; one line per (config, algo, family, round) through
    its η points. Rows are aggregated (`<m>_mean` / `<m>_std`) or a single run's (`<m>`).
    False when no row has a KL."""
    fig = frontier_figure(rows, title)
    if fig is None:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return True


def _point(r: dict, m: str) -> tuple[float | None, float]:
    """(value, std) of metric `m` in an aggregated row (`<m>_mean`) or a single run's."""
    if f"{m}_mean" in r:
        return r.get(f"{m}_mean"), r.get(f"{m}_std") or 0.0
    v = r.get(m)
    number = isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)
    return (v if number else None), 0.0  # +inf KL: drawn at the ∞ edge (frontier_x)


@dataclass
class FrontierPoint:
    x: float  # the KL drawn (+inf at the ∞ edge, `frontier_x`)
    x_err: float
    y: float
    y_err: float
    eta: Any  # the row's η (None for a policy's row)


@dataclass
class FrontierLine:
    """One (config, algo, family, round) through its η points, by KL, per metric."""

    label: str  # `algo family rN`, `cK` for the K-th config
    style: dict[str, str]  # colour by algorithm, marker and dash by config (`_line_style`)
    points: dict[str, list[FrontierPoint]]  # metric -> the points with a value


@dataclass
class Frontier:
    """The frontier plot's data, apart from its drawing (`frontier_figure`)."""

    lines: list[FrontierLine]
    configs: list[str]  # the configs table's entries (cN = configs[N-1])
    kls: list[float]  # every row's KL (the axis scale, `kl_axis`)
    inf_edge: float | None  # where KL = ∞ is drawn, None without one


FRONTIER_METRICS = (("avg_reward", "avg reward"), ("pass@1", "pass@1"))


def frontier_data(rows: Sequence[dict[str, Any]]) -> Frontier | None:
    """The rows with a KL as lines, in the report's algorithm order (None without one)."""
    points = [r for r in rows if _point(r, "kl")[0] is not None]
    if not points:
        return None
    kl_x, inf_edge = frontier_x([_point(r, "kl")[0] or 0.0 for r in points])
    x_of = {id(r): x for r, x in zip(points, kl_x)}
    groups: dict[tuple, list[dict]] = {}
    for r in points:
        groups.setdefault((r.get("config") or "", r["algo"], r["family"], r["round"]), []).append(r)
    order = sorted(
        groups,
        key=lambda k: (k[0], ALGO_ORDER.index(k[1]) if k[1] in ALGO_ORDER else 99, k[2], k[3]),
    )
    configs = sorted({k[0] for k in order if k[0]})
    lines = []
    for i, (config, algo, family, rnd) in enumerate(order):
        members = sorted(groups[config, algo, family, rnd], key=lambda r: _point(r, "kl")[0] or 0.0)
        label = f"{algo} {family} r{rnd}" + (f" c{configs.index(config) + 1}" if config else "")
        by_metric = {
            metric: [
                FrontierPoint(
                    x_of[id(r)],
                    _point(r, "kl")[1],
                    *_point(r, metric),  # type: ignore[arg-type]  # a value: filtered below
                    r.get("eta"),
                )
                for r in members
                if _point(r, metric)[0] is not None
            ]
            for metric, _ in FRONTIER_METRICS
        }
        style = _line_style(i, algo, configs.index(config) if config else -1)
        lines.append(FrontierLine(label, style, by_metric))
    kls = [k for r in points if (k := _point(r, "kl")[0]) is not None]
    return Frontier(lines, configs, kls, inf_edge)


def frontier_figure(rows: Sequence[dict[str, Any]], title: str = ""):
    """The frontier figure (matplotlib Figure, no pyplot state) of `frontier_data`, or None
    when no row has a KL. The legend and the configs table sit in columns of their own
    beside the two plots (`legend_panel`, `config_panel`)."""
    data = frontier_data(rows)
    if data is None:
        return None
    from matplotlib.figure import Figure

    table = _config_lines(data.configs)
    legend_cols = _chunks(len(data.lines), LEGEND_ROWS_PER_COLUMN)
    table_cols = _chunks(len(table), CONFIG_ROWS_PER_COLUMN) if table else 0
    n_rows = max(-(-len(data.lines) // legend_cols), -(-len(table) // max(table_cols, 1)))
    widths = [5.5, 5.5, LEGEND_COLUMN_IN * legend_cols] + [CONFIG_COLUMN_IN] * table_cols
    fig = Figure(figsize=(sum(widths), max(4.2, 0.16 * n_rows + 1.4)))
    fig.set_layout_engine("constrained")
    grid = fig.add_gridspec(1, len(widths), width_ratios=widths)
    axes = [fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1])]
    handles, labels = [], []
    for line in data.lines:
        drawn = None
        for ax, (metric, _) in zip(axes, FRONTIER_METRICS):
            if line.points[metric]:
                drawn = _draw_line(ax, line, line.points[metric], len(data.lines))
        if drawn is not None:
            handles.append(drawn)
            labels.append(line.label.replace("$", r"\$"))
    scale, linthresh = kl_axis(data.kls)
    for ax, (_, label) in zip(axes, FRONTIER_METRICS):
        _kl_axis_of(ax, scale, linthresh, data.inf_edge)
        ax.set_ylabel(label)
    legend_panel(fig.add_subplot(grid[0, 2]), handles, labels)
    if table:
        config_panel([fig.add_subplot(grid[0, 3 + i]) for i in range(table_cols)], table)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def _draw_line(ax, line: FrontierLine, pts: list[FrontierPoint], n_lines: int):
    """One line's points with their error bars (and η labels while they stay readable)."""
    drawn = ax.errorbar(
        [p.x for p in pts],
        [p.y for p in pts],
        xerr=[p.x_err for p in pts],
        yerr=[p.y_err for p in pts],
        ms=4,
        lw=1.2,
        capsize=2,
        linestyle=line.style["linestyle"] if len(pts) > 1 else "none",
        color=line.style["color"],
        marker=line.style["marker"],
    )
    for p in pts:
        if p.eta is not None and n_lines <= ETA_LABELS_UP_TO:
            ax.annotate(
                f"η={_fmt(p.eta)}",
                (p.x, p.y),
                fontsize=6,
                xytext=(3, 3),
                textcoords="offset points",
            )
    return drawn


def _kl_axis_of(ax, scale: str, linthresh: float | None, inf_edge: float | None) -> None:
    """The KL axis: the ∞ edge marked (its points inside the frame), symlog when a few KLs
    dwarf the rest, labelled and gridded."""
    if inf_edge is not None:
        ax.axvline(inf_edge, color="grey", lw=0.8, ls=":")
        ax.annotate(
            "KL = ∞ (off π_ref's support)",
            (inf_edge, 0.02),
            xycoords=("data", "axes fraction"),
            rotation=90,
            fontsize=6,
            ha="right",
            color="grey",
        )
    if scale == "symlog":
        ax.set_xscale("symlog", linthresh=linthresh)
    if inf_edge is not None:  # the ∞ points inside the frame, not on its edge
        ax.set_xlim(right=inf_edge * (1.5 if scale == "symlog" else 1.08))
    ax.set_xlabel(
        "KL(π ‖ π_ref)" + (f" (symlog: linear below {linthresh:.2g})" if scale == "symlog" else "")
    )
    ax.grid(alpha=0.3)


LEGEND_COLUMN_IN = 2.0  # inches per column of legend entries ("QSharp tiny r1 c12")
LEGEND_ROWS_PER_COLUMN = 28  # then another column of entries
CONFIG_COLUMN_IN = 3.6  # inches per column of the configs table
CONFIG_ROWS_PER_COLUMN = 36
CONFIG_WRAP = 56  # characters per line of the configs table
ETA_LABELS_UP_TO = 12  # more lines than this: η labels would only cover each other
MARKERS = "os^Dv<>pPX*h"


def _chunks(n: int, per: int) -> int:
    return max(1, -(-n // per))


def _line_style(i: int, algo: str, config_index: int) -> dict[str, str]:
    """Colour by algorithm (as every other plot of pita), marker and dash by config, so
    two configs of one algorithm stay apart without reading the legend's text."""
    color = f"C{(ALGO_ORDER.index(algo) if algo in ALGO_ORDER else i) % 10}"
    c = max(config_index, 0)
    return {
        "color": color,
        "marker": MARKERS[c % len(MARKERS)],
        "linestyle": ("-", "--", ":", "-.")[(c // len(MARKERS)) % 4],
    }


def _config_lines(configs: Sequence[str]) -> list[str]:
    """`c1   lr=0.1 dataset.x=3`, wrapped to CONFIG_WRAP characters, one entry per config;
    empty when every run has the same config."""
    import textwrap

    out = []
    for j, config in enumerate(configs, 1):
        wrapped = textwrap.wrap(config, CONFIG_WRAP - 5, break_on_hyphens=False) or [""]
        out.append(f"c{j:<3d} {wrapped[0]}")
        out += [f"     {w}" for w in wrapped[1:]]
    return out


def legend_panel(ax, handles: list, labels: list[str]) -> None:
    """The legend in an axes of its own beside the plots, short labels (algo family round,
    `cN` for a config), as many columns as it needs: never over a curve, however many
    runs are compared."""
    ax.set_axis_off()
    ax.legend(
        handles,
        labels,
        loc="upper left",
        fontsize=7,
        ncol=_chunks(len(handles), LEGEND_ROWS_PER_COLUMN),
        frameon=False,
        borderaxespad=0.0,
        handlelength=2.4,
    )


def config_panel(axes: Sequence, table: list[str]) -> None:
    """The table naming each `cN` of the legend (its overrides besides seeds), in columns
    of CONFIG_ROWS_PER_COLUMN lines; text as typed (no mathtext: `$` stays `$`)."""
    per = -(-len(table) // len(axes))
    for i, ax in enumerate(axes):
        ax.set_axis_off()
        head = ["configs (overrides besides seeds):"] if i == 0 else [""]
        ax.text(
            0,
            1,
            "\n".join(head + table[i * per : (i + 1) * per]),
            transform=ax.transAxes,
            va="top",
            ha="left",
            fontsize=6.5,
            family="monospace",
            parse_math=False,
        )


def aggregate(
    paths: Iterable[Path | str],
    out_dir: Path | str | None = None,
    trust_group: bool = False,
) -> list[dict[str, Any]]:
    """Aggregate the runs at/below `paths` into `out_dir` (default: the first path).
    Raises ConfigError (one line) for a run folder the run's rules refuse or an `out_dir`
    that is not a folder it may write (`check_out_dir`)."""
    folders = [Path(p) for p in paths]
    run_dirs = find_run_dirs(folders)
    if not run_dirs:
        log.info("aggregate: no results/summary.csv at or below %s", ", ".join(map(str, folders)))
        return []
    out = Path(out_dir) if out_dir is not None else folders[0]
    for run_dir in run_dirs:
        check_run_folder(run_dir, trust_group)
    check_out_dir(out, run_dirs)
    read = [r for d in run_dirs for r in read_rows(d, trust_group)]
    cleaned, bad_cells, bad_rows = clean_rows(read)
    if bad_cells or bad_rows:
        log.warning("%s", skipped_line(bad_cells, bad_rows, len(run_dirs)))
    if not cleaned:
        log.info("aggregate: no readable row in %d run(s); nothing written", len(run_dirs))
        return []
    rows = aggregate_rows(cleaned)
    try:
        table = write_aggregate(rows, out)
    except OSError as exc:
        raise ConfigError(f"--out {out}: cannot write there ({_os_error(exc)})") from None
    log.info("Aggregate of %d run(s) (%s):\n%s", len(run_dirs), out / "aggregate.csv", table)
    return rows


def write_aggregate(rows: Sequence[dict[str, Any]], out: Path) -> str:
    """aggregate.{csv,md}, the frontier plots and matched_kl.{csv,md} into `out`,
    each atomically; returns the markdown table."""
    from pita.core.paths import atomic_write_text
    from pita.results.matched_kl import write_matched_kl

    atomic_write_text(out / "aggregate.csv", to_csv(rows))
    table = to_markdown(rows)
    atomic_write_text(out / "aggregate.md", table)
    for dataset in sorted({r["dataset"] for r in rows}):
        plot_frontier(
            [r for r in rows if r["dataset"] == dataset],
            out / "plots" / f"frontier_{dataset}.png",
            title=f"{dataset}: mean ± std over {max(r['n_runs'] for r in rows)} run(s)",
        )
    matched = write_matched_kl(rows, out)
    if matched is not None:
        log.info("Guided rows at matched KL, means (%s):\n%s", out / "matched_kl.md", matched)
    return table


SYSTEM_FOLDERS = ("/proc", "/sys", "/dev")  # kernel file systems: never an output folder


def _os_error(exc: OSError) -> str:
    where = f": {exc.filename}" if exc.filename else ""
    return f"{exc.strerror or exc}{where}"


def _is_run_folder(folder: Path) -> bool:
    """A pita run folder: what a run writes first (its saved config, plan or journal)."""
    paths = RunPaths(folder)
    return any(p.is_file() for p in (paths.saved_config, paths.plan, paths.journal))


def check_out_dir(out: Path, run_dirs: Sequence[Path]) -> None:
    """One ConfigError line unless `out` is a folder aggregate may write: not a file or a
    device, not under /proc, /sys or /dev, not inside any run folder (a run's own results
    are the run's, whether or not it is aggregated), not writable by others nor a link below your own folders
    (safe_files), and writable (a probe file is created and removed: this catches an
    immutable folder or a read-only file system, which `os.access` does not for root)."""
    import tempfile

    real = Path(os.path.realpath(out))
    if any(real == Path(s) or Path(s) in real.parents for s in SYSTEM_FOLDERS):
        raise ConfigError(f"--out {out}: a system folder ({real}); choose a folder of yours")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: not a folder; choose a folder (it is created if absent)")
    inside = next((p for p in (real, *real.parents) if _is_run_folder(p)), None)
    inside = inside or next(
        (r for r in run_dirs if Path(os.path.realpath(r)) in (real, *real.parents)), None
    )
    if inside is not None:  # any run's, not only the runs aggregated (issue 43)
        raise ConfigError(
            f"--out {out}: inside the run folder {inside}; aggregate never writes into "
            f"a run, choose a folder outside it"
        )
    check_folder(real)  # no foreign or world-writable output folder
    if (real / "plots").exists() or (real / "plots").is_symlink():
        check_folder(real / "plots")
    try:
        real.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=real, prefix=".aggregate-probe-"):
            pass
    except OSError as exc:  # the probe's own name says nothing: the folder and the cause
        raise ConfigError(f"--out {out}: cannot write there ({exc.strerror or exc})") from None


try:  # Hydra is always installed with pita; the import is guarded for plain-python use only
    from hydra.experimental.callback import Callback as _HydraCallback
except ImportError:  # pragma: no cover
    _HydraCallback = object  # type: ignore[misc,assignment]


LAST_SWEEP: dict[str, Any] = {}  # the launching process's view of its last sweep


JOB_EXIT_CODE = "exit_code"  # a remote job's exit code file (pita/experiment/cli.py writes it)
WATCH_INTERVAL_S = 2.0


class SweepWatcher:
    """Prints a line when a job of a sweep that runs elsewhere (submitit, SLURM) starts and
    when it ends: the launcher itself is silent until every job is done. Hydra's job
    callbacks run inside the job, so the launching process polls the sweep folder instead:
    a job's folder appears when it starts, its `exit_code` file when it ends."""

    def __init__(self, sweep_dir: Path, interval_s: float = WATCH_INTERVAL_S, out=None):
        self.sweep_dir = Path(sweep_dir)
        self.interval_s = interval_s
        self.out = out or (lambda line: print(line, flush=True))
        self.started: set[str] = set()
        self.finished: set[str] = set()
        self._stop: Any = None
        self._thread: Any = None

    def _jobs(self) -> list[Path]:
        try:
            found = [p for p in self.sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()]
        except OSError:  # not created yet
            return []
        return sorted(found, key=lambda p: int(p.name))

    def poll(self) -> list[str]:
        """Report the jobs that started or finished since the last poll."""
        lines = []
        for job in self._jobs():
            if job.name not in self.started:
                self.started.add(job.name)
                lines.append(f"job {job.name} started: {job}")
            code_file = job / JOB_EXIT_CODE
            if job.name not in self.finished and code_file.is_file():
                try:
                    code = code_file.read_text().strip() or "?"
                except OSError:
                    continue
                self.finished.add(job.name)
                lines.append(f"job {job.name} finished (exit {code})")
        for line in lines:
            self.out(line)
        return lines

    def start(self) -> None:
        import threading

        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pita-sweep-watch", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - progress lines must never break the sweep
                log.debug("sweep watcher poll failed", exc_info=True)

    def stop(self) -> None:
        """Stop polling; one last poll reports the jobs that ended since the previous one."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            self._thread = None
        self.poll()


SWEEP_WATCHER: list[SweepWatcher | None] = [None]  # the launching process's running watcher


def _runs_elsewhere(config: Any) -> bool:
    target = str(getattr(getattr(config.hydra, "launcher", None), "_target_", "") or "")
    return bool(target) and not target.endswith("BasicLauncher")


class AggregateCallback(_HydraCallback):
    """Hydra callback: aggregate the sweep folder once every job of a multirun finished.
    Jobs that ran elsewhere (SLURM, submitit) left their exit code in `<job>/exit_code`;
    the worst one becomes the sweep's exit code (pita/experiment/cli.py). While such jobs
    run, a `SweepWatcher` prints a line per job start and end."""

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        if _runs_elsewhere(config):  # a local sweep's jobs print their own lines
            watcher = SweepWatcher(Path(str(config.hydra.sweep.dir)))
            watcher.started = {p.name for p in watcher._jobs()}  # an earlier sweep's jobs
            watcher.finished = set(watcher.started)
            watcher.start()
            SWEEP_WATCHER[0] = watcher  # not on self: submitit pickles the callbacks

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        watcher, SWEEP_WATCHER[0] = SWEEP_WATCHER[0], None
        if watcher is not None:
            watcher.stop()
        sweep_dir = Path(str(config.hydra.sweep.dir))
        codes = []
        for f in sweep_dir.glob(f"*/{JOB_EXIT_CODE}"):
            try:
                codes.append(int(f.read_text().strip()))
            except (OSError, ValueError):
                codes.append(1)
        LAST_SWEEP.update(sweep_dir=str(sweep_dir), worst_exit_code=max(codes, default=0))
        try:
            rows = aggregate([sweep_dir])
            if rows:
                print(f"Aggregate over the sweep: {sweep_dir / 'aggregate.md'}")
        except ConfigError as exc:  # a refused folder: its one line, not a traceback
            log.error("aggregating %s: %s", sweep_dir, exc)
        except Exception as exc:  # noqa: BLE001 - a failed aggregate must not fail the sweep
            log.exception("aggregating %s failed: %s", sweep_dir, exc)


def default_out_dir(first: Path) -> Path:
    """Where `python -m pita.results.aggregate` writes without --out: a new folder of its
    own beside the runs, so the sweep's own aggregate.md is never replaced; beside a run
    folder given alone, never inside it."""
    import time

    base = first.parent if RunPaths(first).summary_csv.is_file() else first
    return base / f"aggregate-{time.strftime('%Y-%m-%d_%H-%M-%S')}"


class _ConsoleFormat(logging.Formatter):
    """Plain lines; a WARNING or ERROR says so."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return f"{record.levelname}: {text}" if record.levelno >= logging.WARNING else text


def main(argv: list[str] | None = None) -> int:
    """Exit 0 (written), 1 (no summary found), 2 (one line: a refused folder or --out)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(
            "usage: python -m pita.results.aggregate SWEEP_OR_RUN_DIR [MORE ...] [--out DIR]"
            " [--trust-group]\n"
            "  writes aggregate.{csv,md}, matched_kl.{csv,md} and plots/ into DIR\n"
            "  (default: a new aggregate-<time>/ in SWEEP_DIR, or beside RUN_DIR; never into a\n"
            "  run folder nor over a sweep's own files)\n"
            "  --trust-group: read run folders of your group too (as system.trust_group=true)"
        )
        return 0 if args else 2
    trust_group = "--trust-group" in args
    args = [a for a in args if a != "--trust-group"]
    out = None
    if "--out" in args:
        i = args.index("--out")
        if i + 1 >= len(args):
            print("error: --out needs a folder", file=sys.stderr)
            return 2
        out = Path(args[i + 1])
        del args[i : i + 2]
    if not args:
        print("error: name a sweep or run folder to aggregate", file=sys.stderr)
        return 2
    if out is not None and (out / "aggregate.md").exists() and find_run_dirs([out]):
        print(
            f"error: --out {out} holds the sweep's own aggregate.md; choose another folder",
            file=sys.stderr,
        )
        return 2
    handler = logging.StreamHandler()
    handler.setFormatter(_ConsoleFormat())
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    out = out if out is not None else default_out_dir(Path(args[0]))
    try:
        return 0 if aggregate(args, out, trust_group=trust_group) else 1
    except ConfigError as exc:  # UnsafeFile too: one line, as run_parallel.py
        for line in exc.messages:  # this tool's switch for a group's runs is --trust-group
            line = line.replace("needs system.trust_group=true", "needs --trust-group")
            print(f"error: {line}", file=sys.stderr)
        return 2
    except OSError as exc:  # a folder vanished or a read failed while aggregating
        print(f"error: {_os_error(exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
