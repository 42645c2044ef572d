"""ETA and where the time went: task-duration estimates, the ETA line of a real run, the
dry run's wall-time line, the time table and timeline, and the run's end lines."""

from __future__ import annotations

import csv
import json
import logging
import math
import time

import pytest

from pita.core.dag import Plan
from pita.core.parallel_executor import DeviceState, Scheduler
from pita.core.progress import (
    EARLIER,
    NO_MEASURE_YET,
    NOMINAL_S_PER_WORK,
    THIS_RUN,
    WORK_UNITS,
    Eta,
    Progress,
    TaskDurations,
    format_duration,
    parse_progress,
    progress_line,
    task_left,
)
from pita.core.tasks import TaskSpec
from tests.conftest import run_cli, task_spec


def _task(tid: str, stage: str = "train", work: float = 1.0, deps=(), algo="DPO") -> TaskSpec:
    return task_spec(
        id=tid,
        algo=algo,
        stage=stage,
        fn="-",
        deps=list(deps),
        work=work,
    )


def _scheduler(n: int) -> Scheduler:
    return Scheduler([DeviceState(i, 1000, 1000) for i in range(n)], max_tasks_per_device=1)


def test_format_duration_reads_like_a_person_wrote_it():
    assert format_duration(12.4) == "12 s"
    assert format_duration(250) == "4 min 10 s"
    assert format_duration(3900) == "1 h 05 min"
    assert format_duration(-3) == "0 s"


def test_durations_come_from_this_run_then_earlier_runs_then_work_units():
    a, b = _task("a.train", work=2.0), _task("b.evaluate", stage="evaluate", work=3.0)
    durations = TaskDurations(earlier={"b.evaluate": 7.0})
    assert durations.estimate(a) == (2.0 * NOMINAL_S_PER_WORK, WORK_UNITS)
    assert durations.estimate(b) == (7.0, EARLIER)
    assert durations.rate([a, b]) == (7.0 / 3.0, EARLIER)  # earlier runs' seconds per unit
    durations.observe(_task("c.train", work=1.0), 5.0)  # same kind as a: DPO train
    assert durations.estimate(a) == (5.0, THIS_RUN)
    assert durations.estimate(b) == (7.0, EARLIER)  # no evaluate finished in this run yet
    other = _task("d.collect", stage="collect", work=4.0)
    assert durations.estimate(other) == (20.0, THIS_RUN)  # 4 units x this run's 5 s per unit


def test_eta_simulates_the_dag_on_the_devices():
    """Two independent 10 s tasks then a 5 s one on both: 15 s on two devices, 25 s on one."""
    plan = Plan()
    plan.add(_task("x", work=10.0))
    plan.add(_task("y", work=10.0, algo="GRPO"))
    plan.add(_task("z", work=5.0, deps=["x", "y"], algo="PITA"))
    durations = TaskDurations(earlier={"x": 10.0, "y": 10.0, "z": 5.0})
    two = Eta(plan.tasks, set(), durations, _scheduler(2))
    assert two.remaining({}, 0.0) == (15.0, EARLIER)
    assert Eta(plan.tasks, set(), durations, _scheduler(1)).remaining({}, 0.0)[0] == 25.0
    two.finished.add("x")  # x done; y has run 4 s of its 10
    assert two.remaining({"y": 100.0}, 104.0) == (11.0, EARLIER)
    two.finished.update({"y", "z"})
    assert two.remaining({}, 0.0)[0] == 0.0


def test_progress_logs_an_eta_line_every_few_tasks(caplog):
    plan = Plan()
    for i in range(4):
        plan.add(_task(f"t{i}", work=1.0))
    eta = Eta(plan.tasks, set(), TaskDurations(), _scheduler(1))
    progress = Progress(4, ["cpu 0"], live=False, eta=eta, eta_every=2)

    class Outcome:
        wall_s, result = 3.0, {}

    with caplog.at_level(logging.INFO, logger="pita.progress"), progress:
        for i in range(3):
            progress.event("running", plan.tasks[f"t{i}"], [0])
            progress.event("done", plan.tasks[f"t{i}"], Outcome())
    lines = [r.getMessage() for r in caplog.records if "ETA" in r.getMessage()]
    assert lines[0] == f"0/4 tasks, {NO_MEASURE_YET}"  # no figure before anything is measured
    assert lines[-1] == f"2/4 tasks, ETA 6 s ({THIS_RUN})"  # two left, 3 s each, one device
    assert "ETA" in progress._table().title


