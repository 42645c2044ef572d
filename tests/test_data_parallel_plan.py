"""training.parallel_strategy plans the training stages on gangs: under data_parallel each is
elastic (one device in the plan, 1..executor.max_ranks_per_task DDP ranks chosen at dispatch
by simulating the plan: pita/core/elastic.py, issue 32); under fsdp a gang of every device
(issue 13: the key used to do nothing in a real run; issue 31: every training stage)."""

from __future__ import annotations

import pytest

from pita.experiment import cli
from pita.experiment.run import build_plan, make_gpu_manager
from tests.conftest import journal, only, run_cli, run_dirs


@pytest.mark.parametrize(
    "overrides, gang, ranks",
    [
        (["training.parallel_strategy=data_parallel"], 1, [1, 2, 4]),
        (["training.parallel_strategy=none"], 1, []),
        (["training.parallel_strategy=fsdp"], 4, []),
        (["training.parallel_strategy=data_parallel", "system.gpu_mode=single_gpu"], 1, []),
        (["training.parallel_strategy=data_parallel", "executor.max_ranks_per_task=1"], 1, []),
        (["training.parallel_strategy=data_parallel", "executor.max_ranks_per_task=2"], 1, [1, 2]),
    ],
)
def test_training_stages_are_planned_on_a_gang(overrides, gang, ranks):
    """Every training stage (pretrain, the value trainer's and the TRL stages' train, the
    reward model) gets the gang, the others keep one device and are never elastic. Under
    data_parallel the gang's k is chosen at dispatch among `ranks` (planned on one device);
    under fsdp the task's `strategy` is what runs: fsdp for pita's own loops, DDP for a TRL
    stage on these (fake, CPU) devices."""
    cfg = cli.compose_config(
        ["system.devices=fake:4", *only("reference", "QSharp", "GRPO-HF"), *overrides]
    )
    plan = build_plan(cfg, make_gpu_manager(cfg))
    training = {
        tid for tid, t in plan.tasks.items() if t.stage in ("pretrain", "train", "reward_model")
    }
    assert {"pretrain.goal_walk.tiny", "GRPO-HF.goal_walk.tiny.r0.reward_model"} <= training
    assert {plan.tasks[tid].gpus for tid in training} == {gang}
    assert {tuple(plan.tasks[tid].ranks) for tid in training} == {tuple(ranks)}
    assert {t.gpus for tid, t in plan.tasks.items() if tid not in training} == {1}
    assert not any(t.elastic for tid, t in plan.tasks.items() if tid not in training)
    key = overrides[0].split("=")[1]
    for tid in training:
        strategy = plan.tasks[tid].strategy
        if gang == 1:
            assert strategy == "none"
        elif key == "fsdp" and tid.startswith("GRPO-HF"):
            assert strategy == "ddp"  # accelerate has no FSDP on CPU
        else:
            assert strategy == {"data_parallel": "ddp", "fsdp": "fsdp"}[key]


@pytest.mark.long
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
    # a fresh duration cache: the Sizer gives pretrain both devices from work units alone
    proc = run_cli(args, tmp_path, env={"PITA_CACHE_DIR": str(tmp_path / "cache")}, timeout=300)
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
    # the gang, dispatched as the run begins, is hosted by a warmed-up worker still starting,
    # and the evaluation shards reuse both: no worker beyond the two of the warm-up (before:
    # five, each importing torch again)
    assert len(list((run_dir / "workers").glob("worker-*.log"))) == 2
