"""A rank's death or stall is the gang's fault (issue 43 item 2), planted for real on 2 gloo
ranks on the CPU: a rank SIGKILLed (what the kernel's OOM killer does) makes the task
`killed` and the line names that rank and its signal, not the surviving rank's "Connection
reset by peer"; a SIGSTOPped rank is found by the stall watch (no step for the bound),
the gang is killed and the task is `stalled`. Both classes are retried; the launcher's
`/tmp/pita-ranks-<pid>-*` folder of a dead worker is swept like the channel folders."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest
import torch

from pita.core.errors import RETRYABLE
from pita.runtime.oom import classify_exception
from pita.training.ddp import GangStalled, RankDied, StallRule, launch_ranks

STEPS = 400


def _step_until(dist, fault: str, at: int) -> int:
    """All-reduce and report a step, `STEPS` times; rank 1 sends itself `fault` at step `at`
    (module level: the ranks import it)."""
    t = torch.ones(1)
    for step in range(1, STEPS + 1):
        torch.distributed.all_reduce(t)
        dist.step(step, STEPS)
        if dist.rank == 1 and step == at:
            os.kill(os.getpid(), getattr(signal, fault))
        time.sleep(0.01)
    return step


def test_a_sigkilled_rank_is_named_with_its_signal_and_classed_killed():
    with pytest.raises(RankDied) as caught:
        launch_ranks(_step_until, 2, args=("SIGKILL", 3), device_type="cpu", timeout_s=60)
    line = str(caught.value)
    assert line.startswith("rank 1 of 2 died of SIGKILL"), line
    assert "Connection reset" not in line and "\n" not in line
    assert classify_exception(caught.value) == "killed" and "killed" in RETRYABLE


def test_a_stopped_rank_stalls_the_gang_which_is_killed_and_classed_stalled():
    t0 = time.monotonic()
    with pytest.raises(GangStalled) as caught:
        launch_ranks(
            _step_until,
            2,
            args=("SIGSTOP", 3),
            device_type="cpu",
            timeout_s=60,  # gloo's own bound, far beyond the stall bound
            stall=StallRule(after_s=1.5),
        )
    line = str(caught.value)
    assert line.startswith("rank 1 of 2 (pid "), line
    # its last step report: the 3rd, or the 2nd when SIGSTOP beat the queue's feeder thread
    assert re.search(r"stopped, after step [23]/400\) made no step for \d+ s", line), line
    assert "(executor.gang_stall_s=1.5); the gang was killed" in line, line
    assert time.monotonic() - t0 < 55  # the watch, not gloo's timeout, ended it
    assert classify_exception(caught.value) == "stalled" and "stalled" in RETRYABLE


def _read_on_rank_one(ctx, dist) -> dict:
    """Rank 1 alone reads a setting: what the task read includes its ranks' reads."""
    return {"norm": ctx.training.max_grad_norm} if dist.rank == 1 else {}


def test_a_gangs_ranks_send_back_the_keys_they_read(tmp_path):
    """Issue 43 item 1 on a gang: a key only a rank read is in the task's recorded reads
    (pita/runtime/gang.py forwards them), so a resume that changes it runs the task again."""
    import logging

    from omegaconf import OmegaConf

    from pita.core.schema import recording_reads
    from pita.core.tasks import TaskSpec
    from pita.runtime.context import StageContext
    from pita.runtime.gang import run_stage

    task = TaskSpec(id="t", algo="any", dataset="d", family="f", round=0, stage="train", fn="m:f")
    cfg = OmegaConf.create({"training": {"max_grad_norm": 0.25}})
    ctx = StageContext(task, cfg, tmp_path, tmp_path, logging.getLogger("t"))
    with recording_reads() as reads:
        run_stage(ctx, _read_on_rank_one, world_size=2)
    assert reads["training.max_grad_norm"] == 0.25


