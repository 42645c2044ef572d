"""executor=ray: the same DAG runner on a local Ray cluster (real Ray tasks)."""

from __future__ import annotations

import pytest

from tests.conftest import journal, only, run_ok, sleep_overrides, task_spec

pytest.importorskip("ray")


@pytest.mark.slow
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

    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_ray_tasks_carry_their_task_id_as_name(two_gpu_ray, tmp_path):
    """The dashboard and `ray list tasks` show `reference...eval`, not `run_task_here`."""
    from omegaconf import OmegaConf

    from pita.core.ray_executor import RayExecutor

    task = task_spec(
        "reference.goal_walk.tiny.r0.eval", "reference", "goal_walk", "tiny", 0, "eval", "x:y"
    )
    ex = RayExecutor(OmegaConf.create({"ray_address": "local"}), run_task=_task_name)
    assert ex.submit(task, (0,), {}, tmp_path).result(timeout=120) == task.id


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
