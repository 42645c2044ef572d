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
  KL levels along their η curves (pita/experiment/matched_kl.py), when two have curves.
- `plots/frontier_<dataset>.png`: avg reward against KL(π‖π_ref) and pass@1 against KL,
  one line per (algorithm, family, round) through its η values, with ±std error bars: the
  figure these papers are read by. `plot_frontier` draws the same for a single run.

`AggregateCallback` is a Hydra callback (conf/config.yaml registers it): at the end of a
multirun it aggregates the sweep folder (`outputs/<name>/multirun/<timestamp>/`).
By hand: `python -m pita.experiment.aggregate outputs/goal_walk/multirun/<ts> [more run dirs]
[--out DIR]` (default: a new `aggregate-<time>/` folder inside the first path).
Orchestrator side: csv + matplotlib, no torch.
"""

from __future__ import annotations

import csv
import io
import logging
import math
import re
import statistics
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pita.algos.registry import ALGO_NAMES
from pita.core.paths import RunPaths

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


def config_label(run_dir: Path) -> str:
    """What this job's command line set besides seeds (Hydra's .hydra/overrides.yaml)."""
    path = RunPaths(run_dir).saved_overrides
    if not path.is_file():
        return ""
    from omegaconf import OmegaConf

    try:
        overrides = OmegaConf.to_container(OmegaConf.load(path)) or []
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


def read_rows(run_dir: Path) -> list[dict[str, Any]]:
    with open(RunPaths(run_dir).summary_csv, newline="") as f:
        rows = [{k: _number(v) for k, v in r.items()} for r in csv.DictReader(f)]
    label = config_label(run_dir)
    for r in rows:
        r["config"] = label
        r["run"] = str(run_dir)
    return rows


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
            values = [x[m] for x in members if isinstance(x.get(m), float) and math.isfinite(x[m])]
            if not values:
                continue
            row[f"{m}_mean"] = statistics.fmean(values)
            row[f"{m}_std"] = statistics.stdev(values) if len(values) > 1 else 0.0
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


def _value(r: dict, m: str) -> tuple[float | None, float]:
    """(mean, std) of metric `m` in an aggregated row (`<m>_mean` / `<m>_std`) or a single
    run's (`<m>`, std 0); mean None when the row has no finite value."""
    if f"{m}_mean" in r:
        return r.get(f"{m}_mean"), r.get(f"{m}_std") or 0.0
    v = r.get(m)
    finite = isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v))
    return (v if finite else None), 0.0


@dataclass
class FrontierPoint:
    kl: float
    kl_std: float
    y: float
    y_std: float
    eta: Any  # the row's η (None for a policy's row)


@dataclass
class FrontierLine:
    """One (config, algo, family, round) through its η points, per metric, by KL."""

    label: str
    color: str
    points: dict[str, list[FrontierPoint]]  # metric -> points


FRONTIER_METRICS = (("avg_reward", "avg reward"), ("pass@1", "pass@1"))


