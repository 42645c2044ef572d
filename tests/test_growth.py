"""A running training task grown at a checkpoint (issue 32 items 2 and 4): the run asks it to
checkpoint and stop (`TaskPaths.stop_request`), it stops with the outcome `stopped` (not a
failure, not a retry) and restarts from that checkpoint on a larger gang with the numbers of
an uninterrupted run; the decision (pita/core/growth.py) and the scheduler's side."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pita.core.errors import STOPPED, StoppedAtCheckpoint
from pita.core.paths import TaskPaths
from tests.test_gang_training import (
    PRETRAIN,
    TRAIN,
    _assert_same,
    _context,
    _value_train,
    value_train_in,
    with_pi_ref,
)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A run folder holding a committed tiny π_ref (tests/test_gang_training.py's)."""
    return with_pi_ref(tmp_path_factory.mktemp("grow"))


@pytest.fixture(scope="module")
def value_single(run_dir):
    """The value-training task on one process, never interrupted."""
    return _value_train(run_dir, "none", 1, "single")


# --- the task side: stop at a checkpoint when asked, resume on more ranks -------------------


@pytest.mark.slow  # three value trainings (one process, 1 rank stopped, 2 ranks): ~15-40 s
def test_a_value_training_task_stops_when_asked_and_resumes_on_two_ranks_with_equal_results(
    run_dir, value_single, tmp_path, monkeypatch
):
    """One rank (data_parallel: its checkpoints resume on any k) is asked to stop once its
    third step is reported; it writes its checkpoint, raises StoppedAtCheckpoint, and the
    same task on 2 ranks continues from there: results row, final weights and every step's
    loss equal the uninterrupted one-process run's (the k-invariance tests' tolerance)."""
    from pita.algos.value_training import train_value
    from pita.runtime import context
    from tests.test_gang_training import _items

    monkeypatch.setattr(context, "PROGRESS_EVERY_S", 0.0)  # every step's progress line
    own = tmp_path / "grown"
    shutil.copytree(run_dir / "tasks", own / "tasks")
    ctx, lines = _context(own, "data_parallel", TRAIN, 1, "out")
    request = TaskPaths(own, TRAIN).stop_request
    seen: list[str] = []

    def heartbeat(line: str) -> None:  # the run asks once step 3 is reported
        seen.append(line)
        if line.startswith("step 3/"):
            request.write_text(json.dumps({"ranks": 2}))

    ctx.heartbeat = heartbeat
    with pytest.raises(StoppedAtCheckpoint) as stopped:
        train_value(ctx, _items())
    assert stopped.value.step == 3, seen
    ckpts = TaskPaths(own, TRAIN).checkpoints
    assert [p.name for p in ckpts.glob("step-*")] == ["step-3"]
    assert any("stopping at the checkpoint of step 3" in ln for ln in lines), lines
    request.unlink()  # the run removes its request before it dispatches the task again
    shutil.rmtree(own / "out")
    grown = value_train_in(own, "data_parallel", 2)
    assert any(ln.startswith("resumed from checkpoint") for ln in grown[2]), grown[2]
    _assert_same(value_single, grown, "value_model/model.safetensors", curve=False)
    assert _losses_of(grown[0]) == pytest.approx(_losses_of(value_single[0]), abs=1e-5)


def _losses_of(ctx) -> list[float]:
    """Every step's loss of the task's csv, by step (a stopped attempt's rows come first)."""
    import csv

    [path] = (ctx.run_dir / "logs").rglob(f"{ctx.task.id}.csv")
    with open(path, newline="") as f:
        by_step = {int(float(r["step"])): float(r["train/loss"]) for r in csv.DictReader(f)}
    return [by_step[s] for s in sorted(by_step)]


