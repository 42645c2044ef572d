"""Multirun aggregation: mean ± spread over seeds, reward–KL frontier plots."""

from __future__ import annotations

import csv
import os
import statistics
from pathlib import Path

import pytest

from pita.results.report import COLUMNS
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
    from pita.results.aggregate import aggregate

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
    from pita.results.aggregate import aggregate

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


@pytest.mark.long
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
            "executor.cpu_workers=1",  # one worker per job importing torch, not one per core
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
    from pita.results.aggregate import aggregate

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
    from pita.results.aggregate import aggregate, main

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


# --- the run's rules (issue 34 item 4) ------------------------------------------------------

# the summary's columns (HEADER): ..., pass@1, maj@k, avg_reward, kl, kl_full, off_support, wall_s
ROW = ["QSharp", "goal_walk", "tiny", 0, 5.0, 40, 80, 0.5, 0.5, 0.5, 0.4, 0.4, 0.0, 1.0]


def _aggregate_cli(capsys, *args: str) -> tuple[int, list[str]]:
    from pita.results.aggregate import main

    code = main([str(a) for a in args])
    return code, capsys.readouterr().err.strip().splitlines()


def _immutable_folder(folder: Path):
    """A folder nobody may write: `chattr +i` as root (root ignores modes), else 0555."""
    import subprocess

    folder.mkdir()
    if os.geteuid() == 0:
        if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
            pytest.skip("chattr +i is not supported on this file system")
        return lambda: subprocess.run(["chattr", "-i", str(folder)], check=True)
    folder.chmod(0o555)
    return lambda: folder.chmod(0o755)


@pytest.mark.parametrize("target", ["file", "proc", "dev_full", "immutable", "run_results"])
def test_odd_out_targets_are_one_line_exit_2_and_the_run_is_untouched(tmp_path, capsys, target):
    run = _job(tmp_path / "sweep" / "0", 0, [ROW])
    (run / "results" / "matched_kl.md").write_text("the run's own table\n")
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    undo = None
    out = {
        "file": tmp_path / "a_file",
        "proc": Path("/proc/self/aggregate"),
        "dev_full": Path("/dev/full"),
        "immutable": tmp_path / "frozen",
        "run_results": run / "results",
    }[target]
    if target == "file":
        out.write_text("x")
    if target == "immutable":
        undo = _immutable_folder(out)
    try:
        code, err = _aggregate_cli(capsys, tmp_path / "sweep", "--out", out)
    finally:
        if undo is not None:
            undo()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: --out {out}: "), err
    expected = {
        "file": "not a folder",
        "proc": "a system folder",
        "dev_full": "a system folder",
        "immutable": "cannot write there",
        "run_results": "aggregate never writes into a run",
    }[target]
    assert expected in err[0]
    after = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert after == before  # not a byte written into the run


@pytest.mark.parametrize("where", ["results", "results/deeper/still", "."])
def test_out_inside_any_run_folder_is_one_line(tmp_path, capsys, where):
    """Issue 43: `aggregate RUN_A --out RUN_B/results` overwrote another run's report (the
    guard knew only the runs aggregated): any folder inside a run folder (its saved config,
    plan or journal says so) is refused, and that run keeps every byte."""
    _job(tmp_path / "sweep" / "0", 0, [ROW])
    other = _job(tmp_path / "other_run", 1, [ROW])
    (other / ".hydra" / "config.yaml").write_text("experiment:\n  name: other\n")
    (other / "results" / "aggregate.md").write_text("the other run's own table\n")
    before = {p: p.read_bytes() for p in other.rglob("*") if p.is_file()}
    out = other / where
    code, err = _aggregate_cli(capsys, tmp_path / "sweep", "--out", out)
    assert code == 2 and len(err) == 1, err
    assert f"inside the run folder {other}" in err[0], err
    assert {p: p.read_bytes() for p in other.rglob("*") if p.is_file()} == before
    assert not (other / "results" / "deeper").exists()


def test_a_run_folder_given_alone_gets_its_aggregate_beside_it(tmp_path, capsys):
    run = _job(tmp_path / "runs" / "2026-01-01_00-00-00", 0, [ROW])
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    code, err = _aggregate_cli(capsys, run)
    assert code == 0, err
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before
    [beside] = (tmp_path / "runs").glob("aggregate-*")
    assert (beside / "aggregate.md").is_file()