def test_the_derived_stall_bound_follows_the_step_time_above_a_floor():
    rule = StallRule()
    assert rule.bound(None) is None  # no step time measured yet: nothing to judge by
    assert rule.bound(0.5) == 300.0  # fast steps: the floor
    assert rule.bound(60.0) == 1200.0  # 20 x the longest gap between two steps
    assert StallRule(after_s=7.0).bound(60.0) == 7.0  # executor.gang_stall_s wins


def test_a_new_phase_is_progress_and_the_last_step_ends_the_watch():
    """A stage that steps through two loops (a probe, then training) reports step 1 of the
    second after the last of the first: progress, not a stall. After a rank's last step
    (saving the model follows, however long) it is no longer expected to step."""
    from pita.training.ddp import _GangWatch

    watch = _GangWatch(2, None)
    for rank in (0, 1):
        watch.started(rank, 0)
        watch.step(rank, 199, 200)
        watch.step(rank, 200, 200)  # the probe's last step
    assert watch._quietest(time.monotonic() + 10_000) is None
    watch.step(1, 1, 50)  # the training loop's first step
    rank, quiet = watch._quietest(time.monotonic() + 10)
    assert rank == 1 and 9 < quiet < 11
    watch.step(1, 1, 50)  # the same step again is no progress: the clock keeps running
    assert watch._quietest(time.monotonic() + 10)[1] > 9


def test_a_dead_workers_rank_folder_is_swept(tmp_path):
    import subprocess
    import sys

    from pita.core.worker_pool import RANKS_DIR_PREFIX, remove_dead_socket_dirs

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = tmp_path / f"{RANKS_DIR_PREFIX}{dead.pid}-abc"
    live = tmp_path / f"{RANKS_DIR_PREFIX}{os.getpid()}-abc"
    for folder in (left, live):
        (folder / "attempt_0").mkdir(parents=True)
    assert left.name in remove_dead_socket_dirs(str(tmp_path))
    assert not left.exists() and live.is_dir()  # a live worker's folder stays


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "failure", "line"),
    [
        ("SIGKILL", "killed", "RankDied: rank 1 of 2 died of SIGKILL"),
        pytest.param(
            "SIGSTOP", "stalled", "GangStalled: rank 1 of 2 (pid ", marks=pytest.mark.long
        ),
    ],
)
def test_a_task_whose_rank_dies_or_stalls_is_retried_from_its_checkpoint(
    tmp_path, fault, failure, line
):
    """A real run: the reference's pretrain replaced by a 2-rank stage that checkpoints each
    step; rank 1 is SIGKILLed (or SIGSTOPped: `executor.gang_stall_s=3`) at step 3. The task
    fails once with that class and that line, is retried, resumes after its checkpoint and
    the run finishes."""
    from tests.conftest import STAGES, journal, only, run_cli, run_dirs, sleep_overrides

    stages = [o for o in sleep_overrides(preimport=True) if ".pretrain=" not in o]
    args = ["experiment=smoke", *only("reference"), "experiment.name=gang_fault"]
    args += ["system.devices=fake:1", "executor.progress=false", "executor.gang_stall_s=3"]
    args += [*stages, "+executor.stage_overrides.any.pretrain=tests.fault_stages:gang_fault_stage"]
    assert "pretrain" in STAGES
    proc = run_cli(args, tmp_path, env={"PITA_TEST_RANK_FAULT": fault}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [run_dir] = run_dirs(tmp_path, "gang_fault")
    events = journal(run_dir)
    [failed] = [e for e in events if e["event"] == "task_failed"]
    assert failed["task"] == "pretrain.goal_walk.tiny" and failed["failure"] == failure
    assert failed["message"].startswith(line), failed["message"]
    assert "\n" not in failed["message"] and "Connection reset" not in failed["message"]
    assert [e["task"] for e in events if e["event"] == "task_retry"] == [failed["task"]]
    result = json.loads((run_dir / "tasks" / failed["task"] / "result.json").read_text())
    assert result["resumed_after_step"] >= 2  # from its checkpoint, not from the start
