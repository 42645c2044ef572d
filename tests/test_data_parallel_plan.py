"""training.parallel_strategy=data_parallel plans pretrain (the stage that trains with DDP)
as an elastic task: one device in the plan, 1..executor.max_ranks_per_task ranks chosen at
dispatch (pita/core/elastic.py), one DDP rank per device (issue 13: the key used to do
nothing in a real run; issue 32: the gang is sized by simulating the plan)."""

from __future__ import annotations

import pytest

from pita.experiment import cli
from pita.experiment.run import build_plan, make_gpu_manager
from tests.conftest import journal, only, run_cli, run_dirs


@pytest.mark.parametrize(
    "overrides, gang, elastic",
    [
        (["training.parallel_strategy=data_parallel"], 1, True),
        (["training.parallel_strategy=none"], 1, False),
        (["training.parallel_strategy=fsdp"], 3, False),
        (["training.parallel_strategy=data_parallel", "system.gpu_mode=single_gpu"], 1, False),
        (["training.parallel_strategy=data_parallel", "executor.max_ranks_per_task=1"], 1, False),
    ],
)
def test_pretrain_and_value_training_are_planned_on_a_gang(overrides, gang, elastic):
    """pita's own loops (pretrain, the value trainer's train stage) get the gang: under
    data_parallel planned on one device and sized at dispatch (elastic), under fsdp every
    device; the others keep one device and are never elastic."""
    cfg = cli.compose_config(["system.devices=fake:3", *only("reference", "QSharp"), *overrides])
    plan = build_plan(cfg, make_gpu_manager(cfg))
    own_loops = {tid for tid, t in plan.tasks.items() if t.stage in ("pretrain", "train")}
    assert "pretrain.goal_walk.tiny" in own_loops and len(own_loops) > 1
    assert {plan.tasks[tid].gpus for tid in own_loops} == {gang}
    assert {plan.tasks[tid].elastic for tid in own_loops} == {elastic}
    assert {t.gpus for tid, t in plan.tasks.items() if tid not in own_loops} == {1}
    assert not any(t.elastic for tid, t in plan.tasks.items() if tid not in own_loops)


@pytest.mark.slow
def test_data_parallel_run_trains_pretrain_with_ddp_over_the_gang(tmp_path):
    args = [
        "experiment=smoke",
        "experiment.name=dp",
        "system.devices=fake:2",
        "executor.progress=false",
        "training.parallel_strategy=data_parallel",
        "pretrain.steps=6",
        "dataset.test_size=8",
        *only("reference"),
    ]
    proc = run_cli(args, tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [run_dir] = run_dirs(tmp_path, "dp")
    running = [
        e
        for e in journal(run_dir)
        if e.get("task") == "pretrain.goal_walk.tiny" and e["event"] == "task_running"
    ]
    assert running[0]["devices"] == [0, 1]
    log = (run_dir / "tasks" / "pretrain.goal_walk.tiny" / "log.txt").read_text()
    assert "DDP over 2 ranks" in log and "x 2 rank(s)" in log
