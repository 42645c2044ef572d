"""executor=ray: a missing cluster is one config line; GPU memory comes from NVML on each node."""

from __future__ import annotations

import pytest

from tests.conftest import run_cli

ray = pytest.importorskip("ray")
# `auto` finds any Ray running on the machine: never beside another test's (conftest.py)
pytestmark = pytest.mark.usefixtures("one_ray_cluster_at_a_time")


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


def test_ray_address_auto_probes_the_cluster_it_finds(tmp_path):
    """Issue 28: `auto` resolves to the cluster Ray would join (here RAY_ADDRESS, a port
    nobody listens on) and that cluster is probed like an explicit address: one line naming
    both, not Ray's retries."""
    import socket

    with socket.socket() as s:  # a free port, closed again: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = run_cli(
        ["executor=ray", "executor.ray_address=auto", "dry_run=true"],
        cwd=tmp_path,
        env={"RAY_ADDRESS": f"127.0.0.1:{port}", "RAY_TMPDIR": str(tmp_path / "ray")},
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr[-2000:]
    assert lines[0].startswith("error: executor.ray_address='auto' (found ")  # Ray's node IP
    assert f":{port}): no Ray cluster reachable" in lines[0], lines[0]


@pytest.mark.slow
def test_ray_address_auto_on_a_token_cluster_without_a_token_is_one_line(tmp_path):
    """Issue 28: a real Ray head with token authentication; `executor.ray_address=auto`
    finds it (RAY_ADDRESS) without a token: one line naming the missing credential, not
    ~20 s of `Failed to get cluster ID ... InvalidAuthToken` retries."""
    import os
    import shutil
    import signal
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    head_env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": "pita-test-token",
        "HOME": str(tmp_path / "head_home"),
    }
    import tempfile

    # short, not under pytest's tmp_path: Ray's socket paths (<temp>/session_<date>_<pid>/
    # sockets/plasma_store) must stay under the 107-character limit of a Unix socket
    temp = tempfile.mkdtemp(prefix="rt", dir="/tmp")
    start = [ray_bin, "start", "--head", "--block", f"--port={port}", "--num-cpus=1"]
    start += ["--include-dashboard=false", f"--temp-dir={temp}"]
    # its own process group: only this head's processes are stopped (never `ray stop`,
    # which stops every Ray on the machine)
    head = subprocess.Popen(
        start,
        env=head_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 180
        while time.time() < deadline:  # the GCS port answers once the head is up
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert head.poll() is None, "the Ray head exited before its GCS answered"
                time.sleep(0.5)
        else:
            pytest.fail("the Ray head's GCS did not answer within 180 s")
        client_env = {
            "RAY_ADDRESS": f"127.0.0.1:{port}",
            "HOME": str(tmp_path / "client_home"),  # no ~/.ray/auth_token
            "RAY_AUTH_TOKEN": "",
            "RAY_AUTH_MODE": "",
        }
        done = run_cli(
            ["executor=ray", "executor.ray_address=auto", "dry_run=true"],
            cwd=tmp_path,
            env=client_env,
            timeout=180,
        )
    finally:
        os.killpg(head.pid, signal.SIGTERM)  # `--block` stops the head's processes
        try:  # most often in 1.5 s; now and then a Ray process holds on for 30 s more
            head.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        shutil.rmtree(temp, ignore_errors=True)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr[-3000:]
    assert "the Ray cluster requires token authentication and no token was found" in lines[0]
    assert lines[0].startswith("error: executor.ray_address='auto' (found ")
