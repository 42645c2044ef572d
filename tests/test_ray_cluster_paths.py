"""executor=ray: a missing cluster is one config line; GPU memory comes from NVML on each node."""

from __future__ import annotations

import pytest

from tests.conftest import run_cli

ray = pytest.importorskip("ray")


def test_ray_address_auto_without_a_cluster_is_one_line_and_exit_2(tmp_path):
    done = run_cli(
        ["executor=ray", "executor.ray_address=auto", "dry_run=true"],
        cwd=tmp_path,
        env={"RAY_ADDRESS": "", "RAY_TMPDIR": str(tmp_path / "ray")},
    )  # no other Ray found
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "error: executor.ray_address='auto': no Ray cluster reachable"
    )
    assert "Traceback" not in done.stderr and not (tmp_path / "outputs").exists()


def test_devices_spec_uses_real_gpu_sizes_when_every_node_reported():
    from pita.core.ray_executor import ray_devices_spec

    assert ray_devices_spec("gpu", 3, [81559, 81559, 40960]) == "fake:[81559MB,81559MB,40960MB]"
    assert ray_devices_spec("gpu", 2, [81559, 0]) == "fake:2"  # a node without NVML: uniform slots
    assert ray_devices_spec("gpu", 2, []) == "fake:2"
    assert ray_devices_spec("cpu", 8, []) == "cpu"
    from pita.core.gpu_manager import GPUManager

    gpu = GPUManager(ray_devices_spec("gpu", 2, [81559, 40960]))
    assert [d.total_mb for d in gpu.devices] == [81559, 40960]


@pytest.mark.slow
def test_nvml_probe_runs_pinned_on_each_gpu_node():
    from omegaconf import OmegaConf

    from pita.core.ray_executor import RayExecutor, nvml_total_mb

    torch = pytest.importorskip("torch")
    if not torch.version.cuda:  # the probe refuses a GPU node with CPU torch (test_ray_executor.py)
        pytest.skip("this torch has no CUDA")
    ray.init(
        num_cpus=1, num_gpus=1, include_dashboard=False, log_to_driver=False
    )  # a node that claims a GPU
    try:
        ex = RayExecutor(OmegaConf.create({"ray_address": "local"}))
        assert ex.slots() == ("gpu", 1)
        sizes = ex.gpu_memory_mb(timeout_s=120)
        assert len(sizes) == 1
        assert sizes == (
            nvml_total_mb()[:1] or [0]
        )  # what NVML says on that node (0: no NVML here)
    finally:
        ray.shutdown()