def frontier_lines(rows: Sequence[dict[str, Any]]) -> list[FrontierLine]:
    """The frontier's data: the rows with a KL grouped into lines (in the report's algorithm
    order), each line's points sorted by KL, per metric those with a value."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if _value(r, "kl")[0] is not None:
            key = (r.get("config") or "", r["algo"], r["family"], r["round"])
            groups.setdefault(key, []).append(r)

    def order(key: tuple) -> tuple:
        config, algo, family, rnd = key
        return config, ALGO_ORDER.index(algo) if algo in ALGO_ORDER else 99, family, rnd

    lines = []
    for i, key in enumerate(sorted(groups, key=order)):
        config, algo, family, rnd = key
        members = sorted(groups[key], key=lambda r: _value(r, "kl")[0] or 0.0)
        points = {
            metric: [
                FrontierPoint(*_value(r, "kl"), *_value(r, metric), r.get("eta"))  # type: ignore[arg-type]
                for r in members
                if _value(r, metric)[0] is not None
            ]
            for metric, _ in FRONTIER_METRICS
        }
        lines.append(
            FrontierLine(
                label=f"{algo} {family} r{int(rnd)}" + (f" [{config}]" if config else ""),
                color=f"C{(ALGO_ORDER.index(algo) if algo in ALGO_ORDER else i) % 10}",
                points=points,
            )
        )
    return lines


def plot_frontier(rows: Sequence[dict[str, Any]], path: Path, title: str = "") -> bool:
    """avg reward vs KL and pass@1 vs KL: the lines of `frontier_lines` drawn, each point
    with its error bars and η. False when no row has a KL."""
    lines = frontier_lines(rows)
    if not lines:
        return False
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), layout="constrained")
    axes = fig.subplots(1, 2)
    for line in lines:
        for ax, (metric, _) in zip(axes, FRONTIER_METRICS):
            pts = line.points[metric]
            if not pts:
                continue
            ax.errorbar(
                [p.kl for p in pts],
                [p.y for p in pts],
                xerr=[p.kl_std for p in pts],
                yerr=[p.y_std for p in pts],
                marker="o",
                ms=4,
                lw=1.2,
                capsize=2,
                color=line.color,
                linestyle="-" if len(pts) > 1 else "none",
                label=line.label,
            )
            for p in pts:
                if p.eta is not None:
                    ax.annotate(
                        f"η={_fmt(p.eta)}",
                        (p.kl, p.y),
                        fontsize=6,
                        xytext=(3, 3),
                        textcoords="offset points",
                    )
    scale, linthresh = kl_axis([k for r in rows if (k := _value(r, "kl")[0]) is not None])
    for ax, (_, label) in zip(axes, FRONTIER_METRICS):
        if scale == "symlog":
            ax.set_xscale("symlog", linthresh=linthresh)
        ax.set_xlabel(
            "KL(π ‖ π_ref)"
            + (f" (symlog: linear below {linthresh:.2g})" if scale == "symlog" else "")
        )
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, loc="best")
    if title:
        fig.suptitle(title, fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return True


def aggregate(
    paths: Iterable[Path | str], out_dir: Path | str | None = None
) -> list[dict[str, Any]]:
    """Aggregate the runs at/below `paths` into `out_dir` (default: the first path)."""
    from pita.core.paths import atomic_write_text

    paths = [Path(p) for p in paths]
    run_dirs = find_run_dirs(paths)
    first = Path(paths[0])
    if not run_dirs:
        log.info("aggregate: no results/summary.csv at or below %s", ", ".join(map(str, paths)))
        return []
    out = Path(out_dir) if out_dir is not None else first
    rows = aggregate_rows([r for d in run_dirs for r in read_rows(d)])
    atomic_write_text(out / "aggregate.csv", to_csv(rows))
    table = to_markdown(rows)
    atomic_write_text(out / "aggregate.md", table)
    for dataset in sorted({r["dataset"] for r in rows}):
        plot_frontier(
            [r for r in rows if r["dataset"] == dataset],
            out / "plots" / f"frontier_{dataset}.png",
            title=f"{dataset}: mean ± std over {max(r['n_runs'] for r in rows)} run(s)",
        )
    log.info("Aggregate of %d run(s) (%s):\n%s", len(run_dirs), out / "aggregate.csv", table)
    from pita.experiment.matched_kl import write_matched_kl

    matched = write_matched_kl(rows, out)
    if matched is not None:
        log.info("Guided rows at matched KL, means (%s):\n%s", out / "matched_kl.md", matched)
    return rows


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
        except Exception as exc:  # noqa: BLE001 - a failed aggregate must not fail the sweep
            log.exception("aggregating %s failed: %s", sweep_dir, exc)


def default_out_dir(first: Path) -> Path:
    """Where `python -m pita.experiment.aggregate` writes without --out: a new folder of its
    own beside the runs, so the sweep's own aggregate.md is never replaced."""
    import time

    return first / f"aggregate-{time.strftime('%Y-%m-%d_%H-%M-%S')}"


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(
            "usage: python -m pita.experiment.aggregate SWEEP_OR_RUN_DIR [MORE ...] [--out DIR]\n"
            "  writes aggregate.{csv,md}, matched_kl.{csv,md} and plots/ into DIR\n"
            "  (default: a new SWEEP_OR_RUN_DIR/aggregate-<time>/; never over a sweep's own files)"
        )
        return 0 if args else 2
    out = None
    if "--out" in args:
        i = args.index("--out")
        if i + 1 >= len(args):
            print("error: --out needs a folder", file=sys.stderr)
            return 2
        out = Path(args[i + 1])
        del args[i : i + 2]
    if out is not None and (out / "aggregate.md").exists() and find_run_dirs([out]):
        print(
            f"error: --out {out} holds the sweep's own aggregate.md; choose another folder",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = out if out is not None else default_out_dir(Path(args[0]))
    return 0 if aggregate(args, out) else 1


if __name__ == "__main__":
    sys.exit(main())
