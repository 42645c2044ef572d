"""The DAG runner's side of a lost Ray node (issue 41 item 4), without Ray: an executor that
answers `node_lost` for the tasks on devices it reports lost. Retried without using up the
task's retries; a gang shrinks to the devices left; a task the devices left cannot hold
stops the run with one line (task, need, have)."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from pita.core.dag import Plan
from pita.core.errors import ExecutorBroken
from pita.core.executor import TaskOutcome
from pita.core.parallel_executor import DagRunner, DeviceState, Scheduler
from tests.conftest import task_spec


class _Journal:
    def __init__(self):
        self.events: list[dict] = []

    def append(self, event: str, **fields):
        self.events.append({"event": event, **fields})


class _LosingExecutor:
    """Devices 2 and 3 are one node; it is lost under the first task that runs there."""

    def __init__(self):
        self.lost: set[int] = set()
        self.runs: list[tuple[str, list[int]]] = []

    def nodes_of(self, devices):
        return ["a" * 56 if d < 2 else "b" * 56 for d in devices]

    def submit(self, task, devices, cfg_dict, run_dir, attempt=1):
        self.runs.append((task.id, list(devices)))
        fut: Future = Future()
        if {2, 3} & set(devices) and not self.lost:
            self.lost = {2, 3}
            fut.set_result(TaskOutcome(task.id, False, "node_lost", "Ray node bbbbbbbb lost"))
        else:
            fut.set_result(TaskOutcome(task.id, True, result={}))
        return fut

    def lost_devices(self):
        return set(self.lost)

    def lost_nodes_line(self):
        return "bbbbbbbb (10.0.0.2)"


def _runner(tasks, executor, journal, mb=1000):
    plan = Plan(tasks={t.id: t for t in tasks})
    scheduler = Scheduler([DeviceState(i, mb, mb) for i in range(4)])
    return DagRunner(
        plan, executor, scheduler, cfg_dict={}, run_dir="-", journal=journal, max_retries=0
    )


def test_a_gang_on_a_lost_node_runs_again_on_the_devices_left_without_using_its_retries():
    gang = task_spec("pretrain.goal_walk.tiny", stage="pretrain", gpus=4, mem_mb=800)
    gang.strategy = "fsdp"
    journal, executor = _Journal(), _LosingExecutor()
    summary = _runner([gang], executor, journal).run()
    assert summary.ok  # executor.max_retries=0, and yet it ran again
    assert executor.runs == [(gang.id, [0, 1, 2, 3]), (gang.id, [0, 1])]
    running = [e for e in journal.events if e["event"] == "task_running"]
    assert running[0]["nodes"] == ["a" * 56] * 2 + ["b" * 56] * 2
    kinds = [e["event"] for e in journal.events]
    assert kinds == [
        "task_running",
        "task_failed",
        "task_retry",
        "node_lost",
        "task_resized",
        "task_running",
        "task_done",
    ]
    assert journal.events[3] == {
        "event": "node_lost",
        "nodes": "bbbbbbbb (10.0.0.2)",
        "devices": [2, 3],
        "devices_left": 2,
    }


def test_a_task_the_devices_left_cannot_hold_stops_the_run_with_one_line():
    """An FSDP gang of 4 x 400 MB on 500 MB devices: on the 2 left it needs 800 MB each."""
    gang = task_spec("pretrain.goal_walk.tiny", stage="pretrain", gpus=4, mem_mb=1600)
    gang.strategy = "fsdp"
    with pytest.raises(ExecutorBroken) as stopped:
        _runner([gang], _LosingExecutor(), _Journal(), mb=500).run()
    assert str(stopped.value) == (
        "pretrain.goal_walk.tiny needs 2 device(s) with 800 MB each; after losing Ray node(s) "
        "bbbbbbbb (10.0.0.2) the cluster has 0"
    )


def test_a_gang_goes_on_one_node_when_one_has_room_and_spans_nodes_when_none_has():
    """Slots 0-1 on node a, 2-3 on node b (as a Ray run numbers them): with slot 1 busy a
    2-rank gang takes node b's two; with one slot busy on each node it takes one of each."""
    scheduler = Scheduler([DeviceState(i, 1000, 1000) for i in range(4)])
    scheduler.node_of = {0: "a", 1: "a", 2: "b", 3: "b"}
    scheduler.devices[1].running["other"] = 100
    gang = task_spec("gang", gpus=2, mem_mb=200)
    assert scheduler.place([gang]) == [(gang, [2, 3])]
    scheduler.release("gang")
    scheduler.devices[3].running["another"] = 100
    assert scheduler.place([gang]) == [(gang, [0, 2])]


def test_time_report_labels_name_the_ray_node_of_each_device():
    from pita.results.timeline import with_nodes

    events = [
        {"event": "task_running", "task": "t", "devices": [0, 2], "nodes": ["a" * 56, "b" * 56]},
        {"event": "task_running", "task": "u", "devices": [1]},  # a local run: no nodes
    ]
    labels = ["CPU 0", "CPU 1", "CPU 2"]
    assert with_nodes(labels, events) == ["CPU 0 @ aaaaaaaa", "CPU 1", "CPU 2 @ bbbbbbbb"]
