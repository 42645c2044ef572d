"""Multirun aggregation: mean ± spread over seeds, reward–KL frontier plots."""

from __future__ import annotations

import csv
import statistics
from pathlib import Path

import pytest

from pita.experiment.report import COLUMNS
from tests.conftest import only, run_cli

HEADER = COLUMNS  # the results contract (docs/DESIGN.md §6)


def _job(folder: Path, seed: int, rows: list[list], extra_override: str = "") -> Path:
    (folder / "results").mkdir(parents=True)
    (folder / ".hydra").mkdir()
    overrides = [f"dataset.seed={seed}"] + ([extra_override] if extra_override else [])
    (folder / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    with open(folder / "results" / "summary.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(HEADER)
        w.writerows(rows)
    return folder


def test_aggregate_mean_std_per_algo_dataset_family_round_eta(tmp_path):
    from pita.experiment.aggregate import aggregate

    sweep = tmp_path / "multirun" / "2026-01-01_00-00-00"
    accs = [0.5, 0.6, 0.7]
    for i, acc in enumerate(accs):
        _job(
            sweep / str(i),
            i,
            [
                [
                    "reference",
                    "goal_walk",
                    "tiny",
                    0,
                    0.0,
                    40,
                    80,
                    0.1 + i / 100,
                    0.1,
                    0.1,
                    0.0,
                    1.0,
                ],
                ["QSharp", "goal_walk", "tiny", 0, 5.0, 40, 80, acc, acc, acc, 0.5 + i / 10, 2.0],
                ["GRPO", "goal_walk", "tiny", 0, "", 40, 80, 0.3, 0.3, 0.3, 0.2, 3.0],
            ],
        )
    rows = aggregate([sweep])
    q = next(r for r in rows if r["algo"] == "QSharp")
    assert q["n_runs"] == 3 and q["eta"] == 5.0 and q["round"] == 0.0 and q["config"] == ""
    assert q["pass@1_mean"] == pytest.approx(statistics.fmean(accs))
    assert q["pass@1_std"] == pytest.approx(statistics.stdev(accs))
    assert q["kl_min"] == pytest.approx(0.5) and q["kl_max"] == pytest.approx(0.7)
    g = next(r for r in rows if r["algo"] == "GRPO")
    assert g["eta"] is None and g["pass@1_std"] == 0.0
    table = (sweep / "aggregate.md").read_text()
    assert "| QSharp | goal_walk | tiny | 0 | 5 | - | 3 | 0.6 ± 0.1 |" in table  # sampling: -
    assert (sweep / "aggregate.csv").is_file() and (
        sweep / "plots" / "frontier_goal_walk.png"
    ).is_file()


def test_jobs_that_differ_beyond_the_seed_are_kept_apart(tmp_path):
    from pita.experiment.aggregate import aggregate

    for i, lr in enumerate(["1e-3", "1e-3", "1e-2", "1e-2"]):
        _job(
            tmp_path / str(i),
            i,
            [["QSharp", "goal_walk", "tiny", 0, 5.0, 40, 80, 0.1 * i, 0.1, 0.1, 0.3, 1.0]],
            extra_override=f"algos.QSharp.lr={lr}",
        )
    rows = aggregate([tmp_path])
    assert sorted((r["config"], r["n_runs"]) for r in rows) == [
        ("algos.QSharp.lr=1e-2", 2),
        ("algos.QSharp.lr=1e-3", 2),
    ]


@pytest.mark.slow
def test_real_seed_sweep_ends_with_one_aggregate_table(tmp_path):
    done = run_cli(
        [
            "-m",
            "experiment=smoke",
            *only("reference"),
            "pretrain.steps=5",
            "dataset.seed=0,1",
            "executor.progress=false",
        ],
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    sweep = next((tmp_path / "outputs" / "smoke" / "multirun").iterdir())
    table = (sweep / "aggregate.md").read_text()
    assert "| reference | goal_walk | tiny | 0 | 0 | full, T=1 | 2 |" in table
    assert (sweep / "plots" / "frontier_goal_walk.png").is_file()


def test_aggregate_writes_the_matched_kl_table_of_the_means(tmp_path):
    """Two guided algorithms with an η curve in every job: `matched_kl.md` reads the mean
    curves (Q# mean KL at η 5 is 1.0 with mean pass@1 0.6; PITA's 2.0 and 0.8)."""
    from pita.experiment.aggregate import aggregate

    sweep = tmp_path / "multirun" / "2026-01-01_00-00-00"
    for i in range(2):
        d = i / 10  # job 0 and job 1 straddle the means
        _job(
            sweep / str(i),
            i,
            [
                ["QSharp", "goal_walk", "tiny", 0, 0.0, 40, 80, 0.2, 0.2, 0.2, 0.0, 1.0],
                ["QSharp", "goal_walk", "tiny", 0, 5.0, 40, 80, 0.5 + 2 * d, 0, 0, 0.9 + 2 * d, 1],
                ["PITA", "goal_walk", "tiny", 0, 0.0, 40, 80, 0.2, 0.2, 0.2, 0.0, 1.0],
                ["PITA", "goal_walk", "tiny", 0, 5.0, 40, 80, 0.7 + 2 * d, 0, 0, 1.9 + 2 * d, 1],
            ],
        )
    aggregate([sweep])
    table = (sweep / "matched_kl.md").read_text()
    # at KL 1.0: Q#'s own mean point (0.6); PITA read between (0, 0.2) and (2.0, 0.8): 0.5
    assert "| goal_walk | tiny | 0 | - | 1 | 0.5 | 0.6 |" in table  # sampling: -
    assert "| goal_walk | tiny | 0 | - | 2 | 0.8 | - |" in table  # past Q#'s largest KL


def _job_with_sampling(folder: Path, seed: int, rows: list[tuple[float, str]]) -> Path:
    """A job whose summary has the `sampling` column (reference rows: pass@1, rule)."""
    _job(folder, seed, [])
    with open(folder / "results" / "summary.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([*HEADER, "sampling"])
        for acc, rule in rows:
            cells = ["reference", "goal_walk", "tiny", 0, 0.0, 40, 80, acc]
            w.writerow(cells + [""] * (len(HEADER) - len(cells)) + [rule])
    return folder


def test_two_reference_rules_are_never_pooled(tmp_path):
    """Issue 22: full and top-2 reference rows of one run stay two rows, each over 3 runs."""
    from pita.experiment.aggregate import aggregate, main

    sweep = tmp_path / "multirun" / "ts"
    full, top2 = [0.50, 0.52, 0.54], [1.0, 0.98, 0.96]
    for i in range(3):
        _job_with_sampling(sweep / str(i), i, [(full[i], "full, T=1"), (top2[i], "top-2, T=1")])
    rows = aggregate([sweep])
    by_rule = {r["sampling"]: r for r in rows}
    assert set(by_rule) == {"full, T=1", "top-2, T=1"} and len(rows) == 2
    assert by_rule["full, T=1"]["n_runs"] == 3 and by_rule["top-2, T=1"]["n_runs"] == 3
    assert by_rule["full, T=1"]["pass@1_mean"] == pytest.approx(statistics.fmean(full))
    assert by_rule["top-2, T=1"]["pass@1_mean"] == pytest.approx(statistics.fmean(top2))
    # the command by hand writes a folder of its own, never over the sweep's aggregate.md
    own = (sweep / "aggregate.md").read_text()
    assert main([str(sweep)]) == 0
    assert (sweep / "aggregate.md").read_text() == own
    [by_hand] = sweep.glob("aggregate-*/aggregate.md")
    assert by_hand.read_text() == own
    assert main([str(sweep), "--out", str(sweep)]) == 2