def test_bad_cells_are_skipped_with_one_warning_that_counts_them(tmp_path, capsys, caplog):
    sweep = tmp_path / "sweep"
    bad = ["QSharp", "goal_walk", "tiny", 0, 5.0, 40, 80, "nan", "inf", "-inf", "x?", 0.4, 0, 1]
    _job(sweep / "0", 0, [ROW, bad])  # 4 bad cells in one row, the rest of it kept
    _job(sweep / "1", 1, [ROW, ["QSharp", "goal_walk", "tiny", "abc", 5.0, 40, 80, 0.9]])
    _job(sweep / "2", 2, [ROW, ["QSharp", "goal_walk", "tiny", 0.5, 5.0, 40, 80, 0.9]])
    _job(sweep / "3", 3, [])
    (sweep / "3" / "results" / "summary.csv").write_bytes(os.urandom(4096))
    with caplog.at_level("INFO", logger="pita.aggregate"):
        code, err = _aggregate_cli(capsys, sweep, "--out", tmp_path / "agg")
    assert code == 0 and not err, err
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2, warnings
    assert "3/results/summary.csv is not a results summary" in warnings[0]
    assert warnings[1] == (
        "skipped 4 cell(s) that are not numbers pita writes (nan, inf, text) and 2 row(s) whose "
        "round, η or names are not valid in the summaries of 4 run(s)"
    )
    with open(tmp_path / "agg" / "aggregate.csv", newline="") as f:
        [row] = list(csv.DictReader(f))
    assert row["n_runs"] == "3" and float(row["pass@1_mean"]) == 0.5  # the three good rows
    assert float(row["wall_s_mean"]) == 1.0  # the bad row keeps its finite cells
    assert (tmp_path / "agg" / "plots" / "frontier_goal_walk.png").is_file()


def test_run_folders_are_read_under_the_runs_rules(tmp_path, capsys):
    """A planted link, or a run folder of another user: refused with one line, exit 2, as
    the run itself refuses them (pita/core/safe_files.py)."""
    sweep = tmp_path / "sweep"
    run = _job(sweep / "0", 0, [ROW])
    secret = tmp_path / "secret.csv"
    secret.write_text((run / "results" / "summary.csv").read_text())
    (run / "results" / "summary.csv").unlink()
    (run / "results" / "summary.csv").symlink_to(secret)
    code, err = _aggregate_cli(capsys, sweep, "--out", tmp_path / "agg")
    assert code == 2 and len(err) == 1 and "is a symbolic link" in err[0], err
    if os.geteuid() != 0:
        return
    (run / "results" / "summary.csv").unlink()
    (run / "results" / "summary.csv").write_text(secret.read_text())
    import pwd

    nobody = pwd.getpwnam("nobody")
    os.chown(run, nobody.pw_uid, nobody.pw_gid)
    code, err = _aggregate_cli(capsys, sweep, "--out", tmp_path / "agg")
    assert code == 2 and len(err) == 1 and "owned by uid" in err[0], err
    assert err[0].endswith("needs --trust-group)")
    os.chown(run, nobody.pw_uid, os.getegid())  # shared with our group, on purpose
    code, err = _aggregate_cli(capsys, sweep, "--out", tmp_path / "agg", "--trust-group")
    assert code == 0, err


def test_frontier_legend_stays_readable_for_many_runs(tmp_path):
    """12 configs x 3 algorithms x 2 rounds: short legend labels beside the plots (never
    over a curve), each config named once in a table beside them, nothing off the figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from pita.results.aggregate import frontier_figure

    rows = []
    for c in range(12):
        config = f"algos.QSharp.training.learning_rate={10 ** -(c % 5 + 2)} model=family_{c}"
        for algo in ("QSharp", "PITA", "DPO"):
            for rnd in (0, 1):
                for eta in (1.0, 5.0):
                    rows.append(
                        {
                            "config": config,
                            "algo": algo,
                            "family": "tiny",
                            "round": rnd,
                            "eta": eta,
                            "kl_mean": 0.1 * eta + 0.05 * c,
                            "kl_std": 0.01,
                            "pass@1_mean": 0.3 + 0.01 * c,
                            "avg_reward_mean": 0.5,
                        }
                    )
    fig = frontier_figure(rows, "goal_walk")
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    plots = [ax.get_window_extent(renderer) for ax in fig.axes[:2]]
    legend = fig.axes[2].get_legend()
    labels = [t.get_text() for t in legend.get_texts()]
    assert len(labels) == 12 * 3 * 2 and max(map(len, labels)) <= 20, labels
    texts = [legend.get_window_extent(renderer)] + [
        t.get_window_extent(renderer) for ax in fig.axes[3:] for t in ax.texts
    ]
    page = fig.bbox
    for box in texts:
        assert not any(box.overlaps(p) for p in plots)  # beside the plots, never over them
        assert page.x0 <= box.x0 and box.x1 <= page.x1 + 1 and page.y0 <= box.y0
    table = "\n".join(t.get_text() for ax in fig.axes[3:] for t in ax.texts)
    for c in range(12):
        assert table.count(f"model=family_{c}\n") + table.endswith(f"model=family_{c}") == 1
