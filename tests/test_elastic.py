"""Elastic training tasks (issue 32): k chosen at dispatch by simulating the rest of the plan,
speedup curves learned from the duration cache, a gang's wait bounded by its prediction, and
the dry run's chosen k and predicted makespan."""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future

import pytest

from pita.core.dag import Plan, critical_path_priorities
from pita.core.elastic import (
    DEFAULT_ALPHA,
    GangStartup,
    Sizer,
    Sizing,
    SpeedupCurves,
    curve_key,
    rank_choices,
    speedup,
)
from pita.core.executor import TaskOutcome
from pita.core.journal import Journal, read_events
from pita.core.parallel_executor import (
    DagRunner,
    DeviceState,
    Scheduler,
    fresh_scheduler,
    simulate_window,
)
from pita.core.tasks import TaskSpec
from tests.conftest import only, run_cli, run_cli_later


def _task(tid, stage="collect", deps=(), elastic=False, work=1.0, algo="PITA") -> TaskSpec:
    from tests.conftest import task_spec

    return task_spec(
        tid,
        algo=algo,
        stage=stage,
        fn="-",
        deps=list(deps),
        ranks=[1, 2, 4, 8] if elastic else [],
        work=work,
        mem_mb=100,
    )


def _scheduler(n: int) -> Scheduler:
    return Scheduler([DeviceState(i, 1000, 1000) for i in range(n)], max_tasks_per_device=1)


def _sizer(seconds: dict[str, float], n: int, alpha=0.1, startup=None, **kw) -> Sizer:
    curves = SpeedupCurves(default_alpha=alpha, startup=GangStartup(startup or {1: 0.0, 2: 1.0}))
    sched = _scheduler(n)
    return Sizer(
        curves,
        lambda t: seconds[t.id],
        lambda tasks, secs, first, resize=None, ends=None: simulate_window(
            tasks, fresh_scheduler(sched), secs, first, resize, ends
        ),
        n_devices=n,
        max_ranks=n,
        **kw,
    )


def _critical_path_plan() -> tuple[Plan, dict[str, float]]:
    """The default experiment's shape: a long value-training task (PITA's train) ready while
    other chains' shorter tasks also want the 8 devices; evaluate follows the train."""
    plan = Plan()
    seconds = {}
    plan.add(_task("pita.train", "train", elastic=True, work=20))
    seconds["pita.train"] = 200.0
    plan.add(_task("pita.evaluate", "evaluate", deps=["pita.train"], work=1))
    seconds["pita.evaluate"] = 2.0
    for c in range(4):  # other chains: collect shards then a short train
        for s in range(2):
            plan.add(_task(f"c{c}.collect.s{s}", algo=f"A{c}"))
            seconds[f"c{c}.collect.s{s}"] = 10.0
        deps = [f"c{c}.collect.s{s}" for s in range(2)]
        plan.add(_task(f"c{c}.train", "train", deps=deps, algo=f"A{c}", work=2))
        seconds[f"c{c}.train"] = 20.0
    critical_path_priorities(plan)
    return plan, seconds


def test_speedup_curve_and_rank_choices():
    assert speedup(1, 0.3) == 1.0
    assert speedup(8, 0.0) == 8.0
    assert speedup(8, 1.0) == 1.0
    assert speedup(2, 0.1) == pytest.approx(2 / 1.1)
    assert rank_choices(8, 8) == [1, 2, 4, 8]
    assert rank_choices(8, 6) == [1, 2, 4]  # never more than the run's devices
    assert rank_choices(1, 8) == [1]


def test_gang_startup_interpolates_defaults_and_prefers_measurements():
    startup = GangStartup({1: 0.0, 2: 2.0, 8: 8.0})
    assert startup(1) == 0.0
    assert startup(4) == pytest.approx(4.0)
    assert startup(16) == pytest.approx(16.0)  # past the table: linear
    startup.observe(4, 1.5)
    assert startup(4) == 1.5


