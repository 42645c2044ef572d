"""A warm pita worker on one device slot of a Ray node (a Ray actor), and the rank launcher
of a gang whose ranks are such actors, possibly on several nodes.

`SlotWorker` lives as long as the run, in its slot's bundle of the run's placement group
(pita/core/ray_cluster.py), so torch, transformers and the stage modules are imported once
per slot, not once per task. It runs a one-device task (`run`, the same
`run_task_here` as a local worker) or one rank of a gang (`rank`).

A gang of k ranks: the executor sends the task to the actor of its first device (rank 0)
with the other k-1 actors as `peers`. The stage runs there as it does in a local worker;
when it calls `pita.runtime.gang.run_stage`, `launcher()` hands it `ray_launch_ranks`
instead of the local `launch_ranks`: rank 0 picks a free port on its own node, starts
`rank(...)` on every peer (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, c10d's env://
rendezvous, as torchrun and Ray Train set them) and runs rank 0 itself. Same stage code,
same per-rank `StageContext`, same `DistContext`; only where the rank processes come
from differs.

What a failure does: a rank that raises makes the launcher raise `DataParallelError("rank r
of k failed: ...")` (as locally, so the worker's classifier sees an out-of-memory text);
the peers still waiting in a collective are killed (`ray.kill`), and the executor starts
fresh actors in their bundles, as the local pool replaces a dead worker.

Nothing here imports torch at module level: the orchestrator imports this module to
create the actors.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pita.core.paths import atomic_write_text

_GANG: dict[str, Any] = {}  # this actor's gang while it runs a gang's rank 0: {"peers": [...]}


def launcher() -> Callable[..., list[Any]] | None:
    """The rank launcher for `run_stage` in this process: `ray_launch_ranks` while this
    actor runs rank 0 of a Ray gang, else None (the local launcher)."""
    return ray_launch_ranks if _GANG.get("peers") else None


def gang_size() -> int:
    """Ranks of the Ray gang this actor runs rank 0 of (1: none)."""
    return len(_GANG.get("peers", ())) + 1


def free_port() -> tuple[str, int]:
    """This node's address and a port free on it now (rank 0's rendezvous)."""
    import ray

    with socket.socket() as s:
        s.bind(("", 0))
        return ray.util.get_node_ip_address(), s.getsockname()[1]


class _Forward:
    """Rank 0's `DistContext` queue in this process: messages go straight to `on_message`."""

    def __init__(self, on_message: Callable[[str, int, Any], None] | None):
        self.on_message = on_message

    def put(self, item: tuple) -> None:
        kind, rank, payload = item
        if self.on_message is not None and kind in ("log", "heartbeat"):
            self.on_message(kind, rank, payload)


def run_rank(
    rank: int,
    world: int,
    master: tuple[str, int],
    entry: Callable[..., Any],
    args: Sequence[Any],
    device_type: str,
    queue: Any = None,
    timeout_s: float = 1800.0,
) -> Any:
    """`entry(dist, *args)` as rank `rank` of `world` in this process: the env:// variables
    set, the default process group up for the call and destroyed after it."""
    from datetime import timedelta

    import torch
    import torch.distributed as td

    from pita.training.ddp import DistContext

    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK="0",
        MASTER_ADDR=master[0],
        MASTER_PORT=str(master[1]),
    )
    device, backend = "cpu", "gloo"
    if device_type == "cuda":  # one GPU per slot actor: Ray pinned it as cuda:0
        torch.cuda.set_device(0)
        device, backend = "cuda:0", "nccl"
    td.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=timeout_s))
    try:
        return entry(DistContext(rank, world, device, backend, queue), *args)
    finally:
        td.destroy_process_group()


def ray_launch_ranks(
    entry: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    device_type: str | None = None,
    on_message: Callable[[str, int, Any], None] | None = None,
    **_: Any,
) -> list[Any]:
    """`launch_ranks` over this actor (rank 0) and its gang's peers (ranks 1..k-1); their
    return values by rank. Raises `DataParallelError` naming the earliest failed rank."""
    import ray

    from pita.training.ddp import DataParallelError

    peers = list(_GANG["peers"])
    if len(peers) != world_size - 1:
        raise DataParallelError(f"{world_size} ranks need {world_size} slots; got {len(peers) + 1}")
    device_type = device_type or "cpu"
    master = free_port()
    refs = [
        peer.rank.remote(r, world_size, master, entry, tuple(args), device_type)
        for r, peer in enumerate(peers, start=1)
    ]
    outcome: dict[str, Any] = {}

    def rank0() -> None:
        try:
            outcome["result"] = run_rank(
                0, world_size, master, entry, args, device_type, _Forward(on_message)
            )
        except BaseException as exc:  # noqa: BLE001 - reported below with its rank
            outcome["error"] = (time.time(), exc)

    thread = threading.Thread(target=rank0, name="pita-rank0", daemon=True)
    thread.start()
    results, error = _collect(refs, thread, outcome)
    if error is not None:
        for peer, ref in zip(peers, refs):  # peers still in a collective: stopped, replaced
            if not ray.wait([ref], timeout=0)[0]:
                ray.kill(peer, no_restart=True)
        raise DataParallelError(f"{error[0]} of {world_size} failed: {error[1]}")
    return [outcome["result"], *results]


