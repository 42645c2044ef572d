"""`training.parallel_strategy=data_parallel`: one training task, DDP over its k-GPU gang.

The worker holding the gang (its `CUDA_VISIBLE_DEVICES` lists the k GPUs) starts k local
processes with `torch.multiprocessing` (spawn), rank r on `cuda:r` with NCCL, or on the CPU
with gloo (how tests and `fake:` gangs run it). `MASTER_ADDR=127.0.0.1` and a free port
rendezvous them. Every rank builds the same model from the same seed (DDP broadcasts rank
0's weights anyway), takes its `shard_indices` of each batch (DistributedSampler-style:
strided, padded to equal shares) and DDP all-reduces (averages) the gradients, so k ranks on
B/k examples step like one process on B. Rank 0 writes the artifacts.

- `run_data_parallel(train_fn, world_size, args)`: `train_fn(dist: DistContext, *args)` on
  every rank; returns the ranks' return values (keep them small). Log lines and heartbeats
  of the ranks reach the parent through a queue (`dist.log`, `on_message`). A failing rank
  raises `DataParallelError` with its traceback's last line; the others are stopped.
- `wrap_model(model, dist)`: DDP-wrap a model on a rank (the model itself otherwise).

How many ranks a task gets and the per-rank stage context are the worker's business
(`pita/runtime/gang.py`: `data_parallel_world_size`, `run_stage`); this module knows
processes and tensors, not tasks.

Written by hand because the workers are not launched by torchrun / accelerate: the
orchestrator starts one worker per gang and the worker fans out.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue as queue_mod
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist_mod
import torch.multiprocessing as mp

log = logging.getLogger(__name__)


class DataParallelError(RuntimeError):
    """A rank of a data-parallel task failed (the message names the rank and the error)."""


@dataclass
class DistContext:
    """What a rank knows about the process group (passed to `train_fn` as its first arg)."""

    rank: int
    world_size: int
    device: str  # "cuda:<rank>" or "cpu"
    backend: str  # "nccl" | "gloo"
    _queue: Any = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, n_items: int) -> list[int]:
        """This rank's indices of an n-item batch (see `shard_indices`)."""
        return shard_indices(n_items, self.rank, self.world_size)

    def send(self, kind: str, payload: Any) -> None:
        """A message to the parent (`on_message(kind, rank, payload)`): "log", "heartbeat"."""
        if self._queue is not None:
            self._queue.put((kind, self.rank, payload))

    def log(self, message: str, level: int = logging.INFO) -> None:
        self.send("log", (level, message))

    def barrier(self) -> None:
        dist_mod.barrier()


def shard_indices(n_items: int, rank: int, world_size: int) -> list[int]:
    """DistributedSampler's split: strided, padded by wrapping so every rank gets
    ceil(n / world) items (a padded batch counts its first items twice)."""
    per_rank = -(-n_items // world_size)
    indices = list(range(n_items))
    indices += indices[: per_rank * world_size - n_items]
    return indices[rank::world_size]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wrap_model(model: torch.nn.Module, dist: DistContext | None) -> torch.nn.Module:
    """DDP-wrap `model` (already on `dist.device`) when data parallel; else the model."""
    if dist is None or dist.world_size == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [torch.device(dist.device).index] if dist.device.startswith("cuda") else None
    return DistributedDataParallel(model, device_ids=device_ids)


# --- launching -------------------------------------------------------------------------------


def _rank_main(
    rank: int,
    train_fn: Callable[..., Any],
    world_size: int,
    backend: str,
    port: int,
    device_type: str,
    threads: int,
    timeout_s: float,
    args: tuple,
    queue: Any,
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    if threads > 0:
        torch.set_num_threads(threads)
    device = "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    dist_mod.init_process_group(
        backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
    )
    try:
        dist = DistContext(rank, world_size, device, backend, queue)
        result = train_fn(dist, *args)
        # Plain pickle (a copy): torch's queue pickler would share tensors through file
        # descriptors that vanish when this process exits before the parent reads them.
        queue.put(("result", rank, pickle.dumps(result)))
    except BaseException as exc:
        # When a rank fails its peers fail too ("connection closed by peer"): the parent
        # reports the earliest error, the cause.
        queue.put(
            (
                "error",
                rank,
                (time.time(), f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:500]),
            )
        )
        raise
    finally:
        dist_mod.destroy_process_group()


def run_data_parallel(
    train_fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    backend: str | None = None,
    *,
    device_type: str | None = None,
    on_message: Callable[[str, int, Any], None] | None = None,
    threads_per_rank: int | None = None,
    timeout_s: float = 1800.0,
) -> list[Any]:
    """Run `train_fn(dist, *args)` on `world_size` local processes; their results by rank.

    `device_type` "cuda" puts rank r on cuda:r (NCCL); "cpu" uses gloo; None = cuda when
    this process sees at least `world_size` GPUs. `backend` overrides the choice.
    `threads_per_rank` (CPU) defaults to this process's torch threads / world_size.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: must be >= 1")
    if device_type is None:
        device_type = (
            "cuda"
            if torch.cuda.is_available() and torch.cuda.device_count() >= world_size
            else "cpu"
        )
    if device_type == "cuda" and torch.cuda.device_count() < world_size:
        raise DataParallelError(
            f"data_parallel over {world_size} ranks needs {world_size} GPUs; "
            f"this task sees {torch.cuda.device_count()}"
        )
    if backend is None:
        backend = "nccl" if device_type == "cuda" and dist_mod.is_nccl_available() else "gloo"
    if threads_per_rank is None:
        threads_per_rank = (
            max(1, torch.get_num_threads() // world_size) if device_type == "cpu" else 0
        )
    port = free_port()
    queue = mp.get_context("spawn").Queue()
    log.info(
        "data parallel: %d ranks, backend %s on %s, rendezvous 127.0.0.1:%d",
        world_size,
        backend,
        device_type,
        port,
    )
    procs = mp.start_processes(
        _rank_main,
        nprocs=world_size,
        join=False,
        start_method="spawn",
        args=(
            train_fn,
            world_size,
            backend,
            port,
            device_type,
            threads_per_rank,
            timeout_s,
            tuple(args),
            queue,
        ),
    )
    results: dict[int, Any] = {}
    errors: dict[int, tuple[float, str]] = {}

    def drain(block_s: float = 0.0) -> None:
        deadline = time.monotonic() + block_s
        while True:
            try:
                kind, rank, payload = queue.get(
                    timeout=max(0.0, deadline - time.monotonic()) or 0.01
                )
            except queue_mod.Empty:
                return
            if kind == "result":
                results[rank] = pickle.loads(payload)
            elif kind == "error":
                errors[rank] = payload
            elif on_message is not None:
                on_message(kind, rank, payload)

    try:
        while True:
            drain(0.2)
            if procs.join(timeout=0.05):
                break
    except mp.ProcessRaisedException as exc:  # the rank's traceback is in the message
        drain(1.0)
        if errors:
            rank, (_, message) = min(errors.items(), key=lambda item: item[1][0])
        else:
            lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
            rank, message = exc.error_index, lines[-1] if lines else str(exc)
        raise DataParallelError(f"rank {rank} of {world_size} failed: {message}") from exc
    except mp.ProcessExitedException as exc:
        raise DataParallelError(
            f"rank {exc.error_index} of {world_size} exited (code {exc.exit_code}, "
            f"signal {exc.signal_name}) without a result"
        ) from exc
    drain(0.5)
    missing = [r for r in range(world_size) if r not in results]
    if missing:
        raise DataParallelError(f"ranks {missing} of {world_size} finished without a result")
    return [results[r] for r in range(world_size)]