def test_curve_learned_from_seconds_at_two_k_else_the_conservative_default():
    train = _task("a.train", "train", elastic=True)
    startup = GangStartup({1: 0.0, 4: 2.0})
    t4 = 100.0 * (1 + 0.1 * 3) / 4 + 2.0  # alpha = 0.1, plus the gang's start-up
    history = {"k1": {"curve": curve_key(train), "by_ranks": {"1": 100.0, "4": t4}}}
    curves = SpeedupCurves(history=history, startup=startup)
    alpha, source = curves.alpha(train)
    assert source == "learned" and alpha == pytest.approx(0.1)
    other = _task("b.pretrain", "pretrain", elastic=True)
    assert curves.alpha(other) == (DEFAULT_ALPHA, "default")
    assert curves.seconds(train, 100.0, 4) == pytest.approx(t4)
    assert curves.one_rank(train, t4, 4) == pytest.approx(100.0)
    # this run's own observation of a new curve is learned too
    curves.observe("k2", other, 1, 50.0)
    curves.observe("k2", other, 2, 50.0 * 1.2 / 2 + startup(2))
    assert curves.alpha(other)[1] == "learned"


def test_the_critical_path_task_waits_for_idle_devices_when_the_simulation_says_so():
    plan, seconds = _critical_path_plan()
    sizer = _sizer(seconds, 8)
    sizing = sizer.size(plan.tasks["pita.train"], plan.tasks, {})
    assert sizing.simulated and sizing.k > 1
    assert set(sizing.predicted) == {1, 2, 4, 8}
    # the earliest predicted end, or within 2 % of it (then the k whose own chain ends first)
    assert sizing.predicted[sizing.k] <= min(sizing.predicted.values()) + 0.02 * 202
    assert sizing.predicted[sizing.k] < sizing.predicted[1] - 50  # 200 s on one rank


def test_elastic_tasks_ready_later_are_sized_inside_the_simulation():
    """A decision does not assume the later elastic tasks stay on one rank: B (200 s on one
    rank, ready at 1 s) gets devices in each of A's simulations (the idle ones when it is
    ready), and the prediction is the whole plan's simulated end, not B's one-rank chain
    counted again after it."""
    plan = Plan()
    plan.add(_task("a.train", "train", elastic=True))
    plan.add(_task("x.collect", algo="B"))
    plan.add(_task("b.train", "train", deps=["x.collect"], elastic=True, algo="B"))
    critical_path_priorities(plan)
    seconds = {"a.train": 100.0, "x.collect": 1.0, "b.train": 200.0}
    sizer = _sizer(seconds, 4, startup={1: 0.0, 2: 1.0, 4: 3.0})
    sizing = sizer.size(plan.tasks["a.train"], plan.tasks, {})
    b_on_two = 1.0 + 200.0 / speedup(2, 0.1) + 1.0
    assert sizing.predicted[1] == pytest.approx(b_on_two)  # B took 2 of the 3 idle devices
    assert max(sizing.predicted.values()) < 201.0  # B is never left on one rank
    assert sizing.predicted[sizing.k] == min(sizing.predicted.values())
    assert plan.tasks["b.train"].gpus == 1  # the simulation sized copies


def test_dispatch_priority_is_the_seconds_to_the_end_of_the_plan():
    """Work units say the two chains are alike; the duration cache says one is 10x longer:
    it goes first."""
    plan = Plan()
    for c in ("slow", "fast"):
        plan.add(_task(f"{c}.collect", algo=c))
        plan.add(_task(f"{c}.train", "train", deps=[f"{c}.collect"], elastic=True, algo=c))
    critical_path_priorities(plan)
    assert plan.tasks["slow.train"].priority == plan.tasks["fast.train"].priority
    seconds = {"slow.collect": 1.0, "slow.train": 100.0, "fast.collect": 1.0, "fast.train": 10.0}
    _sizer(seconds, 2).prioritize(plan.tasks)
    assert plan.tasks["slow.collect"].priority == pytest.approx(101.0)
    assert plan.tasks["fast.collect"].priority == pytest.approx(11.0)