def test_a_two_rank_gang_stops_together_when_rank_zero_sees_the_request(tmp_path):
    """Pretrain on a 2-rank gang with the request present: rank 0 sees it after the first
    step and broadcasts the decision, both ranks stop at step 1 (the launcher reports no
    failed rank), the checkpoint is committed; without the request it resumes and finishes."""
    from pita.stages.pretrain import pretrain

    ctx, lines = _context(tmp_path, "data_parallel", PRETRAIN, 2, "out")
    request = TaskPaths(tmp_path, PRETRAIN).stop_request
    request.parent.mkdir(parents=True, exist_ok=True)
    request.write_text("{}")
    with pytest.raises(StoppedAtCheckpoint) as stopped:
        pretrain(ctx)
    assert stopped.value.step == 1
    assert [p.name for p in TaskPaths(tmp_path, PRETRAIN).checkpoints.glob("step-*")] == ["step-1"]
    request.unlink()
    shutil.rmtree(ctx.out_dir)
    ctx2, lines2 = _context(tmp_path, "data_parallel", PRETRAIN, 2, "out")
    result = pretrain(ctx2)
    assert any(ln.startswith("resumed from checkpoint") for ln in lines2), lines2
    assert result["effective_batch"] == 16
    assert (ctx2.out_dir / "model" / "model.safetensors").is_file()


# --- the decision -----------------------------------------------------------------------------


def _task(tid: str, gpus: int = 1, priority: float = 1.0, **kw):
    from pita.core.tasks import TaskSpec

    return TaskSpec(
        tid, "QSharp", "d", "tiny", 0, "train", "x:y", gpus=gpus, priority=priority, **kw
    )


def _policy(one_rank_s: float = 100.0, alpha: float = 0.0, startup: float = 2.0, **kw):
    """s(k) = k / (1 + alpha (k-1)); a k-rank gang starts in `startup` s beyond one rank."""
    from pita.core.growth import GrowthPolicy

    def up(k: int) -> float:
        return 0.0 if k <= 1 else startup

    def seconds(task, k: int) -> float:
        return one_rank_s * (1 + alpha * (k - 1)) / k + up(k)

    return GrowthPolicy(
        seconds=seconds, startup=lambda t, k: up(k), choices=lambda t: [1, 2, 4, 8], **kw
    )


def test_a_task_with_much_left_grows_into_the_idle_devices_and_one_near_its_end_does_not():
    from pita.core.growth import RunningTask

    policy = _policy(one_rank_s=100.0)
    early = RunningTask(_task("a"), elapsed_s=10.0)  # 90 s left on 1 rank
    [grow] = policy.decide([early], idle=3)
    assert (grow.previous, grow.ranks) == (1, 4)  # 1 + 3 idle: 4 ranks, the largest choice
    assert grow.left_s == pytest.approx(90.0)
    # the stop (2 s, unmeasured), the start-up on 4 (2 s), 90 s of work at 4 ranks' pace
    assert grow.grown_left_s == pytest.approx(2.0 + 2.0 + 90.0 / 4)
    late = RunningTask(_task("b"), elapsed_s=97.0)  # 3 s left: a resize costs more
    assert policy.decide([late], idle=3) == []
    assert policy.decide([early], idle=0) == []


def test_growth_never_shrinks_and_serves_the_critical_path_first():
    from pita.core.growth import RunningTask

    policy = _policy(one_rank_s=100.0)
    on_four = RunningTask(_task("big", gpus=4), elapsed_s=5.0)
    assert policy.decide([on_four], idle=1) == []  # 5 ranks is no choice; never fewer
    low = RunningTask(_task("low", priority=1.0), elapsed_s=10.0)
    high = RunningTask(_task("high", priority=9.0), elapsed_s=10.0)
    grows = policy.decide([low, high], idle=1)
    assert [(g.task, g.ranks) for g in grows] == [("high", 2)]  # one idle device: one task


def test_the_task_s_own_pace_corrects_a_wrong_estimate_and_a_measured_stop_cost_counts():
    from pita.core.growth import RunningTask

    policy = _policy(one_rank_s=10.0)  # the cache says 10 s on one rank
    # ...yet at 20 s it reports 20 % done: 80 s left at its own pace, worth growing
    slow = RunningTask(_task("a"), elapsed_s=20.0, fraction=0.2, first=(1.0, 0.0))
    [grow] = policy.decide([slow], idle=1)
    assert grow.left_s == pytest.approx(19.0 * 0.8 / 0.2)
    assert policy.decide([RunningTask(_task("a"), elapsed_s=20.0)], idle=1) == []  # no pace: past
    policy.stop_s.append(200.0)  # resizes measured this slow never pay here
    assert policy.decide([slow], idle=1) == []
    # a poor speedup (alpha 1: no gain from ranks) never grows
    assert _policy(alpha=1.0).decide([RunningTask(_task("c"), elapsed_s=1.0)], idle=7) == []


# --- the scheduler's side -------------------------------------------------------------------


