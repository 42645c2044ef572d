"""executor=ray: the same DAG runner on a local Ray cluster (real Ray tasks)."""

from __future__ import annotations

import pytest

from pita.runtime.ray_slot import SlotWorker
from tests.conftest import journal, only, run_ok, session_lock, sleep_overrides, task_spec

pytest.importorskip("ray")


@pytest.mark.slow
@pytest.mark.usefixtures("one_ray_cluster_at_a_time")
def test_dag_runs_as_ray_tasks(tmp_path):
    args = [
        "executor=ray",
        "executor.ray_address=local",
        "experiment.name=ray",
        *only("reference", "QSharp"),
        "executor.progress=false",
        *sleep_overrides(),
    ]
    run_dir = run_ok(args, tmp_path, "ray", timeout=300)
    done = [e for e in journal(run_dir) if e["event"] == "task_done"]
    assert len(done) == 11
    assert all((run_dir / "tasks" / e["task"] / "manifest.json").is_file() for e in done)


def _task_name(task, cfg_dict, run_dir, attempt):
    """A Ray task body that reports the name Ray knows it by."""
    import ray

    return ray.get_runtime_context().get_task_name()


@pytest.fixture(scope="module")
def two_gpu_ray():
    """A local Ray whose node claims 2 GPUs (this machine's torch has no CUDA)."""
    import ray

    with session_lock("ray"):  # no other test's cluster meanwhile (conftest.py)
        ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False)
        yield ray
        ray.shutdown()


def test_ray_tasks_carry_their_task_id_as_name(two_gpu_ray, tmp_path):
    """The dashboard and `ray list tasks` show `reference...eval`, not `run_task_here`."""
    from omegaconf import OmegaConf

    from pita.core.ray_executor import RayExecutor

    task = task_spec("reference.goal_walk.tiny.r0.eval", algo="reference", stage="eval")
    ex = RayExecutor(OmegaConf.create({"ray_address": "local"}), _task_name, SlotWorker)
    try:
        assert ex.submit(task, (0,), {}, tmp_path).result(timeout=120) == task.id
    finally:
        ex.release()  # the slots back to the module's Ray


def test_gpus_that_torch_cannot_use_are_one_line_before_any_task(two_gpu_ray):
    """A cluster started with --num-gpus=2 on CPU-only torch: one config line (exit 2 from
    the command), not 13 tasks failing with `Torch not compiled with CUDA enabled`."""
    import torch
    from omegaconf import OmegaConf

    from pita.core.errors import ConfigError
    from pita.core.ray_executor import RayExecutor

    if torch.version.cuda:
        pytest.skip("this torch has CUDA")
    ex = RayExecutor(OmegaConf.create({"ray_address": "local"}))
    assert ex.slots() == ("gpu", 2)
    with pytest.raises(ConfigError) as refused:
        ex.gpu_memory_mb(timeout_s=120)
    assert refused.value.messages == [
        "the Ray cluster offers 2 GPUs but torch on its nodes has no CUDA: start it with "
        "--num-gpus=0 or install a CUDA torch"
    ]


def _rank_report(ctx, dist):
    """A rank of the gang: who it is and the GPU Ray pinned to its slot, gathered on rank 0."""
    import os

    import ray
    import torch.distributed as td

    ranks: list = [None] * dist.world_size
    me = (dist.rank, os.getpid(), [str(g) for g in ray.get_gpu_ids()], os.environ["MASTER_ADDR"])
    td.all_gather_object(ranks, me)
    return {"world_size": dist.world_size, "ranks": ranks}


def _gang_in_ray(task, cfg_dict, run_dir, attempt):
    """A slot actor's task body: the k-rank launcher (run_stage) with the stage's own code."""
    import logging
    import os
    from pathlib import Path

    from omegaconf import OmegaConf

    from pita.core.tasks import TaskSpec
    from pita.runtime.context import StageContext
    from pita.runtime.gang import run_stage

    out = Path(run_dir) / "tasks" / task["id"]
    out.mkdir(parents=True, exist_ok=True)
    ctx = StageContext(
        task=TaskSpec.from_dict(task),
        cfg=OmegaConf.create(cfg_dict),
        run_dir=Path(run_dir),
        out_dir=out,
        logger=logging.getLogger("test.ray.gang"),
    )
    return {"pid": os.getpid(), "gang": run_stage(ctx, _rank_report)}


def test_a_k_device_training_task_runs_one_rank_on_each_of_its_slot_actors(two_gpu_ray, tmp_path):
    """Issue 41: a k-device task is k ranks, one per slot actor (each pinned to its own GPU),
    rank 0 on the actor of the first device, the same launcher call (run_stage) as a local
    worker; the same warm actors serve the next task."""
    from omegaconf import OmegaConf

    from pita.core.ray_executor import RayExecutor
    from pita.core.tasks import TaskSpec
    from pita.experiment import cli

    cfg = cli.compose_config(["system.devices=fake:2", "training.parallel_strategy=data_parallel"])
    task = TaskSpec(
        "QSharp.goal_walk.tiny.r0.train", "QSharp", "goal_walk", "tiny", 0, "train", "x:y"
    )
    task.gpus, task.strategy = 2, "ddp"
    ex = RayExecutor(OmegaConf.create({"ray_address": "local"}), _gang_in_ray, SlotWorker)
    assert ex.largest_node() == 2
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    try:
        got = [ex.submit(task, (0, 1), cfg_dict, tmp_path).result(timeout=300) for _ in range(2)]
        nodes = ex.nodes_of([0, 1])
    finally:
        ex.release()
    gang = got[0]["gang"]
    assert gang["world_size"] == 2 and [r[0] for r in gang["ranks"]] == [0, 1]
    assert sorted(g for r in gang["ranks"] for g in r[2]) == ["0", "1"]  # one GPU each
    assert gang["ranks"][0][1] == got[0]["pid"]  # rank 0 is the first slot's actor itself
    assert got[1] == got[0]  # warm: the same two processes ran the second task
    assert len(nodes[0]) == 56 and nodes[0] == nodes[1]  # a Ray node id, hex


def test_no_gang_is_planned_larger_than_the_largest_gang():
    """`largest_gang` bounds every gang and refuses a task that needs more before the run (on
    Ray it is every slot of the cluster: a gang's ranks may span nodes,
    tests/test_ray_multinode.py)."""
    from pita.core.errors import ConfigError
    from pita.experiment import cli
    from pita.experiment.plan import plan_experiment
    from tests.conftest import only

    cfg = cli.compose_config(
        [*only("reference", "QSharp"), "training.parallel_strategy=data_parallel"]
    )
    plan = plan_experiment(cfg, 4, device_mb=[80 * 1024] * 4, device_kind="cuda", largest_gang=2)
    # under data_parallel a training task's k is chosen at dispatch from `ranks`
    # (docs/DESIGN.md, elastic sizing): never more than `largest_gang`
    most = {
        max(t.ranks or [t.gpus]) for t in plan.tasks.values() if t.stage in ("pretrain", "train")
    }
    assert most == {2}
    cfg = cli.compose_config([*only("reference"), "model.gpus_per_task=3"])
    with pytest.raises(ConfigError, match="needs 3 devices but a task may hold at most 2"):
        plan_experiment(cfg, 4, device_mb=[80 * 1024] * 4, device_kind="cuda", largest_gang=2)