def test_on_a_big_plan_a_task_off_the_critical_path_gets_one_rank_without_a_simulation():
    plan, seconds = _critical_path_plan()
    plan.tasks["c0.train"].ranks = [1, 2, 4, 8]
    seconds["c0.train"] = 2.0  # far shorter than the remaining work over 8 devices
    # a plan larger than the simulation window (a small one is always simulated whole)
    sizing = _sizer(seconds, 8, window=5).size(plan.tasks["c0.train"], plan.tasks, {})
    assert sizing.k == 1 and not sizing.simulated and sizing.predicted == {}


def test_start_up_too_large_to_pay_keeps_one_rank():
    plan, seconds = _critical_path_plan()
    sizer = _sizer(seconds, 8, startup={1: 0.0, 2: 500.0})
    assert sizer.size(plan.tasks["pita.train"], plan.tasks, {}).k == 1


def test_dry_run_sizing_shortens_the_simulated_makespan():
    from pita.experiment.sizing import dry_run_sizing

    plan, seconds = _critical_path_plan()
    sizer = _sizer(seconds, 8)
    out = dry_run_sizing(plan, _scheduler(8), sizer)
    assert plan.tasks["pita.train"].gpus > 1
    assert out["sized"] == 1 and out["makespan_s"] < out["rigid_makespan_s"]
    assert out["placement"]["pita.train"] == sorted(out["placement"]["pita.train"])
    assert len(out["placement"]["pita.train"]) == plan.tasks["pita.train"].gpus


class _ListJournal:
    def __init__(self):
        self.events: list[dict] = []

    def append(self, event: str, **fields):
        self.events.append({"event": event, **fields})


class _TimedExecutor:
    """Completes each task after `seconds[task.id]` on a timer thread; records devices."""

    def __init__(self, seconds: dict[str, float]):
        self.seconds = seconds
        self.devices: dict[str, list[int]] = {}

    def submit(self, task, devices, cfg_dict, run_dir, attempt):
        self.devices[task.id] = list(devices)
        fut: Future = Future()
        out = TaskOutcome(task_id=task.id, ok=True, wall_s=self.seconds[task.id], result={})
        threading.Timer(self.seconds[task.id], fut.set_result, args=(out,)).start()
        return fut


def test_dag_runner_sizes_at_dispatch_and_journals_the_decision():
    plan, _ = _critical_path_plan()
    seconds = {tid: 0.01 for tid in plan.tasks}
    estimates = {tid: 10.0 for tid in plan.tasks} | {"pita.train": 200.0}
    journal = _ListJournal()
    executor = _TimedExecutor(seconds)
    runner = DagRunner(
        plan,
        executor,
        _scheduler(8),
        cfg_dict={},
        run_dir="-",
        journal=journal,
        sizer=_sizer(estimates, 8),
    )
    assert runner.run().ok
    [sized] = [e for e in journal.events if e["event"] == "task_sized"]
    assert sized["task"] == "pita.train" and sized["ranks"] > 1
    assert set(sized["predicted_end_s"]) == {"1", "2", "4", "8"}
    assert len(executor.devices["pita.train"]) == sized["ranks"]
    running = [e for e in journal.events if e["event"] == "task_running"]
    assert next(e for e in running if e["task"] == "pita.train")["devices"] == sorted(
        executor.devices["pita.train"]
    )


class _FixedSizer:
    """Always k = 4, predicted to start at once (so waiting at all is past the prediction)."""

    enabled = True
    choices = [1, 2, 4]

    def __init__(self):
        self.decisions: dict[str, Sizing] = {}

    def size(self, task, remaining, running_left):
        self.decisions[task.id] = Sizing(task.id, 4, {4: 1.0}, 0.0, 0.0, True)
        return self.decisions[task.id]

    def seconds(self, task, k=None):
        return 1.0

    def ranks_of(self, task):
        return self.choices

    def prioritize(self, tasks):
        pass  # the plan's priorities

    def observe(self, task, wall_s, result):
        pass


