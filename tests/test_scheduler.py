"""Scheduling: pure placement rules, then real runs on simulated GPUs (fake:4)."""

from __future__ import annotations

import json

from pita.core.parallel_executor import DeviceState, Scheduler
from tests.conftest import journal, only, run_cli, run_dirs, sleep_overrides, task_spec


def _task(tid, gpus=1, mem=1000, prio=1.0, pref=None):
    return task_spec(
        id=tid,
        dataset="d",
        family="f",
        gpus=gpus,
        mem_mb=mem,
        priority=prio,
        preferred_device=pref,
    )


def _devices(*mbs):
    return [DeviceState(i, mb, mb) for i, mb in enumerate(mbs)]


def test_gang_gets_k_devices_at_once_with_most_free_memory():
    s = Scheduler(_devices(40_000, 80_000, 80_000, 40_000))
    [(task, devs)] = s.place([_task("big", gpus=2, mem=100_000)])
    assert devs == [1, 2]  # 50 GB per device fits only the 80 GB ones


def test_admission_by_free_memory_minus_reservations_and_packing():
    s = Scheduler(_devices(10_000), max_tasks_per_device=3)
    placed = s.place([_task("a", mem=6000), _task("b", mem=3000), _task("c", mem=3000)])
    assert [t.id for t, _ in placed] == ["a", "b"]  # c would exceed 10 GB
    s.release("a")
    assert [t.id for t, _ in s.place([_task("c", mem=3000)])] == ["c"]


def test_one_task_per_device_by_default_and_priority_order():
    s = Scheduler(_devices(80_000, 80_000))
    placed = s.place([_task("low", prio=1), _task("high", prio=9), _task("mid", prio=5)])
    assert [t.id for t, _ in placed] == ["high", "mid"]


def test_waiting_gang_is_not_starved_by_small_tasks():
    s = Scheduler(_devices(80_000, 80_000))
    s.place([_task("running-small", mem=1000)])  # occupies device 0
    placed = s.place([_task("gang", gpus=2, mem=2000, prio=9), _task("small", mem=1000, prio=1)])
    assert placed == []  # device 1 is held for the gang instead of taking another small task
    s.release("running-small")
    [(task, devs)] = s.place(
        [_task("gang", gpus=2, mem=2000, prio=9), _task("small", mem=1000, prio=1)]
    )
    assert task.id == "gang" and devs == [0, 1]


def test_shard_prefers_its_device():
    s = Scheduler(_devices(80_000, 80_000, 80_000))
    placed = s.place(
        [_task("s2", pref=2, prio=3), _task("s1", pref=1, prio=2), _task("s0", pref=0, prio=1)]
    )
    assert {t.id: d for t, d in placed} == {"s2": [2], "s1": [1], "s0": [0]}


def test_chains_progress_independently_on_fake4(tmp_path, markers):
    """QSharp is 6x slower than PITA: PITA's round 1 must start while QSharp is in round 0."""
    args = [
        "system.devices=fake:4",
        "experiment.name=indep",
        *only("reference", "QSharp", "PITA"),
        "rounds_of_training=2",
        "executor.progress=false",
        *sleep_overrides(),
    ]
    env = {
        "PITA_TEST_SLEEP": "0.15",
        "PITA_TEST_SCALE_QSharp": "6",
        "PITA_TEST_MARKERS": str(markers),
    }
    proc = run_cli(args, tmp_path, env)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    [run_dir] = run_dirs(tmp_path, "indep")
    events = journal(run_dir)
    order = [(e["event"], e.get("task")) for e in events]
    pita_r1_start = order.index(("task_running", "PITA.goal_walk.tiny.r1.collect.s00"))
    qsharp_r0_done = order.index(("task_done", "QSharp.goal_walk.tiny.r0.evaluate"))
    assert pita_r1_start < qsharp_r0_done, "a global round barrier held PITA back"
    # pinning: every task saw exactly the device(s) it was placed on
    uuids = {
        e["task"]: ",".join(f"GPU-fake-{d:02d}" for d in e["devices"])
        for e in events
        if e["event"] == "task_running"
    }
    for f in markers.glob("*.started"):
        seen = json.loads(f.read_text().splitlines()[-1])["cuda_visible_devices"]
        assert seen == uuids[f.name.removesuffix(".started")]
    assert (run_dir / "gpu_monitor.jsonl").read_text().count('"device": 3') >= 1
    assert "GPU Memory Summary:" in (run_dir / "run.log").read_text()


def test_two_gpu_gang_runs_on_two_devices(tmp_path, markers):
    args = [
        "system.devices=fake:4",
        "experiment.name=gang",
        "model.gpus_per_task=2",
        "executor.progress=false",
        *only("reference"),
        *sleep_overrides(),
    ]
    proc = run_cli(args, tmp_path, {"PITA_TEST_MARKERS": str(markers)})
    assert proc.returncode == 0, proc.stderr + proc.stdout
    [run_dir] = run_dirs(tmp_path, "gang")
    running = [e for e in journal(run_dir) if e["event"] == "task_running"]
    gangs = [e for e in running if not e["task"].endswith("_merge") and len(e["devices"]) == 2]
    assert gangs, running
    seen = json.loads((markers / "reference.goal_walk.tiny.r0.evaluate.s00.started").read_text())[
        "cuda_visible_devices"
    ]
    assert len(seen.split(",")) == 2 and all(u.startswith("GPU-fake-") for u in seen.split(","))


def test_measured_devices_subtract_only_unallocated_reservations():
    s = Scheduler(_devices(80_000), max_tasks_per_device=4, simulated_memory=False)
    d = s.devices[0]
    s.place([_task("a", mem=30_000)])
    d.free_mb, d.allocated_by_ours_mb = 60_000, 20_000  # "a" holds 20 of its 30 GB
    assert s.available_mb(d) == 50_000
    assert [t.id for t, _ in s.place([_task("b", mem=45_000)])] == ["b"]
    assert s.place([_task("c", mem=10_000)]) == []  # 60 - (75 - 20) = 5 GB left


def test_in_process_executor_runs_the_same_dag(tmp_path):
    """system.use_parallel_execution=false: every task in the orchestrator's process (pdb works)."""
    args = [
        "system.use_parallel_execution=false",
        "experiment.name=inproc",
        *only("reference", "QSharp"),
        "executor.progress=false",
        *sleep_overrides(),
    ]
    proc = run_cli(args, tmp_path, {"PITA_TEST_SLEEP": "0.01"})
    assert proc.returncode == 0, proc.stderr + proc.stdout
    [run_dir] = run_dirs(tmp_path, "inproc")
    done = [e for e in journal(run_dir) if e["event"] == "task_done"]
    assert (
        len(done) == 11 and len({e["worker_pid"] for e in done}) == 1
    )  # one process did everything
    assert not (run_dir / "workers").exists()


def test_dry_run_prints_placement_and_starts_nothing(tmp_path):
    proc = run_cli(
        [
            "dry_run=true",
            'system.devices="fake:[80GB,40GB]"',
            "experiment.name=dry",
            *only("reference", "QSharp"),
            *sleep_overrides(),
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert (
        "QSharp.goal_walk.tiny.r0.train" in proc.stdout and "Estimated wall time: " in proc.stdout
    )
    for run_dir in run_dirs(tmp_path, "dry"):
        assert not (run_dir / "journal.jsonl").exists() and not (run_dir / "tasks").exists()