class _Journal:
    def __init__(self):
        self.events: list[dict] = []

    def append(self, event: str, **fields) -> None:
        self.events.append({"event": event, **fields})

    def of(self, event: str) -> list[dict]:
        return [e for e in self.events if e["event"] == event]


class _Executor:
    """Runs `train` like a training task honouring stop requests (a thread that polls the
    request file, then answers `stopped`); `other` ends at once. `fail_on` ranks fail."""

    def __init__(self, run_dir: Path, fail_on: int | None = None):
        self.run_dir, self.fail_on = run_dir, fail_on
        self.submits: list[tuple[str, int, list[int], int]] = []

    def submit(self, task, devices, cfg_dict, run_dir, attempt=1):
        import threading
        import time
        from concurrent.futures import Future

        from pita.core.executor import TaskOutcome

        fut: Future = Future()
        self.submits.append((task.id, task.gpus, list(devices), attempt))
        request = TaskPaths(self.run_dir, task.id).stop_request

        def body() -> None:
            try:
                answer()
            except BaseException as exc:  # a bug here must fail the test, not hang it
                fut.set_exception(exc)

        def answer() -> None:
            if task.id == "other":
                time.sleep(0.2)
                fut.set_result(TaskOutcome(task.id, True, wall_s=0.2))
            elif task.gpus == self.fail_on:
                fut.set_result(TaskOutcome(task.id, False, "killed", "rank 1 of 2 failed"))
            elif task.gpus == 1 and len(self.submits) <= 2:  # the first attempt: until asked
                deadline = time.time() + 30
                while not request.exists() and time.time() < deadline:
                    time.sleep(0.05)
                fut.set_result(TaskOutcome(task.id, False, STOPPED, "stopped at step 3"))
            else:
                fut.set_result(TaskOutcome(task.id, True, wall_s=1.0))

        threading.Thread(target=body, daemon=True).start()
        return fut


def _grow_run(tmp_path: Path, fail_on: int | None = None):
    from pita.core.dag import Plan
    from pita.core.growth import Grower
    from pita.core.parallel_executor import DagRunner, DeviceState, Scheduler

    plan = Plan()
    plan.add(_task("train", priority=9.0))
    plan.add(_task("other", priority=1.0))
    (tmp_path / "tasks").mkdir()
    executor, journal = _Executor(tmp_path, fail_on), _Journal()
    grower = Grower(
        _policy(one_rank_s=100.0),
        tmp_path,
        growable=lambda t: t.id == "train",
        idle_s=0.1,
    )
    runner = DagRunner(
        plan,
        executor,
        Scheduler([DeviceState(i, 1000, 1000) for i in range(2)]),
        cfg_dict={},
        run_dir=tmp_path,
        journal=journal,
        grower=grower,
    )
    return runner.run(), executor, journal


def test_the_run_grows_a_running_task_into_a_freed_device_and_journals_the_resize(tmp_path):
    """`other` frees device 1; `train` (90+ s left on one rank) is asked to stop at a
    checkpoint, answers `stopped`, and runs again at once on both devices: attempt 1 still
    (not a retry), the request file removed, every step journaled."""
    summary, executor, journal = _grow_run(tmp_path)
    assert summary.ok and set(summary.done) == {"train", "other"}
    trains = [s for s in executor.submits if s[0] == "train"]
    assert [(k, devs, attempt) for _, k, devs, attempt in trains] == [
        (1, [0], 1),
        (2, [0, 1], 1),
    ]
    [asked] = journal.of("task_grow_requested")
    assert (asked["previous"], asked["ranks"]) == (1, 2)
    [resized] = journal.of("task_resized")
    assert (resized["why"], resized["previous"], resized["ranks"]) == ("grow", 1, 2)
    assert [e["task"] for e in journal.of("task_stopped")] == ["train"]
    assert not journal.of("task_failed") and not journal.of("task_retry")
    assert not TaskPaths(tmp_path, "train").stop_request.exists()


def test_a_resize_whose_larger_gang_fails_falls_back_to_the_old_ranks(tmp_path):
    summary, executor, journal = _grow_run(tmp_path, fail_on=2)
    assert summary.ok
    trains = [(k, attempt) for tid, k, _, attempt in executor.submits if tid == "train"]
    assert trains == [(1, 1), (2, 1), (1, 1)]  # grown, failed, back on one rank
    whys = [(e["why"], e["previous"], e["ranks"]) for e in journal.of("task_resized")]
    assert whys == [("grow", 1, 2), ("fallback", 2, 1)]
    [failed] = journal.of("task_failed")
    assert failed["failure"] == "killed"