def _collect(
    refs: list[Any], thread: threading.Thread, outcome: dict[str, Any]
) -> tuple[list[Any], tuple[str, str] | None]:
    """Wait for rank 0 (a thread) and the peers (Ray refs); stop at the first failure.
    Returns (peers' results, None) or ([], (which rank, its first error line))."""
    import ray

    pending, results = list(refs), {}
    while pending or thread.is_alive():
        if pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=0.2)
        else:
            thread.join(0.2)
            done = []
        for ref in done:
            try:
                results[refs.index(ref)] = pickle.loads(ray.get(ref))
            except Exception as exc:  # noqa: BLE001 - a peer's error, or its actor died
                rank = refs.index(ref) + 1
                if "error" in outcome:  # rank 0 failed first: its error is the cause
                    break
                return [], (f"rank {rank}", _first_line(exc))
        if "error" in outcome:
            return [], ("rank 0", _first_line(outcome["error"][1]))
    return [results[i] for i in range(len(refs))], None


def _first_line(exc: BaseException) -> str:
    """The cause's first line (a RayTaskError wraps the peer's exception)."""
    cause = getattr(exc, "cause", None) or exc
    lines = [ln for ln in f"{type(cause).__name__}: {cause}".splitlines() if ln.strip()]
    return (lines[0] if lines else type(cause).__name__)[:500]


class SlotWorker:
    """One device slot of one node: a warm process that runs the run's tasks one at a time."""

    def __init__(
        self, slot: int, run_task: Callable[..., Any] | None = None, warm_stages: str = ""
    ):
        self.slot = slot
        self.run_task = run_task  # None: pita.runtime.worker.run_task_here (tests pass others)
        self.models: Any = None
        self.warm_stages = warm_stages

    def where(self) -> dict[str, Any]:
        """Which node and process this slot lives on (the journal's `nodes`)."""
        import ray

        ctx = ray.get_runtime_context()
        return {
            "node": ctx.get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "gpus": [str(g) for g in ray.get_gpu_ids()],
        }

    def warm(self) -> float:
        """Import torch, the worker runtime and the run's stage modules now (the first task
        then starts warm); the seconds it took."""
        t0 = time.time()
        import torch  # noqa: F401

        from pita.runtime.worker import warm_stage_imports
        from pita.training import ddp  # noqa: F401

        warm_stage_imports(self.warm_stages)
        return round(time.time() - t0, 3)

    def run(self, task: dict, cfg_dict: dict, run_dir: str, attempt: int, peers=None) -> Any:
        """Run `task` here (rank 0 of its gang when `peers` are given): a `TaskOutcome`."""
        from pita.runtime.context import ModelCache
        from pita.runtime.worker import run_task_here

        if self.models is None:
            self.models = ModelCache(1)
        _GANG["peers"] = list(peers or [])
        try:
            if self.run_task not in (None, run_task_here):
                return self.run_task(task, cfg_dict, run_dir, attempt)
            return run_task_here(task, cfg_dict, run_dir, attempt, models=self.models)
        finally:
            _GANG.clear()

    def rank(
        self,
        rank: int,
        world: int,
        master: tuple[str, int],
        entry: Callable[..., Any],
        args: tuple,
        device_type: str,
    ) -> bytes:
        """Rank `rank` of a gang whose rank 0 runs on another slot: its pickled return value
        (plain pickle: no tensors shared through this process's memory)."""
        logging.getLogger("pita").info("rank %d of %d, rendezvous %s:%d", rank, world, *master)
        return pickle.dumps(run_rank(rank, world, master, entry, args, device_type))

    def probe(self, path: str, token: str, reply: str) -> str:
        """The shared-storage check on this node: read the orchestrator's token at `path`,
        write this node's at `reply`; '' when both worked, else what failed."""
        try:
            with open(path) as f:
                seen = f.read()
        except OSError as exc:
            return f"cannot read {path}: {exc.strerror or type(exc).__name__}"
        if seen != token:
            return f"{path} holds another run's probe (a different folder under that path)"
        try:
            atomic_write_text(Path(reply), token)
        except OSError as exc:
            return f"cannot write {reply}: {exc.strerror or type(exc).__name__}"
        return ""