def test_a_gang_waiting_past_its_predicted_start_shrinks_to_the_free_devices():
    """No task waits behind a gang longer than predicted: the gang takes what is free."""
    plan = Plan()
    plan.add(_task("blocker", work=100))  # higher priority: placed first, holds device 0
    plan.add(_task("gang.train", "train", elastic=True, work=1))
    critical_path_priorities(plan)
    journal = _ListJournal()
    executor = _TimedExecutor({"blocker": 4.0, "gang.train": 0.01})
    runner = DagRunner(
        plan,
        executor,
        _scheduler(4),
        cfg_dict={},
        run_dir="-",
        journal=journal,
        sizer=_FixedSizer(),
    )
    assert runner.run().ok
    [resized] = [e for e in journal.events if e["event"] == "task_resized"]
    assert resized == {
        "event": "task_resized",
        "task": "gang.train",
        "ranks": 2,
        "previous": 4,
        "why": "waited",
    }  # 3 devices free: the largest k <= 3
    assert len(executor.devices["gang.train"]) == 2
    assert 0 not in executor.devices["gang.train"]


def test_seconds_per_rank_count_go_into_the_duration_cache_and_back(tmp_path):
    from pita.experiment.durations import load_history, load_rank_history, record_durations

    train = _task("a.train", "train", elastic=True)
    other = _task("a.collect")
    run_dir = tmp_path / "run"
    journal = Journal(run_dir / "journal.jsonl")
    for t, devices, wall in ((train, [0, 1, 2, 3], 40.0), (other, [0], 5.0)):
        journal.append("task_running", task=t.id, devices=devices, attempt=1)
        first = {"first_step_s": 6.0} if t is train else {}  # the stage reported steps
        journal.append("task_done", task=t.id, wall_s=wall, **first)
    journal.close()
    cache = tmp_path / "task_durations.json"
    old = {"wall_s": 100.0, "curve": "PITA|train|tiny", "by_ranks": {"1": 100.0}}
    cache.write_text(json.dumps({"a.train": {**old, "first_step": {"1": 2.0}}}))
    tasks = {t.id: t for t in (train, other)}
    assert record_durations(run_dir, tasks, lambda t: t.id, cache, one_rank=lambda t, s, k: s * k)
    history = load_rank_history(cache)
    assert history["a.train"] == {
        "curve": "PITA|train|tiny",
        "by_ranks": {"1": 100.0, "4": 40.0},
        "first_step": {"1": 2.0, "4": 6.0},  # dispatch -> first step per k, across runs
    }
    assert "a.collect" not in history  # only elastic tasks keep seconds per rank count
    assert load_history(cache).exact == {"a.train": 160.0, "a.collect": 5.0}  # one-rank figures
    assert [e["event"] for e in read_events(run_dir / "journal.jsonl")][:1] == ["task_running"]
    curves = SpeedupCurves(history=history, startup=GangStartup({1: 0.0, 4: 0.0}))
    assert curves.alpha(train) == (pytest.approx((4 * 40 / 100 - 1) / 3), "learned")