def test_only_elastic_tasks_whose_checkpoints_resume_on_any_k_are_grown():
    """pita's own loops, DPO / RPO, GRPO / GRPO-HF and the reward model (tests/test_trl_gang.py
    shows their resume on another k; GRPO since its completions are seeded per row, issue
    45); not a sharded stage. The registry rows say which (`growable_stages`); the planner
    copies it onto each task."""
    from pita.algos.registry import can_grow
    from pita.core.growth import growable

    value = _task("v", ranks=[1, 2, 4])
    value.growable = can_grow("QSharp", "train", "pita.algos.qsharp:train")
    assert growable(value)
    value.ranks = []  # its k is fixed (not sized at dispatch)
    assert not growable(value)
    grown = [
        ("any", "pretrain", "pita.stages.pretrain:pretrain"),
        ("PITA", "train", "pita.algos.pita_algo:train"),
        ("QSharp-HF", "train", "pita.algos.qsharp_hf:train"),
        ("DPO", "train", "pita.algos.dpo:train"),
        ("RPO", "train", "pita.algos.dpo:train"),
        ("QSharp-HF", "reward_model", "pita.algos.reward_model:train_reward_model"),
        ("GRPO-HF", "reward_model", "pita.algos.reward_model:train_reward_model"),
        ("GRPO", "train", "pita.algos.grpo:train"),
        ("GRPO-HF", "train", "pita.algos.grpo:train_hf"),
    ]
    for row in grown:
        assert can_grow(*row), row
    not_grown = [
        ("DPO", "collect", "pita.algos.dpo:collect"),
        ("DPO", "train", "my.own:train"),  # a stage override: none of the row's business
    ]
    for row in not_grown:
        assert not can_grow(*row), row


def test_the_planner_marks_the_growable_tasks_from_the_registry():
    from pita.experiment import cli
    from pita.experiment.run import build_plan, make_gpu_manager
    from tests.conftest import only

    cfg = cli.compose_config(
        ["system.devices=fake:4", "training.parallel_strategy=data_parallel"]
        + only("reference", "QSharp", "GRPO")
    )
    plan = build_plan(cfg, make_gpu_manager(cfg))
    grows = {tid for tid, t in plan.tasks.items() if t.growable}
    assert grows == {
        "pretrain.goal_walk.tiny",
        "QSharp.goal_walk.tiny.r0.train",
        "GRPO.goal_walk.tiny.r0.train",  # its completions seeded per row (issue 45)
    }


def test_a_trl_task_with_checkpoints_off_still_saves_when_the_run_asks(tmp_path):
    """A stop channel (a gang strategy's task) keeps the Trainer's saving on with checkpoints
    off, so a TRL task the run may grow can stop at a checkpoint; without one: no saves."""
    from pita.training.checkpoint import CheckpointPlan

    plan = CheckpointPlan(tmp_path / "ck", 0, 0.0, stop_file=tmp_path / "t.stop-request")
    kwargs = plan.trl_kwargs()
    assert kwargs["save_strategy"] == "steps" and kwargs["save_steps"] == 10**9
    assert kwargs["output_dir"] == str(tmp_path / "ck") and plan.on_request_only
    assert CheckpointPlan(tmp_path / "ck").trl_kwargs() == {"save_strategy": "no"}
    timed = CheckpointPlan(tmp_path / "ck", 0, 10.0, stop_file=tmp_path / "t.stop-request")
    assert not timed.on_request_only  # its Trainer saves by time and at the last step


