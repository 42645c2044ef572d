"""Run tasks on an existing Ray cluster (`executor=ray`), on one node or many.

pita does not build its own cluster: beyond one machine it hands tasks to Ray (or runs
whole experiments under SLURM with Hydra's submitit launcher, `conf/hydra/launcher/`).
With `executor=ray` the DAG runner and scheduler stay the same; the scheduler's devices
are the cluster's slots (its GPUs, or its CPUs when it has none, from
`ray.cluster_resources()`), numbered node by node.

At the run's start (`prepare`) the slots are reserved in one placement group within
`executor.ray_placement_timeout_s` and a warm `SlotWorker` actor starts in each
(pita/core/ray_cluster.py, pita/runtime/ray_slot.py); every node then proves it sees the
run folder (a probe written here, read there, answered). A one-device task runs on its
slot's actor, as on a local worker. A k-device task runs one rank on each of its k slots'
actors, on one node when one has room, across nodes when it must: rank 0 runs the stage and
its `run_stage` starts the other ranks through Ray with RANK / WORLD_SIZE / MASTER_ADDR /
MASTER_PORT (c10d on rank 0's node). So the largest gang is every slot of the cluster
(`largest_node`), and `fsdp` means every device of the cluster. The run folder must be on a
filesystem every node mounts.

A lost node (its raylet gone: the actors on it die, or a gang's surviving ranks fail): the
tasks that ran there end as `node_lost`, which `DagRunner` retries on the devices left
without counting against the task's own retries (pita/core/parallel_executor.py).

Install: `pip install "ray[default]"`; start a cluster (`ray start --head` ...), then
`python run_parallel.py executor=ray executor.ray_address=<head>:6379`
(docs/operations.md, "On a Ray cluster").
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
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


def _ray_auth_error() -> type[BaseException]:
    """ray.exceptions.AuthenticationError (Ray >= 2.52), else a class nothing raises."""
    try:
        from ray.exceptions import AuthenticationError
    except ImportError:
        return ConnectionRefusedError
    return AuthenticationError


RAY_PROBE_TIMEOUT_S = 5.0


def _key(address: str | None, shown: str | None = None) -> str:
    """`executor.ray_address='auto' (found 10.0.0.1:6379)`: the key as the user set it, and
    the cluster `auto` found when it differs."""
    shown = address if shown is None else shown
    return f"executor.ray_address={shown!r}" + (f" (found {address})" if address != shown else "")


def probe_ray_address(
    address: str | None, timeout_s: float = RAY_PROBE_TIMEOUT_S, shown: str | None = None
) -> None:
    """Refuse an explicit `host:port` (or `ray://host:port`) that does not accept a TCP
    connection within `timeout_s`: ray.init would retry it for many minutes. `shown`: the
    address as the user gave it (`auto`), for the message."""
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
            f"{_key(address, shown)}: no Ray cluster reachable ({host}:{port}: "
            f"{exc.strerror or type(exc).__name__} within {timeout_s:.0f} s); start one "
            "(`ray start --head`) or use executor.ray_address=local for a Ray on this machine"
        ) from None


AUTH_HINT = (
    "set RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH, or the file ~/.ray/auth_token) to the "
    "cluster's token (`ray get-auth-token` on its head node prints it)"
)
AUTH_PROBE_TIMEOUT_S = 10.0


def _explicit(address: str | None) -> bool:
    """A `host:port` of a running cluster (not local/auto, not a Ray Client `ray://`)."""
    return address not in (None, "", "local", "auto") and "://" not in str(address)


def token_source() -> str | None:
    """Where Ray would read its auth token from (its own order), or None when nowhere."""
    if os.environ.get("RAY_AUTH_TOKEN", "").strip():
        return "RAY_AUTH_TOKEN"
    path = os.environ.get("RAY_AUTH_TOKEN_PATH", "").strip()
    if path:
        return path
    default = Path.home() / ".ray" / "auth_token"
    return str(default) if default.is_file() else None


def enable_token_auth(address: str | None) -> None:
    """Ray turns token auth on by itself only for a cluster it finds (`auto`); with an
    explicit address it connects without the token and the cluster refuses it. Do what Ray
    does for `auto`: a token in the environment or the token file enables token mode
    (unless RAY_AUTH_MODE says otherwise)."""
    if not _explicit(address) or "RAY_AUTH_MODE" in os.environ or token_source() is None:
        return
    os.environ["RAY_AUTH_MODE"] = "token"  # read by this process's Ray and by its children
    try:
        from ray._raylet import Config  # type: ignore[attr-defined]

        Config.initialize("")  # Ray caches its config: re-read it (as Ray's own helper does)
    except (ImportError, AttributeError):
        pass


def auth_error(address: str | None, message: str, shown: str | None = None) -> ConfigError | None:
    """The config error for a Ray authentication failure `message` (None: not one): which
    credential is missing or refused, never "no Ray cluster reachable"."""
    low = message.lower()
    if not any(k in low for k in ("authentication", "unauthenticated", "auth token", "authtoken")):
        return None
    source = token_source() if os.environ.get("RAY_AUTH_MODE", "").lower() == "token" else None
    if source is None:
        what = "requires token authentication and no token was found"
    else:
        what = f"refused the token from {source}"
    return ConfigError(f"{_key(address, shown)}: the Ray cluster {what}; {AUTH_HINT}")


def resolve_auto(address: str | None) -> str | None:
    """`auto` -> the `host:port` Ray would connect to (RAY_ADDRESS, else the cluster the last
    `ray start` on this machine recorded), so the probes below judge the cluster `auto`
    finds (a token-auth cluster refused one token-less client for ~20 s of retry lines);
    anything else, or an `auto` that finds nothing, unchanged (ray.init then decides)."""
    if address != "auto":
        return address
    try:
        from ray._private.services import canonicalize_bootstrap_address

        return canonicalize_bootstrap_address("auto") or address
    except Exception:  # noqa: BLE001 - nothing found, or a Ray without the helper
        return address


def probe_ray_auth(
    address: str | None, timeout_s: float = AUTH_PROBE_TIMEOUT_S, shown: str | None = None
) -> None:
    """Ask the cluster's GCS once whether it accepts this client: ray.init would retry a
    refused token for a long time and then report only "Failed to connect". `shown`: the
    address as the user gave it (`auto`), for the message."""
    if not _explicit(address):
        return
    try:
        from ray._raylet import GcsClient  # type: ignore[attr-defined]
    except ImportError:
        return
    outcome: list[BaseException] = []

    def _probe() -> None:
        try:
            GcsClient(address=str(address))
        except BaseException as exc:  # noqa: BLE001 - judged below
            outcome.append(exc)

    with _quiet_stderr():  # Ray's C++ client logs each refusal to fd 2
        t = threading.Thread(target=_probe, name="pita-ray-auth-probe", daemon=True)
        t.start()
        t.join(timeout_s)
    if outcome:
        error = auth_error(address, f"{type(outcome[0]).__name__}: {outcome[0]}", shown)
        if error is not None:
            raise error


class _quiet_stderr:  # noqa: N801 - a context manager
    """Send file descriptor 2 to /dev/null for a moment (C++ logs bypass sys.stderr)."""

    def __enter__(self) -> None:
        sys.stderr.flush()
        self._saved = os.dup(2)
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)
        os.close(null)

    def __exit__(self, *exc: object) -> None:
        os.dup2(self._saved, 2)
        os.close(self._saved)


class RayExecutor:
    """The `Executor` interface on Ray: a warm `SlotWorker` actor per device slot of the
    cluster (pita/core/ray_cluster.py reserves the slots, pita/runtime/ray_slot.py is the
    actor). A one-device task runs on its slot's actor; a k-device task runs on the actors
    of its k slots, one rank each, possibly on several nodes (rank 0's actor runs the stage
    and starts the others). `run_task` is the body the actors run (run_task_here: the same
    code path as a local worker); Ray pickles it by reference. `slot_worker`: the actor class
    (pita.runtime.ray_slot.SlotWorker, handed in by pita/experiment/run.py: pita.core never
    imports the worker runtime)."""

    def __init__(
        self, executor_cfg, run_task: RunTask | None = None, slot_worker: type | None = None
    ):
        ray = _ray()
        if not ray.is_initialized():
            _connect(ray, executor_cfg.ray_address)
        self.ray = ray
        self.run_task = run_task
        self.slot_worker = slot_worker
        self.placement_timeout_s = float(getattr(executor_cfg, "ray_placement_timeout_s", 120.0))
        self.slot_list: list[Any] = []  # pita.core.ray_cluster.Slot, by device index
        self.group: Any = None
        self.lost: dict[str, str] = {}  # lost node id -> its address
        self.busy: dict[int, str] = {}  # slot -> the task running there
        self.warm_stages = ""
        self.preimport = True  # executor.preimport: each slot actor imports torch at start
        self._lock = threading.Lock()
        self._judges = ThreadPoolExecutor(4, thread_name_prefix="pita-ray-outcome")

    def slots(self) -> tuple[str, int]:
        res = self.ray.cluster_resources()
        gpus = int(res.get("GPU", 0))
        return ("gpu", gpus) if gpus else ("cpu", int(res.get("CPU", 1)))

    def largest_node(self) -> int:
        """The most slots a task may hold: every slot of the cluster (a gang's ranks are
        slot actors on any node, pita/runtime/ray_slot.py)."""
        return max(1, self.slots()[1])

    def gpu_memory_mb(self, timeout_s: float = 60.0) -> list[int]:
        """Total MiB of every GPU of the cluster, read with NVML on its own node (one tiny
        Ray task per GPU node, pinned there), in node order; a node whose probe fails
        counts its GPUs as unknown (0), and the caller falls back to uniform slots. The same
        probe asks each node's torch for CUDA: GPUs that torch cannot use are a config error
        (one line, exit 2) before any task fails on them."""
        nodes = [
            n
            for n in self.ray.nodes()
            if n.get("Alive") and n.get("Resources", {}).get("GPU", 0) > 0
        ]
        if not nodes:
            return []
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        probe = self.ray.remote(num_cpus=0, num_gpus=0, max_retries=0)(node_gpu_probe)
        refs = [
            probe.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False),
                name="pita-gpu-probe",
            ).remote()
            for n in nodes
        ]
        sizes: list[int] = []
        no_cuda = 0
        for node, ref in zip(nodes, refs):
            try:
                found = dict(self.ray.get(ref, timeout=timeout_s))
            except Exception:  # noqa: BLE001 - a node whose probe failed: unknown sizes
                found = {}
            n_gpus = int(node["Resources"]["GPU"])
            sizes += (list(found.get("nvml", [])) + [0] * n_gpus)[:n_gpus]
            if found.get("torch_cuda") is False:
                no_cuda += n_gpus
        if no_cuda:
            raise ConfigError(
                f"the Ray cluster offers {no_cuda} GPUs but torch on its nodes has no CUDA: "
                "start it with --num-gpus=0 or install a CUDA torch"
            )
        return sizes

    def prepare(self, run_dir: str | Path, warm_stages: str = "", preimport: bool = True) -> None:
        """Reserve the slots, start their actors and check that every node shares the run
        folder, before the first task (ConfigError, one line: the run stops, exit 2). With
        `preimport` (executor.preimport) each actor then imports torch and the stages."""
        from pita.core.paths import RunPaths
        from pita.core.ray_cluster import check_shared_storage

        self.warm_stages, self.preimport = warm_stages, preimport
        self._start_slots(warm=False)  # the probe first: it answers before torch is imported
        check_shared_storage(self.ray, self.slot_list, RunPaths(run_dir).workers)
        for slot in self.slot_list if preimport else ():
            slot.actor.warm.remote()  # queued before any task: the first one starts warm

    def _start_slots(self, warm: bool = True) -> None:
        if self.slot_list:
            return
        from pita.core.ray_cluster import number_slots, reserve

        kind, count = self.slots()
        self.group, bundle_nodes = reserve(self.ray, kind, count, self.placement_timeout_s)
        self.kind = kind
        self.slot_list = number_slots(bundle_nodes)
        for slot in self.slot_list:
            slot.actor = self._new_actor(slot, warm)
        where = self.ray.get(
            [s.actor.where.remote() for s in self.slot_list], timeout=self.placement_timeout_s
        )
        for slot, info in zip(self.slot_list, where):
            slot.ip = info["ip"]

    def _new_actor(self, slot: Any, warm: bool = True) -> Any:
        """A fresh `SlotWorker` in `slot`'s bundle, importing torch and the stages at once."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        assert self.slot_worker is not None, "RayExecutor(slot_worker=...) runs tasks"
        res = {"num_gpus": 1, "num_cpus": 0} if self.kind == "gpu" else {"num_cpus": 1}
        actor = (
            self.ray.remote(self.slot_worker)
            .options(
                **res,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.group, placement_group_bundle_index=slot.bundle
                ),
            )
            # stage imports (TRL's trainers) on GPU slots only, as local workers: on CPU slots
            # the cores are the run's compute (pita/runtime/worker.py `main`)
            .remote(slot.index, self.run_task, self.warm_stages if self.kind == "gpu" else "")
        )
        if warm and self.preimport:
            actor.warm.remote()  # queued before any task: the first one starts warm
        return actor

    def nodes_of(self, devices) -> list[str]:
        """The Ray node ids (hex) of `devices`' slots, one per device (the journal's `nodes`)."""
        self._start_slots()
        return [self.slot_list[d].node for d in devices]

    def submit(
        self, task: TaskSpec, devices, cfg_dict: dict, run_dir: str | Path, attempt: int = 1
    ) -> Future:
        self._start_slots()
        slots = [self.slot_list[d] for d in devices]
        peers = [s.actor for s in slots[1:]]
        ref = (
            slots[0]
            .actor.run.options(name=task.id)  # `ray list tasks` and the dashboard show the id
            .remote(task.to_dict(), cfg_dict, str(run_dir), attempt, peers or None)
        )
        with self._lock:
            self.busy.update({s.index: task.id for s in slots})
        future: Future = Future()

        def settle(inner: Future) -> None:
            try:
                future.set_result(self._done(task, slots, inner))
            except Exception as exc:  # noqa: BLE001 - the future must complete whatever happens
                future.set_result(TaskOutcome(task.id, False, "killed", f"Ray outcome lost: {exc}"))

        def judge(inner: Future) -> None:  # off Ray's callback thread: it may wait and ask Ray
            self._judges.submit(settle, inner)

        ref.future().add_done_callback(judge)
        return future

    def _done(self, task: TaskSpec, slots: list, inner: Future) -> TaskOutcome:
        """The task's outcome; a lost node's tasks fail as `node_lost`; the actors of a failed
        gang (stuck in a collective, or dead) are replaced."""
        with self._lock:
            for s in slots:
                self.busy.pop(s.index, None)
        try:
            outcome = inner.result()
            died = None
        except Exception as exc:  # noqa: BLE001 - the actor died (its process or its node)
            outcome, died = None, exc
        if outcome is not None and (not isinstance(outcome, TaskOutcome) or outcome.ok):
            return outcome  # (a test's own run_task may answer anything)
        lost = self._lost_nodes({s.node for s in slots}, wait=died is not None or len(slots) > 1)
        if died is not None or len(slots) > 1:  # dead, or a gang's ranks maybe in a collective
            self._replace([s for s in slots if s.node not in self.lost])
        what = f"{died}" if outcome is None else f"{outcome.failure}: {outcome.message}"
        if lost:
            where = ", ".join(f"{n[:8]} ({self.lost[n]})" for n in sorted(lost))
            return TaskOutcome(
                task.id, False, "node_lost", f"Ray node {where} lost: {what.splitlines()[0][:300]}"
            )
        if outcome is None:  # the worker died: same class as a killed local worker
            return TaskOutcome(task.id, False, "killed", f"Ray worker lost: {what}")
        return outcome

    def _lost_nodes(self, nodes: set[str], wait: bool) -> set[str]:
        """Which of `nodes` Ray reports dead; after an actor died, Ray may take its health
        check's period to notice a dead node: ask for up to NODE_DEATH_WAIT_S."""
        import time

        deadline = time.time() + (NODE_DEATH_WAIT_S if wait else 0)
        while True:
            alive = {n["NodeID"]: n for n in self.ray.nodes()}
            dead = {n for n in nodes if not alive.get(n, {}).get("Alive", False)}
            if dead or time.time() >= deadline:
                break
            if all(self._answers(s) for s in self.slot_list if s.node in nodes):
                break  # every slot of these nodes answers: no node died
            time.sleep(1.0)
        for n in dead:
            self.lost[n] = alive.get(n, {}).get("NodeManagerAddress", "?")
        return dead

    def _answers(self, slot: Any) -> bool:
        """Whether `slot`'s actor answers within 2 s (a dead actor on a live node: False)."""
        try:
            self.ray.get(slot.actor.where.remote(), timeout=2.0)
            return True
        except Exception:  # noqa: BLE001
            return False

    def _replace(self, slots: list) -> None:
        """Kill `slots`' actors (a failed gang's ranks may wait in a collective forever) and
        start fresh ones in their bundles."""
        for slot in slots:
            try:
                self.ray.kill(slot.actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass
            slot.actor = self._new_actor(slot)

    def lost_devices(self) -> set[int]:
        """Device indices on lost nodes (the DAG runner stops placing tasks there)."""
        return {s.index for s in self.slot_list if s.node in self.lost}

    def lost_nodes_line(self) -> str:
        return ", ".join(f"{n[:8]} ({ip})" for n, ip in sorted(self.lost.items()))

    def check(self) -> None:
        """Between dispatches: a node Ray reports dead is lost even while nothing runs on it."""
        if not self.slot_list:
            return
        import time

        now = time.time()
        if now - getattr(self, "_checked", 0.0) < 2.0:
            return
        self._checked = now
        self._lost_nodes({s.node for s in self.slot_list} - set(self.lost), wait=False)

    def warm_up(self, device_sets) -> None:
        pass

    def workers(self) -> list[dict[str, Any]]:
        with self._lock:
            busy = dict(self.busy)
        return [
            {"devices": (s.index,), "node": s.node[:8], "task": busy.get(s.index)}
            for s in self.slot_list
            if s.node not in self.lost
        ]

    def worker_pids(self) -> list[int]:
        return []

    def shutdown(self, kill: bool = False, grace_s: float = 5.0) -> None:
        self.release()
        self.ray.shutdown()

    def release(self) -> None:
        """Stop the slot actors and give the slots back to the cluster (Ray stays connected)."""
        self._judges.shutdown(wait=False, cancel_futures=True)
        for slot in self.slot_list:
            try:
                self.ray.kill(slot.actor, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.group)
            except Exception:  # noqa: BLE001 - the cluster went away
                pass
        self.slot_list, self.group = [], None


# After an actor died: how long Ray may take to report its node dead (its health check:
# 5 failed checks 3 s apart by default), before the death counts as the worker's own.
NODE_DEATH_WAIT_S = 30.0


def _connect(ray: Any, address: str | None) -> None:
    """ray.init on `address`, each way it can fail one config line (exit 2)."""
    found = resolve_auto(address)  # `auto`: the cluster it finds is probed too
    probe_ray_address(found, shown=address)
    enable_token_auth(found)
    probe_ray_auth(found, shown=address)
    try:
        ray.init(
            address=None if address in (None, "local") else address,
            ignore_reinit_error=True,
            log_to_driver=False,
            logging_level=logging.WARNING,  # its "Connecting to ..." lines: not on stderr
        )
    except (ConnectionError, RuntimeError, ValueError, _ray_auth_error()) as exc:
        first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
        refused = auth_error(address, f"{type(exc).__name__}: {exc}")
        if refused is not None:
            raise refused from None
        raise ConfigError(
            f"executor.ray_address={address!r}: no Ray cluster reachable ({first[:160]}); "
            "start one (`ray start --head`) or use executor.ray_address=local for a Ray "
            "on this machine"
        ) from None


def node_gpu_probe() -> dict[str, Any]:
    """What a GPU node offers (runs as a Ray task there): NVML's total MiB per GPU, and
    whether the node's torch was built with CUDA (None: no torch there). A node that
    claims GPUs with a CPU torch would fail every GPU task with `Torch not compiled with
    CUDA enabled`."""
    try:
        import torch

        torch_cuda: bool | None = bool(torch.version.cuda or getattr(torch.version, "hip", None))
    except ImportError:
        torch_cuda = None
    return {"nvml": nvml_total_mb(), "torch_cuda": torch_cuda}


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