def test_dry_run_prints_the_chosen_ranks_and_the_predicted_makespan(tmp_path):
    args = [
        "system.devices=fake:4",
        "training.parallel_strategy=data_parallel",
        *only("reference", "PITA"),
        "dry_run=true",
    ]
    env = {"PITA_CACHE_DIR": str(tmp_path / "cache")}  # no history: no figure (issue 45)
    proc = run_cli(args, tmp_path, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "ranks chosen at dispatch by simulating the rest of the plan" in out
    lines = [ln.split() for ln in out.splitlines() if " k=" in ln]
    assert {ln[0] for ln in lines} >= {"pretrain.goal_walk.tiny", "PITA.goal_walk.tiny.r0.train"}
    assert all(ln[1] in ("k=1", "k=2", "k=4") for ln in lines)
    [line] = [ln for ln in out.splitlines() if ln.startswith("Predicted makespan:")]
    assert line.startswith("Predicted makespan: unknown without measured durations; on work ")
    assert "of the least ranks'" in line and "~" not in line


def _rows(run_dir) -> list[dict]:
    import csv

    with open(run_dir / "results" / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    return [{k: v for k, v in r.items() if not k.endswith("_s")} for r in rows]  # no timings


def _same(a: list[dict], b: list[dict], rel: float) -> bool:
    """Row for row, column for column: numbers within `rel` (float reduction order), the rest
    equal."""
    if len(a) != len(b):
        return False
    for ra, rb in zip(a, b):
        if ra.keys() != rb.keys():
            return False
        for k in ra:
            try:
                x, y = float(ra[k]), float(rb[k])
            except ValueError:
                if ra[k] != rb[k]:
                    return False
                continue
            if abs(x - y) > rel * max(abs(x), abs(y), 1e-12):
                return False
    return True


@pytest.mark.long
@pytest.mark.slow
def test_results_do_not_depend_on_the_ranks_a_task_got(tmp_path):
    """One experiment on fake:2 with every training task on one rank and with the ranks the
    Sizer chose (some training task on k = 2): every results row is the same, up to float
    reduction order (measured on fake:4: 7e-5 relative on one KL, the rest identical; fake:2
    keeps the check at 28 s of CPU instead of 44 s).

    Both runs have 2 collect / evaluate shards, so only the ranks differ (that the shard
    count changes no row either: tests/test_shard_invariance.py). The one-rank run says
    `none`: a task on one rank runs the same code under data_parallel (no gang below 2
    ranks, pita/runtime/gang.py), but a data_parallel run's workers would each start a
    forkserver for gangs that never come."""
    from tests.conftest import journal, run_dirs

    base = [
        "experiment=smoke",
        "executor.progress=false",
        "system.devices=fake:2",
        "pretrain.steps=8",
        "dataset.test_size=8",
        *only("reference", "QSharp"),
    ]
    rows, runs = {}, {}
    # both at once: they share nothing
    for name, ranks, strategy in (("rigid", 1, "none"), ("sized", 8, "data_parallel")):
        args = [*base, f"training.parallel_strategy={strategy}"]
        args += [f"executor.max_ranks_per_task={ranks}", f"experiment.name={name}"]
        # a fresh duration cache: the Sizer decides from work units, not a learned curve
        env = {"PITA_CACHE_DIR": str(tmp_path / f"cache-{name}")}
        runs[name] = run_cli_later(args, tmp_path, env=env, timeout=900)
    for name, future in runs.items():
        proc = future.result()
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        [run_dir] = run_dirs(tmp_path, name)
        rows[name] = _rows(run_dir)
        sized = [e for e in journal(run_dir) if e["event"] == "task_sized"]
        assert any(e["ranks"] > 1 for e in sized) == (name == "sized"), sized
    assert rows["rigid"] and _same(rows["rigid"], rows["sized"], rel=1e-3)


def test_the_live_table_and_the_timeline_show_a_gang_and_its_resize(tmp_path):
    from pita.core.progress import Progress
    from pita.results.timeline import resize_marks, spans, time_rows, write_time_report
    from pita.results.timeline_plot import timeline_model

    progress = Progress(2, ["GPU 0", "GPU 1", "GPU 2"], live=False)
    progress.running = {"a.train": [1, 2], "b.collect": [0]}
    assert progress._rank_label("a.train", 2) == "a.train [rank 1/2]"
    assert progress._rank_label("b.collect", 0) == "b.collect"

    plan = Plan()
    plan.add(_task("a.train", "train", elastic=True))
    events = [
        {"ts": 10.0, "event": "run_started"},
        {"ts": 10.0, "event": "task_sized", "task": "a.train", "ranks": 4},
        {"ts": 12.0, "event": "task_resized", "task": "a.train", "ranks": 2, "previous": 4},
        {"ts": 12.0, "event": "task_running", "task": "a.train", "devices": [1, 2]},
        {"ts": 20.0, "event": "task_done", "task": "a.train", "wall_s": 8.0},
        {"ts": 20.0, "event": "run_finished"},
    ]
    assert resize_marks(events) == [(0.0, "a.train", 2)]
    all_spans, wall = spans(events, plan.tasks)
    model = timeline_model(all_spans, ["G0", "G1", "G2"], resize_marks(events))
    [bar] = model.bars  # the gang: one bar across its two device rows
    assert bar.rows == (1, 2) and bar.gang == 2
    [mark] = [m for m in model.markers if m.kind == "resize"]
    assert (mark.rows, mark.text) == ((1, 2), "2 ranks")
    rows = {(r["section"], r["name"]): r for r in time_rows(all_spans, wall, ["G0", "G1", "G2"])}
    assert rows[("device", "G0")]["share_%"] == 0.0  # device-busy % per device
    assert rows[("device", "G1")]["share_%"] == rows[("device", "G2")]["share_%"] == 100.0
    journal = Journal(tmp_path / "journal.jsonl")
    journal.close()
    (tmp_path / "journal.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    table = write_time_report(tmp_path, plan.tasks, ["G0", "G1", "G2"])
    assert "| G1 | 1 | 8.0 | 100.0 % |" in table
    assert (tmp_path / "results" / "timeline.png").stat().st_size > 1000


def test_under_data_parallel_a_gang_forced_by_memory_is_sized_from_its_least_k():
    """Issue 31's rule kept: a training task too large for one device gets the smallest FSDP
    gang that fits (pita/experiment/gangs.py); under data_parallel that gang is its least k
    and the Sizer may give it more. The others are planned on one device, DDP at k > 1."""
    from pita.core.elastic import resized
    from pita.experiment import cli
    from pita.experiment.run import build_plan, make_gpu_manager
    from tests.test_gangs import BIG, _devices, _train_memory

    mem = _train_memory(BIG, "QSharp")
    device = (mem.per_rank_mb("fsdp", 2) + mem.per_rank_mb("none", 1)) // 2
    overrides = [_devices(device, 4), *only("reference", "QSharp"), *BIG]
    cfg = cli.compose_config([*overrides, "training.parallel_strategy=data_parallel"])
    plan = build_plan(cfg, make_gpu_manager(cfg))
    train = plan.tasks["QSharp.goal_walk.tiny.r0.train"]
    assert (train.gpus, train.strategy, train.ranks) == (2, "fsdp", [2, 4])
    four = resized(train, 4)  # FSDP: the gang's total divides over more ranks
    assert (four.gpus, four.strategy, four.mem_mb) == (4, "fsdp", train.mem_mb)
    pretrain = plan.tasks["pretrain.goal_walk.tiny"]
    assert (pretrain.gpus, pretrain.strategy, pretrain.ranks) == (1, "none", [1, 2, 4])
    two = resized(pretrain, 2)  # DDP: every rank holds the whole task
    assert (two.gpus, two.strategy, two.mem_mb) == (2, "ddp", 2 * pretrain.mem_mb)


def test_the_sizer_uses_the_measured_start_up_and_speedup_of_the_stage_kind():
    """On a CPU where a 2-rank DPO took 15.4 s against 11.9 s on one rank, 11 s of it the
    gang's start-up (first step at 15 s against 4 s): with that history the sizer keeps
    DPO's training on one rank; with none (the defaults: 3 s, alpha 0.25) it would take 2.
    Value training's history is its own (another curve)."""
    from pita.experiment.sizing import measured_startup

    dpo = _task("dpo.train", "train", elastic=True, algo="DPO")
    history = {
        "dpo.train|earlier": {
            "curve": "DPO|train|tiny",
            "by_ranks": {"1": 11.9, "2": 15.4},
            "first_step": {"1": 4.0, "2": 15.0},
        }
    }
    startup = measured_startup(history)
    assert startup(2, "DPO|train|tiny") == pytest.approx(11.0)
    assert startup(2, "PITA|train|tiny") == 3.0  # no measurement of its own: the default
    plan = {"dpo.train": dpo}

    def sizer(curves: SpeedupCurves) -> Sizer:
        sched = _scheduler(2)
        return Sizer(
            curves,
            lambda t: 11.9,
            lambda tasks, secs, first, resize=None, ends=None: simulate_window(
                tasks, fresh_scheduler(sched), secs, first, resize, ends
            ),
            n_devices=2,
            max_ranks=2,
        )

    learned = sizer(SpeedupCurves(history=history, startup=startup))
    assert learned.seconds(dpo, 2) > learned.seconds(dpo, 1)
    assert learned.size(dpo, plan, {}).k == 1
    assert sizer(SpeedupCurves()).size(dpo, plan, {}).k == 2  # the constant would have said 2
