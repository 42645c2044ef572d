"""End-to-end runs of the real command line (slow: real workers, real training)."""

from __future__ import annotations

import csv

import pytest

from tests.conftest import only, run_cli, run_dirs


def _summary(run_dir):
    with open(run_dir / "results" / "summary.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_smoke_experiment_end_to_end(smoke_run):
    proc, run_dir = smoke_run.proc, smoke_run.run_dir
    rows = _summary(run_dir)
    header = list(rows[0])
    # the public columns, spelled out (not read from pita.results.report.COLUMNS)
    assert header[:7] == ["algo", "dataset", "family", "round", "eta", "n_prompts", "samples"]
    assert header[7:10] == ["pass@1", "maj@k", "avg_reward"]
    assert header[10:14] == ["kl", "kl_full", "off_support", "wall_s"]
    assert any(r["algo"] == "reference" for r in rows)
    for r in rows:  # docs/ALGORITHMS.md "KL: the three columns": kl finite unless off the support
        assert (float(r["kl"]) != float("inf")) == (float(r["off_support"]) == 0.0), r
    assert (run_dir / "results" / "summary.md").is_file()
    matched = (run_dir / "results" / "matched_kl.md").read_text()  # smoke sweeps η = 0, 5
    assert "QSharp pass@1" in matched and "PITA pass@1" in matched
    assert (run_dir / "results" / "plots" / "accuracy.png").stat().st_size > 1000
    assert "| algo |" in proc.stdout  # the table is printed at the end
    assert (run_dir / ".hydra" / "config.yaml").is_file() and (run_dir / "plan.json").is_file()
    # where the time went, an ETA during the run, the end lines (issue 22 item 5)
    assert (run_dir / "results" / "timeline.png").stat().st_size > 1000
    assert "| stage |" in (run_dir / "results" / "time.md").read_text()
    assert (run_dir / "results" / "time.csv").is_file()
    log = (run_dir / "run.log").read_text()
    assert 0 <= log.find(" tasks, ETA ") < log.index("tasks done in")
    assert "pass@1_se" in header and all(r["pass@1_se"] for r in rows)
    tail = proc.stdout[proc.stdout.rindex("tasks done in") :]
    assert "summary.md" in tail and "Plots:" in tail and "Columns: algo = " in tail


@pytest.mark.slow
def test_default_reference_matches_analytic_pass_at_1(tmp_path):
    """The default goal-walk reference (400 teacher-forced steps) is the ideal random walk:
    its pass@1 equals E_s[1/|reach(s)|] on the evaluated prompts within ±0.03."""
    args = [
        *only("reference"),
        "evaluation.max_prompts=400",
        "experiment.name=ref",
        "executor.progress=false",
        "executor.cpu_workers=1",  # one worker importing torch, not one per core
    ]
    proc = run_cli(args, tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [row] = [r for r in _summary(run_dirs(tmp_path, "ref")[0]) if r["algo"] == "reference"]
    assert abs(float(row["pass@1"]) - float(row["optimum_pass@1"])) <= 0.03, row
    assert abs(float(row["kl"])) < 1e-6  # π_ref against itself
    assert float(row["valid_walk"]) > 0.95
