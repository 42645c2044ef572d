"""The live table shows each running task's latest progress line from its worker."""

from __future__ import annotations

from rich.console import Console

from pita.core.progress import Progress
from pita.core.tasks import TaskSpec
from tests.conftest import task_spec


def _task(tid: str) -> TaskSpec:
    return task_spec(
        id=tid, algo="GRPO", dataset="goal_walk", family="tiny", round=0, stage="train", fn="-"
    )


def test_live_table_shows_step_loss_reward_and_kl_of_running_tasks():
    workers = [
        {
            "task": "GRPO.goal_walk.tiny.r0.train",
            "progress": "step 12/30 loss=0.41 reward=0.62 kl=0.083",
        },
        {"task": None, "progress": ""},
    ]
    progress = Progress(3, ["GPU 0", "GPU 1"], live=False, worker_info=lambda: workers)
    progress.event("running", _task("GRPO.goal_walk.tiny.r0.train"), [1])
    progress.event("running", _task("DPO.goal_walk.tiny.r0.train"), [0])
    console = Console(record=True, width=200)
    console.print(progress._table())
    text = console.export_text()
    assert "step 12/30 loss=0.41 reward=0.62 kl=0.083" in text
    row = next(line for line in text.splitlines() if "GPU 1" in line)
    assert "GRPO.goal_walk.tiny.r0.train" in row and "reward=0.62" in row
    assert progress.latest_progress() == {"GRPO.goal_walk.tiny.r0.train": workers[0]["progress"]}


def test_a_broken_worker_listing_never_breaks_the_table():
    def broken():
        raise RuntimeError("pool gone")

    progress = Progress(1, ["cpu 0"], live=False, worker_info=broken)
    progress.event("running", _task("DPO.goal_walk.tiny.r0.train"), [0])
    Console(record=True, width=120).print(progress._table())
    assert progress.latest_progress() == {}
