"""Run tasks as Ray tasks on an existing Ray cluster (`executor=ray`).

pita does not build its own cluster: beyond one machine it hands tasks to Ray (or runs
whole experiments under SLURM with Hydra's submitit launcher, `conf/hydra/launcher/`).
With `executor=ray`, the DAG runner and scheduler stay the same; each task becomes one
Ray task asking for `num_gpus=task.gpus`, and Ray pins it (`CUDA_VISIBLE_DEVICES`) on
whichever node has room. The run folder must be on a filesystem every node mounts.
The scheduler's device slots are the cluster's GPUs (or CPUs when it has none), read
from `ray.cluster_resources()`.

Install: `pip install "ray[default]"`; start a cluster (`ray start --head` ...), then
`python run_parallel.py executor=ray executor.ray_address=<head>:6379`.
"""

from __future__ import annotations

import socket
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from pita.core.errors import ConfigError
from pita.core.executor import RunTask, TaskOutcome
from pita.core.tasks import TaskSpec


def _ray():
    try:
        import ray
    except ImportError:
        raise ConfigError(
            'executor.backend=ray: Ray is not installed; pip install "ray[default]" '
            "or use executor=local"
        ) from None
    return ray


RAY_PROBE_TIMEOUT_S = 5.0


def probe_ray_address(address: str | None, timeout_s: float = RAY_PROBE_TIMEOUT_S) -> None:
    """Refuse an explicit `host:port` (or `ray://host:port`) that does not accept a TCP
    connection within `timeout_s`: ray.init would retry it for many minutes."""
    if address in (None, "", "local", "auto"):
        return
    hostport = str(address).split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        return  # not host:port: let ray.init judge it
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ConfigError(
            f"executor.ray_address={address!r}: no Ray cluster reachable ({host}:{port}: "
            f"{exc.strerror or type(exc).__name__} within {timeout_s:.0f} s); start one "
            "(`ray start --head`) or use executor.ray_address=local for a Ray on this machine"
        ) from None


class RayExecutor:
    """The `Executor` interface on top of `ray.remote`. `run_task` is the body of each Ray
    task (pita.runtime.worker.run_task_here: the same code path as a local worker); Ray
    pickles it by reference, so the node imports the worker runtime, not this process."""

    def __init__(self, executor_cfg, run_task: RunTask | None = None):
        ray = _ray()
        if not ray.is_initialized():
            address = executor_cfg.ray_address
            probe_ray_address(address)
            try:
                ray.init(
                    address=None if address in (None, "local") else address,
                    ignore_reinit_error=True,
                    log_to_driver=False,
                )
            except (ConnectionError, RuntimeError, ValueError) as exc:
                first = next(
                    (ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__
                )
                raise ConfigError(
                    f"executor.ray_address={address!r}: no Ray cluster reachable ({first[:160]}); "
                    "start one (`ray start --head`) or use executor.ray_address=local for a Ray "
                    "on this machine"
                ) from None
        self.ray = ray
        self._remote: Any = ray.remote(max_retries=0)(run_task) if run_task is not None else None

    def slots(self) -> tuple[str, int]:
        res = self.ray.cluster_resources()
        gpus = int(res.get("GPU", 0))
        return ("gpu", gpus) if gpus else ("cpu", int(res.get("CPU", 1)))

    def gpu_memory_mb(self, timeout_s: float = 60.0) -> list[int]:
        """Total MiB of every GPU of the cluster, read with NVML on its own node (one tiny
        Ray task per GPU node, pinned there), in node order; a node whose probe fails
        counts its GPUs as unknown (0), and the caller falls back to uniform slots."""
        nodes = [
            n
            for n in self.ray.nodes()
            if n.get("Alive") and n.get("Resources", {}).get("GPU", 0) > 0
        ]
        if not nodes:
            return []
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        probe = self.ray.remote(num_cpus=0, num_gpus=0, max_retries=0)(nvml_total_mb)
        refs = [
            probe.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
            ).remote()
            for n in nodes
        ]
        sizes: list[int] = []
        for node, ref in zip(nodes, refs):
            try:
                totals = list(self.ray.get(ref, timeout=timeout_s))
            except Exception:  # noqa: BLE001 - a node without NVML: unknown sizes
                totals = []
            n_gpus = int(node["Resources"]["GPU"])
            sizes += (totals + [0] * n_gpus)[:n_gpus]
        return sizes

    def submit(
        self, task: TaskSpec, devices, cfg_dict: dict, run_dir: str | Path, attempt: int = 1
    ) -> Future:
        kind, _ = self.slots()
        options: dict[str, Any] = {"num_gpus": task.gpus} if kind == "gpu" else {"num_cpus": 1}
        ref = self._remote.options(**options).remote(
            task.to_dict(), cfg_dict, str(run_dir), attempt
        )
        future: Future = Future()

        def _done(inner: Future) -> None:
            try:
                future.set_result(inner.result())
            except Exception as exc:  # the Ray worker died: same class as a killed local worker
                future.set_result(TaskOutcome(task.id, False, "killed", f"Ray task lost: {exc}"))

        ref.future().add_done_callback(_done)
        return future

    def warm_up(self, device_sets) -> None:
        pass

    def workers(self) -> list[dict[str, Any]]:
        return []

    def worker_pids(self) -> list[int]:
        return []

    def shutdown(self, kill: bool = False, grace_s: float = 5.0) -> None:
        self.ray.shutdown()


def nvml_total_mb() -> list[int]:
    """Total memory (MiB) of each GPU NVML sees on this node (runs as a Ray task there)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return [
                int(
                    pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).total
                    // 2**20
                )
                for i in range(pynvml.nvmlDeviceGetCount())
            ]
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no NVML / no driver on this node
        return []


def ray_devices_spec(kind: str, count: int, sizes_mb: list[int]) -> str:
    """The GPUManager spec of the cluster's slots: `fake:[81559MB,...]` with the GPUs' real
    memory when every size is known, else `fake:N` (uniform slots), or `cpu`."""
    if kind != "gpu":
        return "cpu"
    if sizes_mb and len(sizes_mb) == count and all(s > 0 for s in sizes_mb):
        return "fake:[" + ",".join(f"{s}MB" for s in sizes_mb) + "]"
    return f"fake:{max(1, count)}"
