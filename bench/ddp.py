"""k-rank value training: a real gloo gang against one process on the same global batch.

    python bench/ddp.py [--steps 40] [--items 4096] [--ranks 2,4] [--strategy data_parallel]

Runs `pita.algos.value_training.train_value` (the Q# / PITA train stage) on the CPU
experiment's models (`experiment=star_graph`, a 2×64 guide warm-started from a 2×64
reference; batch `algos.QSharp.batch_size`) in this process's main thread, as a worker runs
a stage: once on one process, then through `pita.runtime.gang.run_stage` on k gloo ranks
started by torch's `elastic_launch` (`training.parallel_strategy`, default data_parallel).
Prints ONE JSON object:

- `startup_s`: dispatch (the stage's call) to the first optimizer step's heartbeat, for
  1 rank, for k ranks with a cold forkserver (the first gang of a fresh worker: the
  forkserver imports torch and transformers) and with a warm one (every later gang; the
  worker warms it when its run trains on gangs). A few-step run each.
- `sequences_per_s` of 1 and k ranks over `--steps` steps (the training report's figure:
  the steps after the first; best of `--repeats` alternated runs), their `ratio` (= s(k)),
  and `alpha`, solved from
  s(k) = k / (1 + α(k−1)): α = (k / s − 1) / (k − 1) (0: linear; 1: no gain).
- Each rank (and the one process) uses `--threads` torch threads (1: a core plays a
  device; more threads in one process would compare 2 cores against 1).
- `load`: the 1-minute load average before and after, and the CPU count: on a shared
  machine the figures move with the other work on it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.value_training import prepare  # noqa: E402


def _train(run_dir: Path, k: int, steps: int, n_items: int, strategy: str) -> dict:
    """One value-training task on k ranks: its result, wall time and start-up."""
    from pita.algos.value_training import train_value

    overrides = (
        f"training.parallel_strategy={strategy if k > 1 else 'none'}",
        "algos.QSharp.probe_steps=0",  # the frozen-backbone probe is not start-up
    )
    ctx, items = prepare(run_dir, "cpu", steps, "cpu", n_items, overrides, gpus=k)
    first: list[float] = []
    ctx.heartbeat = lambda msg: first.append(time.perf_counter()) if not first else None
    t0 = time.perf_counter()
    result = train_value(ctx, items)
    wall = time.perf_counter() - t0
    return {
        "ranks": k,
        "startup_s": round(first[0] - t0, 2) if first else None,
        "wall_s": round(wall, 2),
        "sequences_per_s": result.get("samples_per_s"),
        "steps": result["steps"],
        "batch": result["batch_size"],
        "final_loss": result["final_loss"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--items", type=int, default=4096)
    ap.add_argument("--ranks", default="2,4", help="gang sizes to time the start-up of")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads of one rank (one core = a device)"
    )
    ap.add_argument("--strategy", default="data_parallel", choices=("data_parallel", "fsdp"))
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)  # the ranks get the same (threads_per_rank)
    ranks = [int(k) for k in args.ranks.split(",")]
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        start = {"1": _train(run_dir, 1, 3, args.items, args.strategy)["startup_s"]}
        cold = _train(run_dir, ranks[0], 3, args.items, args.strategy)  # forkserver starts here
        start[f"{ranks[0]}_cold_forkserver"] = cold["startup_s"]
        for k in ranks:
            start[str(k)] = _train(run_dir, k, 3, args.items, args.strategy)["startup_s"]
        # alternated, best of --repeats each: the machine's other load moves between runs
        runs = [
            _train(run_dir, k, args.steps, args.items, args.strategy)
            for _ in range(args.repeats)
            for k in (1, ranks[0])
        ]
        one = max((r for r in runs if r["ranks"] == 1), key=lambda r: r["sequences_per_s"])
        gang = max((r for r in runs if r["ranks"] > 1), key=lambda r: r["sequences_per_s"])
    k = ranks[0]
    ratio = gang["sequences_per_s"] / one["sequences_per_s"]
    print(
        json.dumps(
            {
                "model": "experiment=star_graph (2x64 guide)",
                "strategy": args.strategy,
                "backend": "gloo",
                "startup_s": start,
                "throughput": {"1": one, str(k): gang},
                "ratio": round(ratio, 3),
                "alpha": round((k / ratio - 1) / (k - 1), 3),
                "same_final_loss": abs(one["final_loss"] - gang["final_loss"]) <= 1e-4,
                "torch_threads": torch.get_num_threads(),
                "load": {"before": load0, "after": os.getloadavg()[0], "cpus": os.cpu_count()},
            }
        )
    )


if __name__ == "__main__":
    main()