def test_an_eta_line_comes_every_interval_while_no_task_ends(caplog):
    plan = Plan()
    plan.add(_task("long", work=100.0))
    eta = Eta(plan.tasks, set(), TaskDurations(), _scheduler(1))
    progress = Progress(1, ["cpu 0"], live=False, eta=eta, eta_interval_s=0.05)
    with caplog.at_level(logging.INFO, logger="pita.progress"), progress:
        progress.event("running", plan.tasks["long"], [0])
        for _ in range(200):  # the ticker thread logs on its own; wait for two lines
            if sum("ETA" in r.getMessage() for r in caplog.records) >= 3:
                break
            time.sleep(0.05)
    assert sum("0/1 tasks, ETA" in r.getMessage() for r in caplog.records) >= 3


def test_progress_lines_round_trip_and_other_lines_say_nothing():
    assert progress_line(412, 1000, "step", "loss 0.31") == "step 412/1000 loss 0.31"
    assert parse_progress("step 412/1000 loss 0.31") == 0.412
    assert parse_progress("prompts 30/30") == 1.0
    assert parse_progress("eta=5.0 done") is None
    assert parse_progress("step 3/0") is None  # no total: nothing to project
    assert parse_progress("") is None


def test_report_progress_is_one_helper_that_throttles_and_always_passes_the_last(tmp_path):
    """Stages call ctx.report_progress every step; the heartbeat gets the first line, at
    most one per PROGRESS_EVERY_S after it, and the last (a gang's rank 0 pipes each)."""
    from omegaconf import OmegaConf

    from pita.runtime.context import StageContext

    sent: list[str] = []
    ctx = StageContext(
        task=_task("t"),
        cfg=OmegaConf.create({}),
        run_dir=tmp_path,
        out_dir=tmp_path,
        logger=logging.getLogger("t"),
        heartbeat=sent.append,
        chain_merged=True,
    )
    for i in range(1000):
        ctx.report_progress(i + 1, 1000, "step", "loss 0.1")
    assert sent[0] == "step 1/1000 loss 0.1" and sent[-1] == "step 1000/1000 loss 0.1"
    assert len(sent) < 1000 and all(parse_progress(line) for line in sent)


def test_a_running_task_left_from_its_progress_else_its_estimate_else_unknown():
    assert task_left(10.0, 4.0, None) == 6.0  # no progress yet, within its estimate
    assert task_left(10.0, 12.0, None) == 0.0  # a little past: a heartbeat may be on its way
    assert task_left(10.0, 40.0, None) is None  # past its estimate, nothing to go by
    assert task_left(10.0, 40.0, 0.0) is None  # it said 0/N: no pace yet
    assert task_left(10.0, 40.0, 0.5) == 40.0  # its own pace: as long again
    assert task_left(100.0, 1.0, 0.01) == 99.0  # early: the start-up skews the pace
    assert task_left(2.0, 2400.0, 0.9) == pytest.approx(266.7, abs=0.1)
    # first seen at 20 % after 100 s (start-up, or a resumed checkpoint): 60 % more in 300 s
    assert task_left(10.0, 400.0, 0.8, first=(100.0, 0.2)) == pytest.approx(100.0)
    assert task_left(10.0, 101.0, 0.21, first=(100.0, 0.2)) == pytest.approx(101 * 0.79 / 0.21)