def test_a_trl_trainer_saves_and_stops_at_the_step_after_the_request(tmp_path):
    """The TRL stages' TrainerCallback: no request, nothing; with it, save + stop after this
    step and remember it; at the schedule's last step the task just finishes (with
    checkpoints off it saves only when asked: not the Trainer's save at the last step)."""
    from types import SimpleNamespace

    from pita.training.checkpoint import stop_callback

    request = tmp_path / "t.stop-request"
    cb = stop_callback(request)
    state, control = SimpleNamespace(global_step=3, max_steps=10), SimpleNamespace()
    control.should_save = control.should_training_stop = False
    cb.on_step_end(None, state, control)
    assert not control.should_save and cb.stopped_at is None
    request.write_text("{}")
    cb.on_step_end(None, state, control)
    assert control.should_save and control.should_training_stop and cb.stopped_at == 3
    last, control2 = SimpleNamespace(global_step=10, max_steps=10), SimpleNamespace()
    control2.should_save = control2.should_training_stop = False
    fresh = stop_callback(request)
    fresh.on_step_end(None, last, control2)
    assert not control2.should_training_stop and fresh.stopped_at is None
    control2.should_save = True  # the Trainer's own save at the last step
    stop_callback(request, on_request_only=True).on_step_end(None, last, control2)
    assert not control2.should_save


@pytest.mark.slow
def test_a_real_run_grows_pretrain_from_one_rank_to_two_with_the_numbers_of_an_uninterrupted_run(
    tmp_path,
):
    """Through the real pool (worker processes on fake:2, the gang launcher): pretrain starts
    on one rank, device 1 stays idle, the Grower asks it to stop, it stops at
    a checkpoint (attempt kept as `.stopped-at-N`) and finishes on 2 ranks; its results row
    and model equal one process' uninterrupted run; the journal has the resize."""
    from omegaconf import OmegaConf

    from pita.core.dag import Plan
    from pita.core.elastic import set_ranks
    from pita.core.growth import Grower, GrowthPolicy
    from pita.core.journal import Journal, read_events
    from pita.core.parallel_executor import DagRunner
    from pita.core.worker_pool import WorkerPool
    from pita.experiment.run import make_gpu_manager, make_scheduler
    from pita.stages.pretrain import pretrain
    from tests.test_gang_training import _plan, _row

    steps = ("pretrain.steps=120", "executor.max_tasks_per_gpu=1")
    cfg, plan = _plan("data_parallel", *steps)
    task = plan.tasks[PRETRAIN]
    task.ranks = [1, 2]
    set_ranks(task, 1)
    gpu = make_gpu_manager(cfg)
    pool = WorkerPool.from_config(gpu, cfg.executor)
    run = tmp_path / "run"
    policy = GrowthPolicy(
        seconds=lambda t, k: 1000.0 / k,  # the estimate says growing pays
        startup=lambda t, k: 0.0,
        choices=lambda t: [1, 2],
        # ask as soon as device 1 has idled, not after the first progress line: 120 tiny
        # steps can end before that line arrives (a race a run never depends on); the
        # request is honoured after the next optimizer step either way
        needs_progress=False,
    )

    def progress() -> dict[str, str]:
        return {w["task"]: str(w.get("progress") or "") for w in pool.workers() if w["task"]}

    journal = Journal(run / "journal.jsonl")
    try:
        summary = DagRunner(
            Plan(tasks={task.id: task}),
            pool,
            make_scheduler(cfg, gpu),
            cfg_dict=OmegaConf.to_container(cfg, resolve=True),
            run_dir=str(run),
            journal=journal,
            max_retries=0,
            grower=Grower(policy, run, growable=lambda t: True, progress=progress, idle_s=0.5),
        ).run()
    finally:
        journal.close()
        pool.shutdown()
    assert summary.ok, summary.failed
    events = read_events(run / "journal.jsonl")
    [resized] = [e for e in events if e["event"] == "task_resized"]
    assert (resized["why"], resized["previous"], resized["ranks"]) == ("grow", 1, 2)
    running = [(e["devices"], e["attempt"]) for e in events if e["event"] == "task_running"]
    assert running == [([0], 1), ([0, 1], 1)]
    [stopped] = (run / "tasks").glob(f"{PRETRAIN}.attempt1.stopped-at-*")
    assert 0 < int(stopped.name.rsplit("-", 1)[1]) < 120
    grown = json.loads((run / "tasks" / PRETRAIN / "result.json").read_text())
    ctx, _ = _context(tmp_path / "single", "none", PRETRAIN, 1, "out", *steps)
    single = pretrain(ctx)
    assert _row(single) == pytest.approx({k: grown[k] for k in _row(single)}, abs=1e-5)
    from tests.test_gang_training import _weights

    a = _weights(ctx.out_dir / "model" / "model.safetensors")
    b = _weights(run / "tasks" / PRETRAIN / "model" / "model.safetensors")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-5
