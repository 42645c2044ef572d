"""Tasks that share the host's CPU cores (fake / CPU devices): the forecast's model of it
(pita/core/host_share.py) in the event simulation, the ETA and the recorded durations."""

from __future__ import annotations

import pytest

from pita.core.dag import Plan
from pita.core.host_share import HostShare, ShareClock, mean_rates
from pita.core.parallel_executor import DeviceState, Scheduler, simulate
from pita.core.progress import Eta, TaskDurations
from pita.experiment.durations import work_walls
from tests.conftest import task_spec


def _plan(n: int, deps: dict[str, list[str]] | None = None) -> Plan:
    plan = Plan()
    for i in range(n):
        tid = f"t{i}"
        plan.add(task_spec(tid, fn="-", deps=(deps or {}).get(tid, []), mem_mb=10))
    return plan


def _scheduler(devices: int, host: HostShare | None) -> Scheduler:
    return Scheduler(
        [DeviceState(i, 1000, 1000) for i in range(devices)], max_tasks_per_device=1, host=host
    )


def test_eight_devices_on_two_cores_take_four_times_as_long():
    """8 one-thread tasks of 10 s on fake:8 with 2 cores: each runs at a quarter of its speed."""
    plan = _plan(8)
    _, alone = simulate(plan, _scheduler(8, None), lambda t: 10.0)
    _, shared = simulate(plan, _scheduler(8, HostShare(2.0, 1)), lambda t: 10.0)
    assert alone == pytest.approx(10.0)
    assert shared == pytest.approx(40.0)


def test_a_task_speeds_up_when_the_others_end():
    """A long task beside short ones: shared while they run, then the cores are its own."""
    plan = _plan(3)
    seconds = {"t0": 10.0, "t1": 2.0, "t2": 2.0}
    ends: dict[str, float] = {}
    _, makespan = simulate(
        plan, _scheduler(3, HostShare(1.0, 1)), lambda t: seconds[t.id], ends=ends
    )
    # 3 tasks at 1/3 until the short ones have done 2 s of work (6 s of wall), then 8 s alone
    assert ends["t1"] == pytest.approx(6.0) and ends["t2"] == pytest.approx(6.0)
    assert makespan == pytest.approx(14.0)


def test_enough_cores_changes_nothing():
    plan = _plan(4, {"t3": ["t0"]})
    secs = {"t0": 3.0, "t1": 5.0, "t2": 1.0, "t3": 4.0}
    _, alone = simulate(plan, _scheduler(4, None), lambda t: secs[t.id])
    _, shared = simulate(plan, _scheduler(4, HostShare(16.0, 2)), lambda t: secs[t.id])
    assert shared == pytest.approx(alone) == pytest.approx(7.0)


def test_a_gang_asks_for_its_ranks():
    share = HostShare(2.0, 1)
    gang = task_spec("g", fn="-", gpus=4, mem_mb=40)
    assert share.demand(gang) == 4.0
    assert HostShare(8.0, 4).demand(gang) == 4.0  # 4 threads split over 4 ranks


def test_clock_and_journal_count_each_tasks_work():
    """Two tasks on one core: 10 s of wall each while both run is 5 s of work each."""
    clock = ShareClock(HostShare(1.0, 1))
    clock.start("a", 1.0, 0.0)
    clock.start("b", 1.0, 0.0)
    assert clock.worked("a", 10.0) == pytest.approx(5.0)
    assert clock.stop("b", 10.0) == pytest.approx(5.0)
    assert clock.stop("a", 12.0) == pytest.approx(7.0)  # 2 s alone after b ended
    events = [
        {"event": "task_running", "task": "a", "devices": [0], "ts": 0.0},
        {"event": "task_running", "task": "b", "devices": [1], "ts": 0.0},
        {"event": "task_done", "task": "b", "wall_s": 10.0, "ts": 10.0},
        {"event": "task_done", "task": "a", "wall_s": 12.0, "ts": 12.0},
    ]
    rates = mean_rates(events, HostShare(1.0, 1))
    assert rates["b"] == pytest.approx(0.5) and rates["a"] == pytest.approx(7 / 12)
    assert work_walls(events, HostShare(1.0, 1)) == pytest.approx({"a": 7.0, "b": 5.0})
    assert work_walls(events, None) == {"a": 12.0, "b": 10.0}  # GPUs: wall time is the work