def test_a_task_past_its_estimate_never_leaves_the_eta_below_its_own_remaining_time():
    """The issue's GRPO: a 2 s estimate, 40 minutes of training. At 50 % the ETA is its own
    40 minutes left plus the evaluate after it, and the other seeds' trains still waiting
    are counted at its pace; with no progress reported the ETA says it does not know."""
    plan = Plan()
    plan.add(_task("s0.train", algo="GRPO"))
    plan.add(_task("s0.evaluate", stage="evaluate", deps=["s0.train"], algo="GRPO"))
    plan.add(_task("s1.train", algo="GRPO"))
    earlier = {"s0.train": 2.0, "s0.evaluate": 1.0, "s1.train": 2.0}
    eta = Eta(plan.tasks, set(), TaskDurations(earlier), _scheduler(1))
    now = 10_000.0
    r = eta.estimate({"s0.train": now - 2400}, now, {"s0.train": 0.5})
    assert r.left == {"s0.train": 2400.0} and not r.unknown
    assert r.seconds == 2400.0 + 1.0 + 4800.0  # then s1.train at the pace of its kind
    blind = eta.estimate({"s0.train": now - 2400}, now, {})
    assert blind.unknown == ["s0.train"] and blind.seconds == 1.0 + 2.0

    progress = Progress(3, ["cpu 0"], live=False, eta=eta)
    progress.event("running", plan.tasks["s0.train"], [0])
    progress.started["s0.train"] = time.time() - 2400  # as if it started 40 minutes ago
    progress.update_eta()
    line = progress.eta_line()
    assert line.startswith("0/3 tasks, ETA unknown: s0.train has run 40 min 00 s, past its ")
    assert "estimate of 2 s, and reports no progress; the rest at least 3 s" in line
    progress.worker_info = lambda: [{"task": "s0.train", "progress": "step 500/1000 loss 0.1"}]
    progress.update_eta()
    assert progress.eta_line() == "0/3 tasks, ETA 2 h 00 min (from the running tasks' progress)"
    assert progress.task_progress("s0.train") == "50 %, 40 min 00 s left"
    assert "50 %" in str(progress._table().columns[3]._cells)


def test_a_real_stage_slower_than_its_estimate_moves_the_eta_with_its_progress(
    tmp_path, monkeypatch
):
    """A real worker runs tests.fault_stages:progress_stage (2 s of load without progress,
    then 30 steps of 0.1 s, each reported) against an estimate of 0.5 s. While it loads
    past its estimate the ETA says unknown; once it reports, the ETA is at least its own
    time left at its pace plus the task after it; the table shows its share."""
    from pita.core.gpu_manager import GPUManager
    from pita.core.worker_pool import WorkerPool

    monkeypatch.setattr("pita.core.progress.OVERDUE_GRACE_S", 0.0)  # unknown at once
    monkeypatch.setenv("PITA_TEST_LOAD_S", "2")
    monkeypatch.setenv("PITA_TEST_STEPS", "30")
    monkeypatch.setenv("PITA_TEST_STEP_S", "0.1")
    slow = TaskSpec(
        id="slow", algo="GRPO", dataset="-", family="-", round=0, stage="train",
        fn="tests.fault_stages:progress_stage",
    )  # fmt: skip
    plan = Plan()
    plan.add(slow)
    plan.add(_task("after", stage="evaluate", deps=["slow"]))
    eta = Eta(plan.tasks, set(), TaskDurations({"slow": 0.5, "after": 1.0}), _scheduler(1))
    pool = WorkerPool(GPUManager("fake:1"), heartbeat_s=0.2, preimport=False, log_dir=tmp_path)
    progress = Progress(2, ["fake 0"], live=False, worker_info=pool.workers, eta=eta)
    seen = []
    try:
        with progress:
            future = pool.submit(slow, [0], {}, tmp_path)
            progress.event("running", slow, [0])
            while not future.done():
                progress.update_eta()
                r = progress._eta[0]
                seen.append((r, progress.eta_line(), progress.task_progress("slow")))
                time.sleep(0.05)
        assert future.result().ok, future.result().message
    finally:
        pool.shutdown(kill=True)
    unknown = [line for r, line, _ in seen if r.unknown]
    assert unknown and "ETA unknown: slow has run" in unknown[0]
    paced = [(r, shown) for r, _, shown in seen if r.fraction.get("slow", 0) >= 0.05]
    assert paced, "no progress reached the orchestrator"
    for r, shown in paced:
        f, left = r.fraction["slow"], r.left["slow"]
        assert left is not None and (left > 0 or f == 1.0)  # at its own pace, never "done"
        assert r.seconds >= left + 1.0 - 1e-6  # its own time left, then the task after it
        assert shown.startswith(f"{100 * f:.0f} %, ")


