"""The forecast against the run: the dry run's estimated wall time and the live ETA after
20 % of the run, against the real wall time, for the default experiment on fake:N.

    python bench/forecast.py                        # fake:1, fake:4, fake:8 (~20 min on 2 cores)
    python bench/forecast.py --devices 8 --cache /tmp/pita-cache   # a cache with history
    python bench/forecast.py --big-dry-run          # the 34,292-task dry run, unsized vs sized

Prints ONE JSON object. Everything is the command line a user types: the dry run is
`run_parallel.py system.devices=fake:N dry_run=true` (its "Estimated wall time" line, and
its "Predicted makespan" when training tasks are sized), the run `run_parallel.py
system.devices=fake:N`, both with `PITA_CACHE_DIR` on the bench's duration cache. The
forecasts need measured durations: with an empty cache a fake:1 run first records them
(`history_run`, not scored). Each device count then gets its dry run and its run; a run
records its own durations too, so the next device count's forecast also reads them (the
order of `--devices` is the order of the runs).

- `real_s`: the journal's run_started -> run_finished (worker start included);
- `dry_run`: `predicted_s` and `ratio` = predicted / real (target 0.7-1.4);
- `eta_20`: the first ETA line of the run's run.log at or after 20 % of its wall time:
  `at_s` into the run, `eta_s` it said, `ratio` = (at_s + eta_s) / real;
- `load`: the machine's 1-minute load average sampled every 5 s during the run (mean, max)
  and the cores: the forecast reads other users' load only when it forecasts (the dry run:
  the runnable threads then; the live ETA: what its finished tasks felt), not load that
  comes or goes later.

`--big-dry-run`: the dry run of `rounds_of_training=20 algos=all` on goal-walk and star graph
on fake:64 (34,292 tasks), timed unsized and with `training.parallel_strategy=data_parallel`
(every training task sized), one after the other in the same run: `ratio` = sized / unsized
wall time (target <= 1.5), `cpu_ratio` the same in CPU seconds (steadier on a shared machine).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = [sys.executable, str(ROOT / "run_parallel.py")]
BIG = [
    "rounds_of_training=20",
    "algos=all",
    "experiment.datasets=[goal_walk,star_graph]",
    "system.devices=fake:64",
    "dry_run=true",
]
LOG_LINE = re.compile(r"^\[(?P<ts>[\d-]+ [\d:]+),(?P<ms>\d+)\]\[pita\.progress\]\[INFO\] .*ETA ")
DURATION = re.compile(r"(?:(\d+) h )?(?:(\d+) min )?(\d+) s|(\d+) h (\d+) min")


def seconds_of(text: str) -> float | None:
    """`5 min 50 s`, `12 s`, `1 h 05 min` (pita.core.progress.format_duration) -> seconds."""
    m = DURATION.search(text)
    if m is None:
        return None
    if m.group(4) is not None:
        return 3600.0 * int(m.group(4)) + 60.0 * int(m.group(5))
    h, mins, s = (int(g) if g else 0 for g in m.groups()[:3])
    return 3600.0 * h + 60.0 * mins + s


def _env(cache: Path) -> dict[str, str]:
    return {**os.environ, "PITA_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}


def dry_run(n: int, cache: Path, extra: list[str]) -> dict:
    """The dry run's forecasts for fake:n (its printed lines, parsed)."""
    t0 = time.perf_counter()
    out = subprocess.run(
        [*RUN, f"system.devices=fake:{n}", "dry_run=true", *extra],
        capture_output=True,
        text=True,
        env=_env(cache),
        cwd=ROOT,
        check=True,
    ).stdout
    found = {"wall_s": round(time.perf_counter() - t0, 1)}
    for line in out.splitlines():
        if line.startswith("Estimated wall time:"):
            found["predicted_s"] = seconds_of(line)
            found["line"] = line
        elif line.startswith("Predicted makespan:"):
            found["sized_makespan_s"] = seconds_of(line)
        elif line.startswith(("No history", "Every task")):
            found["history"] = line[:120]
    return found


