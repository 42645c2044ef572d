"""A durations file for bench/scaling.py from a run scaled down by one factor.

    python bench/record_durations.py --journal outputs/star_measure/<run>/journal.jsonl \\
        --factor 800 --factor-for GRPO.*.train=1000 --rename .star_graph.=.star_graph_d2_l5. \\
        --fixed-journal outputs/star_fixed/<run>/journal.jsonl --fixed-ratio 5 \\
        --fixed-set pretrain.*=2.7 \\
        --how "..." --out bench/star_graph_task_seconds.json

A profile whose published sizes take days on this CPU (`experiment=star_graph_paper`) is
run with every key that sets a stage's amount of work divided by one factor; each task's
`task_done` seconds are then multiplied back by it (`--factor-for`: a task whose key could
not be divided exactly, multiplied by its own ratio). That multiplies each task's fixed
costs (process work before the first step, model load and save, trainer set-up) too. With
`--fixed-journal`, a second run with the data counts divided by `--fixed-ratio` more, each
task's fixed seconds are estimated from the two points (t = a + b x, x the data count:
a = (r t_small - t) / (r - 1), clipped to [0, min(t, t_small)]) and the file also carries
`fixed_s` per task, `task_seconds_fixed_once` (a + factor (t - a)) and how much the plain
multiplication overstates the total; `--fixed-set PATTERN=S` gives the fixed seconds of
tasks whose work the second run did not change (a step count already at 1), read from
their logs. The bench reads `task_seconds`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))
from pita.core.paths import atomic_write_json  # noqa: E402


def task_seconds(journal: Path) -> dict[str, float]:
    """Task id -> `task_done` wall seconds of one run."""
    out = {}
    for line in journal.read_text().splitlines():
        event = json.loads(line) if line.strip() else {}
        if event.get("event") == "task_done":
            out[event["task"]] = float(event.get("wall_s") or 0.0)
    return out


def factors(ids: list[str], factor: float, special: list[str]) -> dict[str, float]:
    """Each task's multiplier: `factor`, or the first `PATTERN=F` of `special` it matches."""
    rules = [(re.compile(p.replace(".", r"\.").replace("*", ".*") + "$"), float(f))
             for p, f in (s.rsplit("=", 1) for s in special)]  # fmt: skip
    return {t: next((f for rx, f in rules if rx.match(t)), factor) for t in ids}


def fixed_seconds(
    large: dict[str, float], small: dict[str, float], ratio: float, given: dict[str, float]
) -> dict:
    """Per task, the seconds that do not scale with the data: the intercept of a line
    through (1, large) and (1 / ratio, small), kept within [0, min(large, small)];
    `given` wins."""
    out = {}
    for tid, t in large.items():
        if tid in given:
            out[tid] = given[tid]
        elif tid in small:
            a = (ratio * small[tid] - t) / (ratio - 1.0)
            out[tid] = round(min(max(a, 0.0), small[tid], t), 3)
    return out


def record(args: argparse.Namespace) -> dict:
    measured = task_seconds(args.journal)
    mult = factors(list(measured), args.factor, args.factor_for)
    old, new = args.rename.split("=", 1) if args.rename else ("", "")

    def name(tid: str) -> str:
        return tid.replace(old, new) if old else tid

    data: dict = {
        "measured": args.how,
        "factor": args.factor,
        "factors_other": dict(s.rsplit("=", 1) for s in args.factor_for),
        "seconds_scaled_run": {name(t): s for t, s in measured.items()},
        "task_seconds": {name(t): round(s * mult[t], 3) for t, s in measured.items()},
    }
    if args.fixed_journal:
        given = factors(list(measured), -1.0, args.fixed_set)
        given = {t: a for t, a in given.items() if a >= 0}
        small = task_seconds(args.fixed_journal)
        fixed = fixed_seconds(measured, small, args.fixed_ratio, given)
        once = {t: round(fixed.get(t, 0.0) + mult[t] * (s - fixed.get(t, 0.0)), 3)
                for t, s in measured.items()}  # fmt: skip
        total, total_once = sum(data["task_seconds"].values()), sum(once.values())
        data["fixed_s"] = {name(t): a for t, a in fixed.items()}
        data["task_seconds_fixed_once"] = {name(t): s for t, s in once.items()}
        data["overstatement"] = {
            "task_seconds_total": round(total, 1),
            "fixed_once_total": round(total_once, 1),
            "ratio": round(total / max(1e-9, total_once), 3),
        }
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="a durations file from a scaled-down run")
    parser.add_argument("--journal", type=Path, required=True)
    parser.add_argument("--factor", type=float, required=True)
    parser.add_argument("--factor-for", action="append", default=[], help="PATTERN=F")
    parser.add_argument("--rename", default="", help="OLD=NEW in task ids")
    parser.add_argument("--fixed-journal", type=Path)
    parser.add_argument("--fixed-ratio", type=float, default=5.0)
    parser.add_argument("--fixed-set", action="append", default=[], help="PATTERN=SECONDS")
    parser.add_argument("--how", required=True, help="how it was measured (the file's text)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    data = record(args)
    atomic_write_json(args.out, data)  # a bench never reads half a file
    print(json.dumps(data.get("overstatement", {"tasks": len(data["task_seconds"])})))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