def test_eta_learns_work_and_forecasts_wall_time():
    """The live ETA: a finished task's duration is learned as work (wall x the host's rate
    while it ran), and the rest of the plan is forecast as wall time on the shared cores."""
    plan = _plan(4)
    eta = Eta(plan.tasks, set(), TaskDurations(), _scheduler(4, HostShare(2.0, 1)))
    eta.outside = lambda ours: 0.0  # nobody else on the host
    for tid in plan.tasks:
        eta.task_started(plan.tasks[tid], 0.0)
    eta.task_ended(plan.tasks["t0"], 20.0, wall_s=20.0)  # 4 tasks on 2 cores: 10 s of work
    eta.finished.add("t0")
    assert eta.durations.history(plan.tasks["t1"])[0] == pytest.approx(10.0)
    # 3 running tasks, each has done 10 s of its 10 s work by t = 20: nearly done
    left = eta.estimate({t: 0.0 for t in ("t1", "t2", "t3")}, 20.0)
    assert left.seconds == pytest.approx(0.0, abs=1e-6)
    # from scratch: 4 tasks of 10 s of work on 2 cores = 20 s of wall time
    fresh = Eta(plan.tasks, set(), eta.durations, _scheduler(4, HostShare(2.0, 1)))
    fresh.outside = lambda ours: 0.0
    assert fresh.estimate({}, 0.0).seconds == pytest.approx(20.0)
    fresh.outside = lambda ours: 4.0  # 4 threads of other users' work: 8 on 2 cores
    assert fresh.estimate({}, 0.0).seconds == pytest.approx(40.0)


def test_cpu_seconds_are_the_work_whatever_else_ran():
    """A task that computed is learned from its CPU seconds (other users' load does not
    inflate them); a task that waited (no CPU) from its wall time x the modelled rate."""
    share = HostShare(2.0, 1)
    assert share.work(wall=30.0, rate=0.5, cpu=10.0) == 10.0
    assert share.work(wall=30.0, rate=0.5, cpu=0.01) == 15.0  # a sleep: its wall x rate
    assert share.work(wall=30.0, rate=0.5, cpu=10.0, ranks=2) == 15.0  # ranks' CPU unseen
    events = [
        {"event": "task_running", "task": "a", "devices": [0], "ts": 0.0},
        {"event": "task_done", "task": "a", "wall_s": 30.0, "cpu_s": 10.0, "ts": 30.0},
    ]
    assert work_walls(events, share) == {"a": 10.0}


def test_the_live_eta_learns_other_users_load_from_its_finished_tasks():
    """A task that computed 5 s of CPU in 20 s while the run asked 2 of 2 cores felt 6 other
    threads (2 / (2 + 6) = a quarter of a core each); the ETA then forecasts with that, not
    with the load average (which overstates niced or waiting processes)."""
    plan = _plan(3)
    eta = Eta(plan.tasks, set(), TaskDurations(), _scheduler(3, HostShare(2.0, 1)))
    eta.outside = lambda ours: 100.0  # a load average that says far more
    eta.task_started(plan.tasks["t0"], 0.0)
    eta.task_started(plan.tasks["t1"], 0.0)
    eta.task_ended(plan.tasks["t0"], 20.0, wall_s=20.0, cpu_s=5.0)
    assert eta.felt == [pytest.approx(6.0)]
    assert eta.durations.history(plan.tasks["t2"])[0] == pytest.approx(5.0)  # its CPU seconds
    eta.task_ended(plan.tasks["t1"], 20.0, wall_s=20.0, cpu_s=5.0)
    eta.finished |= {"t0", "t1"}
    # t2 alone: 5 s of work at 2 / (1 + 6) of a core
    assert eta.estimate({}, 20.0).seconds == pytest.approx(5.0 * 7 / 2)


def test_other_users_load_is_read_now_not_from_the_last_minute(monkeypatch):
    """Eight busy processes planted for real: the count of other users' runnable threads
    includes them while they spin and drops as soon as they are killed (the one-minute load
    average would still count them for a minute: a dry run typed right after a run read that
    run as other users' load). Margins leave room for the other xdist worker's tests."""
    import subprocess
    import sys
    import time

    from pita.core.host_share import outside_load, runnable_threads

    monkeypatch.delenv("PITA_OUTSIDE_LOAD", raising=False)
    if runnable_threads() is None:
        pytest.skip("no /proc/stat on this OS")
    spin = [sys.executable, "-c", "while True: pass"]
    procs = [subprocess.Popen(spin) for _ in range(8)]
    try:
        time.sleep(1.0)  # past the interpreter's start-up
        busy = outside_load(0.0)
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
    after = outside_load(0.0)
    assert busy >= 7.0, busy
    assert after <= busy - 4.0, (busy, after)  # the other worker may add up to 3 meanwhile