class LoadSampler:
    """The 1-minute load average every 5 s while a run goes."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(5.0):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> LoadSampler:
        self.samples.append(os.getloadavg()[0])
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        s = self.samples or [0.0]
        return {"mean": round(sum(s) / len(s), 2), "max": round(max(s), 2), "cores": os.cpu_count()}


def real_run(n: int, cache: Path, run_dir: Path, extra: list[str]) -> dict:
    """Run the default experiment on fake:n; its wall time and its ETA lines."""
    with LoadSampler() as load:
        subprocess.run(
            [*RUN, f"system.devices=fake:{n}", f"hydra.run.dir={run_dir}", *extra],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=_env(cache),
            cwd=ROOT,
            check=True,
        )
    events = [json.loads(x) for x in (run_dir / "journal.jsonl").read_text().splitlines() if x]
    start = next(e["ts"] for e in events if e["event"] == "run_started")
    end = next(e["ts"] for e in reversed(events) if e["event"] == "run_finished")
    real = end - start
    return {
        "real_s": round(real, 1),
        "eta_20": eta_at(run_dir / "run.log", start, real),
        "load": load.summary(),
    }


def eta_at(log: Path, start: float, real: float, share: float = 0.2) -> dict | None:
    """The first ETA line at or after `share` of the run: when, what it said, the ratio."""
    for line in log.read_text().splitlines():
        m = LOG_LINE.match(line)
        if m is None:
            continue
        at = datetime.strptime(m["ts"], "%Y-%m-%d %H:%M:%S").timestamp() + int(m["ms"]) / 1000
        if at - start < share * real:
            continue
        eta = seconds_of(line.split("ETA", 1)[1].split("the rest at least")[-1])
        if eta is None:
            continue
        predicted = at - start + eta
        return {
            "at_s": round(at - start, 1),
            "eta_s": eta,
            "predicted_s": round(predicted, 1),
            "ratio": round(predicted / real, 2),
            "line": line.split("] ", 1)[-1][:160],
        }
    return None


def forecasts(devices: list[int], cache: Path, work: Path, extra: list[str]) -> dict:
    report: dict = {}
    if not (cache / "task_durations.json").exists():
        report["history_run"] = real_run(1, cache, work / "history", extra)
    for n in devices:
        dry = dry_run(n, cache, extra)
        run = real_run(n, cache, work / f"fake{n}", extra)
        predicted = dry.get("predicted_s")
        dry["ratio"] = round(predicted / run["real_s"], 2) if predicted else None
        report[f"fake:{n}"] = {"dry_run": dry, **run}
    return report


def big_dry_run(cache: Path, repeat: int = 1) -> dict:
    """The 34,292-task dry run, unsized and sized, alternately `repeat` times each: on a
    shared machine the load moves between two runs, so each ratio is also taken per pair
    and the median is reported."""
    runs: dict[str, list[dict]] = {"unsized": [], "sized": []}
    for _ in range(repeat):
        for name, extra in (
            ("unsized", []),
            ("sized", ["training.parallel_strategy=data_parallel"]),
        ):
            runs[name].append(_timed_dry_run(cache, extra))
    pairs = list(zip(runs["unsized"], runs["sized"]))
    return {
        **runs,
        "ratio": round(statistics.median(s["wall_s"] / u["wall_s"] for u, s in pairs), 2),
        "cpu_ratio": round(statistics.median(s["cpu_s"] / u["cpu_s"] for u, s in pairs), 2),
    }


def _timed_dry_run(cache: Path, extra: list[str]) -> dict:
    t0, cpu0 = time.perf_counter(), _children_cpu()
    text = subprocess.run(
        [*RUN, *BIG, *extra], capture_output=True, text=True, env=_env(cache), cwd=ROOT, check=True
    ).stdout
    plan = re.search(r"Plan: (\d+) tasks", text)
    sized = re.search(r"\((\d+) tasks sized in ([\d.]+) s\)", text)
    return {
        "wall_s": round(time.perf_counter() - t0, 1),
        "cpu_s": round(_children_cpu() - cpu0, 1),
        "tasks": int(plan.group(1)) if plan else None,
        "sized": int(sized.group(1)) if sized else 0,
        "sizing_s": float(sized.group(2)) if sized else 0.0,
        "load_after": round(os.getloadavg()[0], 2),
    }


def _children_cpu() -> float:
    """CPU seconds of this process's finished children (the dry runs): unlike their wall
    time, what another user's load does not stretch."""
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="forecast vs real wall time (prints one JSON)")
    parser.add_argument("--devices", default="1,4,8", help="fake device counts, run in this order")
    parser.add_argument("--cache", type=Path, help="PITA_CACHE_DIR (default: a fresh folder)")
    parser.add_argument("--big-dry-run", action="store_true")
    parser.add_argument("--repeat", type=int, default=2, help="--big-dry-run: pairs to run")
    parser.add_argument("overrides", nargs="*", help="more Hydra overrides for every run")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="pita-forecast-"))
    cache = args.cache or work / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    report: dict = {"cache": str(cache), "runs": str(work)}
    if args.big_dry_run:
        report["big_dry_run"] = big_dry_run(cache, args.repeat)
    else:
        devices = [int(x) for x in args.devices.split(",") if x.strip()]
        report.update(forecasts(devices, cache, work, args.overrides))
    report["total_wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