@pytest.mark.slow
def test_a_real_run_logs_its_eta_and_ends_with_the_time_table(smoke_run):
    """The session's smoke run (fake:2, its own duration cache): run.log has an ETA line
    before the end, results/ the timeline and the time table; a dry run afterwards estimates
    from the recorded durations."""
    run_dir = smoke_run.run_dir
    log = (run_dir / "run.log").read_text()
    end = log.index("All 45 tasks done")
    eta_at = log.find(" tasks, ETA ")
    assert 0 <= eta_at < end, log[-3000:]
    assert NO_MEASURE_YET in log or "(from this run's durations)" in log
    results = run_dir / "results"
    assert (results / "timeline.png").stat().st_size > 1000
    time_md = (results / "time.md").read_text()
    assert "| stage |" in time_md and "| device |" in time_md
    with open(results / "time.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["section"] for r in rows} == {"stage", "chain", "device"}
    assert sum(int(r["tasks"]) for r in rows if r["section"] == "stage") == 45
    assert "Where the time went" in log
    assert json.loads((smoke_run.cwd / "cache" / "task_durations.json").read_text())

    dry = run_cli([*smoke_run.args, "dry_run=true"], smoke_run.cwd, env=smoke_run.env, timeout=120)
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert "Estimated wall time: ~" in dry.stdout
    assert "(from earlier runs' durations)" in dry.stdout


def test_without_history_the_dry_run_says_it_cannot_know_the_wall_time(tmp_path):
    """issue 45: with no measured duration the dry run prints no figure (work units gave
    33 s for a run whose pretrain alone took 22 min); it says why and where they come from."""
    env = {"PITA_CACHE_DIR": str(tmp_path / "cache")}
    proc = run_cli(["experiment=smoke", "dry_run=true"], tmp_path, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("Estimated wall time"))
    assert line.startswith("Estimated wall time: unknown until tasks have run here: none of ")
    assert "~" not in line and "makespan" not in proc.stdout
    assert "No history for 45 of 45 task(s), estimated from work units: " in proc.stdout


def test_the_dry_run_scales_earlier_durations_by_task_size_and_names_those_without(
    tmp_path, monkeypatch
):
    """A smoke run recorded 10 s per task (GRPO's train: 4 steps, 40 s); the next config
    trains GRPO for 16 steps: its estimate is the recorded one x 4, not work units, and the
    tasks no earlier run has a kind of (GRPO-HF here, not recorded) are named."""
    from pita.core.gpu_manager import GPUManager
    from pita.core.progress import SCALED
    from pita.experiment.cli import compose_config
    from pita.experiment.durations import duration_key, record_durations
    from pita.experiment.plan import plan_experiment
    from pita.experiment.run import history_line, task_durations

    monkeypatch.setenv("PITA_CACHE_DIR", str(tmp_path / "cache"))
    gpu = GPUManager("fake:1")
    before = compose_config(["experiment=smoke"])
    plan = plan_experiment(before, 1)
    grpo = next(t for t in plan.tasks.values() if t.algo == "GRPO" and t.stage == "train")
    recorded = [t for t in plan.tasks.values() if t.algo != "GRPO-HF"]
    _journal(
        tmp_path / "journal.jsonl",
        [
            {"event": "task_done", "task": t.id, "wall_s": 40.0 if t is grpo else 10.0}
            for t in recorded
        ],
    )
    assert record_durations(tmp_path, plan.tasks, duration_key(before, gpu.kind)) == len(recorded)

    after = compose_config(["experiment=smoke", "algos.GRPO.steps=16"])
    later = plan_experiment(after, 1)
    durations = task_durations(after, gpu)
    assert durations.estimate(later.tasks[grpo.id]) == (pytest.approx(160.0), SCALED)
    evaluate = later.tasks[grpo.id.replace(".train", ".evaluate")]
    assert durations.estimate(evaluate) == (pytest.approx(10.0), SCALED)  # same size
    line = history_line(later, durations)
    # a second recorded size of GRPO's train (16 steps in 100 s): a start-up of 20 s plus
    # 5 s a step, so 64 steps are 20 + 320 s, not 640 s in proportion
    _journal(tmp_path / "journal.jsonl", [{"event": "task_done", "task": grpo.id, "wall_s": 100.0}])
    record_durations(tmp_path, later.tasks, duration_key(after, gpu.kind))
    longer = compose_config(["experiment=smoke", "algos.GRPO.steps=64"])
    estimate = task_durations(longer, gpu).estimate(plan_experiment(longer, 1).tasks[grpo.id])
    assert estimate == (pytest.approx(340.0), SCALED)
    blind = [t.id for t in later.tasks.values() if t.algo == "GRPO-HF"]
    assert line.startswith(f"No history for {len(blind)} of {len(later.tasks)} task(s)")
    assert blind[0] in line and grpo.id not in line


# --- time table and timeline ----------------------------------------------------------------


def _journal(path, events):
    path.write_text("".join(json.dumps(e) + "\n" for e in events))


def test_time_table_per_stage_chain_and_device_from_the_journal(tmp_path):
    from pita.results.timeline import spans, time_rows, write_time_report

    plan = Plan()
    plan.add(_task("DPO.goal_walk.tiny.r0.train"))
    plan.add(_task("DPO.goal_walk.tiny.r0.evaluate", stage="evaluate"))
    plan.add(_task("GRPO.goal_walk.tiny.r0.train", algo="GRPO"))
    events = [
        {"ts": 100.0, "event": "run_started"},
        {"ts": 100.0, "event": "task_running", "task": "DPO.goal_walk.tiny.r0.train", "devices": [0]},
        {"ts": 100.0, "event": "task_running", "task": "GRPO.goal_walk.tiny.r0.train", "devices": [1]},
        {"ts": 106.0, "event": "task_done", "task": "DPO.goal_walk.tiny.r0.train", "wall_s": 6.0},
        {"ts": 106.0, "event": "task_running", "task": "DPO.goal_walk.tiny.r0.evaluate", "devices": [0]},
        {"ts": 108.0, "event": "task_failed", "task": "GRPO.goal_walk.tiny.r0.train"},
        {"ts": 110.0, "event": "task_done", "task": "DPO.goal_walk.tiny.r0.evaluate", "wall_s": 4.0},
        {"ts": 110.0, "event": "run_finished"},
    ]  # fmt: skip
    all_spans, wall = spans(events, plan.tasks)
    assert wall == 10.0 and len(all_spans) == 3
    rows = {(r["section"], r["name"]): r for r in time_rows(all_spans, wall, ["GPU 0", "GPU 1"])}
    assert rows[("stage", "train")]["seconds"] == 14.0
    assert rows[("stage", "train")]["failed_s"] == 8.0
    assert rows[("stage", "train")]["share_%"] == 77.8  # 14 of 18 task seconds
    assert rows[("chain", "DPO.goal_walk.tiny")]["seconds"] == 10.0
    assert rows[("device", "GPU 0")]["share_%"] == 100.0
    assert rows[("device", "GPU 1")]["share_%"] == 80.0

    (tmp_path / "journal.jsonl").write_text("")
    _journal(tmp_path / "journal.jsonl", events)
    table = write_time_report(tmp_path, plan.tasks, ["GPU 0", "GPU 1"])
    assert "| train | 2 | 14.0 | 77.8 % | 8.0 |" in table
    assert (tmp_path / "results" / "timeline.png").stat().st_size > 1000
    assert (tmp_path / "results" / "time.csv").is_file()
    unplotted = tmp_path / "unplotted"  # executor.timeline_plot=false: the table, no picture
    (unplotted / "results").mkdir(parents=True)
    _journal(unplotted / "journal.jsonl", events)
    assert write_time_report(unplotted, plan.tasks, ["GPU 0", "GPU 1"], plot=False) == table
    assert (unplotted / "results" / "time.csv").is_file()
    assert not (unplotted / "results" / "timeline.png").exists()


def test_busy_time_of_packed_tasks_is_their_union():
    from pita.results.timeline import _busy

    assert _busy([(0, 4), (2, 6), (8, 9)]) == 7


# --- end lines, failure summary, resume hint ------------------------------------------------


def test_failure_summary_never_prints_an_empty_last_line():
    from pita.experiment.run import last_line

    assert last_line("") == "the log is empty"
    assert last_line("\n  \n") == "the log is empty"
    assert last_line("step 1\nValueError: boom\n\n   \n") == "last line: ValueError: boom"


@pytest.mark.parametrize(
    "argv0, command",
    [
        ("/home/me/.venv/bin/pita", "pita"),
        ("/repo/pita/__main__.py", "python -m pita"),
        ("run_parallel.py", "python run_parallel.py"),
    ],
)
def test_resume_hint_says_the_command_the_user_ran(monkeypatch, argv0, command):
    from pita.experiment.run import resume_command

    monkeypatch.setenv("PITA_COMMAND", json.dumps([argv0, "experiment=smoke"]))
    assert resume_command("outputs/smoke/x") == f"{command} resume_from=outputs/smoke/x"


def test_legend_names_every_results_column_once():
    from pita.results.report import COLUMNS, SE_COLUMN, legend

    text = legend()
    for column in [*COLUMNS, SE_COLUMN]:
        assert text.count(f"{column} = ") == 1, column


# --- pass@1 standard error and the frontier plot ---------------------------------------------


def test_single_run_pass_at_1_carries_its_binomial_standard_error(tmp_path):
    from pita.core.paths import Artifact, RunPaths
    from pita.results.report import COLUMNS, write_report

    plan = Plan()
    plan.add(_task("DPO.goal_walk.tiny.r0.evaluate", stage="evaluate_merge"))
    folder = RunPaths(tmp_path).task("DPO.goal_walk.tiny.r0.evaluate").final
    folder.mkdir(parents=True)
    row = {
        "algo": "DPO",
        "dataset": "goal_walk",
        "family": "tiny",
        "round": 0,
        "eta": None,
        "n_prompts": 10,
        "samples": 40,
        "pass@1": 0.25,
        "maj@k": 0.3,
        "avg_reward": 0.25,
        "kl": 0.5,
    }
    (folder / Artifact.METRICS).write_text(json.dumps([row]))
    write_report(None, plan, tmp_path)
    with open(tmp_path / "results" / "summary.csv") as f:
        [out] = list(csv.DictReader(f))
    assert list(out)[: len(COLUMNS)] == COLUMNS  # today's columns first, unchanged
    assert math.isclose(float(out["pass@1_se"]), math.sqrt(0.25 * 0.75 / 40))  # 0.06847
    assert "pass@1_se" in (tmp_path / "results" / "summary.md").read_text()


def test_frontier_axis_turns_symlog_when_an_outlier_squashes_the_rest(tmp_path):
    from pita.results.aggregate import kl_axis, plot_frontier

    assert kl_axis([0.0, 0.1, 0.2, 0.3, 0.5]) == ("linear", None)
    assert kl_axis([0.0, 0.05, 0.4]) == ("linear", None)  # three points: nothing to squash
    assert kl_axis([0.1, 0.2, 5.0, 5.5, 6.0]) == ("linear", None)  # two groups, not outliers
    assert kl_axis([0.0, 0.1, 0.2, 0.3, 0.4, 18.7]) == ("symlog", 0.4)
    # the default experiment's run (issue 22): DPO's 18.7 next to guided rows up to 2.56
    default_run = [0.0, 0.291, 0.445, 0.508, 0.858, 1.309, 1.611, 1.621, 1.85, 2.561, 18.723]
    assert kl_axis(default_run) == ("symlog", 2.561)
    rows = [
        {"algo": algo, "family": "tiny", "round": 0, "eta": eta, "kl": kl, "pass@1": p, "avg_reward": p}
        for algo, eta, kl, p in [
            ("QSharp", 1.0, 0.1, 0.4),
            ("QSharp", 5.0, 0.4, 0.6),
            ("PITA", 1.0, 0.2, 0.45),
            ("DPO", None, 18.7, 0.7),
        ]
    ]  # fmt: skip
    assert plot_frontier(rows, tmp_path / "frontier.png")
    assert (tmp_path / "frontier.png").stat().st_size > 1000


def test_durations_are_recorded_per_task_and_config_and_read_back(tmp_path):
    from omegaconf import OmegaConf

    from pita.experiment.durations import duration_key, load_history, record_durations

    plan = Plan()
    plan.add(_task("DPO.goal_walk.tiny.r0.train"))
    _journal(
        tmp_path / "journal.jsonl",
        [{"ts": 1.0, "event": "task_done", "task": "DPO.goal_walk.tiny.r0.train", "wall_s": 12.5}],
    )
    cfg = OmegaConf.create(
        {"experiment": {"name": "x", "seed": 0}, "training": {"max_grad_norm": 1.0}}
    )
    key = duration_key(cfg, "cpu")
    cache = tmp_path / "cache" / "task_durations.json"
    assert record_durations(tmp_path, plan.tasks, key, cache) == 1
    task = plan.tasks["DPO.goal_walk.tiny.r0.train"]
    assert load_history(cache).exact == {key(task): 12.5}
    other_seed = OmegaConf.create(
        {"experiment": {"name": "x", "seed": 1}, "training": {"max_grad_norm": 1.0}}
    )
    assert duration_key(other_seed, "cpu")(task) == key(task)  # a seed sweep shares durations
    other_lr = OmegaConf.create(
        {"experiment": {"name": "x", "seed": 0}, "training": {"max_grad_norm": 0.5}}
    )
    assert duration_key(other_lr, "cpu")(task) != key(task)
    assert duration_key(cfg, "cuda")(task) != key(task)
    assert load_history(tmp_path / "absent.json").exact == {}
