"""k local ranks of one training task, started by torch's elastic launcher.

`launch_ranks(entry, world_size, args)` runs `entry(dist, *args)` on `world_size` local
processes through `torch.distributed.launcher.api.elastic_launch` and returns their return
values by rank. Nothing here is hand-written rendezvous: the launcher's c10d store binds
`localhost:0` (two gangs starting at once get distinct ports), its agent watches the ranks
(`monitor_interval` 0.1 s) and stops the others when one fails; `max_restarts=0`, because
pita's retry policy (by failure class, in the executor) owns retries.

What a rank gets (`entry`'s first argument, a `DistContext`):
- `dist.rank`, `dist.world_size`, `dist.device` ("cuda:<rank>" or "cpu"), `dist.backend`
  ("nccl" | "gloo"); the default process group is initialised before `entry` runs
  (`torch.distributed.group.WORLD`), and destroyed after it returns.
- `dist.shard(n)`: this rank's indices of an n-item batch (DistributedSampler's split).
- `dist.log(msg)` / `dist.send("heartbeat", msg)`: reach the caller's `on_message(kind,
  rank, payload)` (a queue drained by a thread of the caller), so every rank's lines and
  heartbeats end in the task's log.
- `wrap_model(model, dist, strategy)`: DDP, or FSDP2 (`fully_shard` per transformer block
  and the root; `MixedPrecisionPolicy` on CUDA only), or the model itself on one rank.

How it keeps its promises:
- A failing rank: its exception line goes to the caller with a timestamp; the agent stops
  the others (SIGTERM, then SIGKILL) and `launch_ranks` raises `DataParallelError("rank r of
  k failed: <Type>: <message>")` naming the earliest failure (its peers fail next, with
  "connection closed by peer"). An out-of-memory text is kept, so the executor's classifier
  calls it `oom`.
- No orphans: every rank sets `prctl(PR_SET_PDEATHSIG, SIGKILL)` (its parent under spawn is
  the worker) and watches the worker through a pidfd (under forkserver its parent is the
  forkserver, which outlives the worker while any rank lives): `_die_with`.
- Start-up: ranks are forked from a forkserver that imported torch, transformers and pita's
  training modules once (`warm_forkserver`); a later gang of the same worker forks warm
  processes. `start_method="spawn"` is the fallback (each rank imports everything again).
- Must run on the caller's main thread (the launcher installs its SIGTERM handler there,
  which stops the ranks); the previous handlers are put back afterwards.

How many ranks a task gets and the per-rank stage context are the worker's business
(`pita/runtime/gang.py`: `gang_world_size`, `run_stage`); this module knows processes and
tensors, not tasks.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import multiprocessing
import os
import pickle
import queue as queue_mod
import select
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist_mod

from pita.core.forked_worker import (  # ranks and CPU workers: one PRELOAD
    gang_preload,
    start_forkserver,
)

log = logging.getLogger(__name__)

STRATEGIES = ("none", "data_parallel", "fsdp")
_HANDLED_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


class DataParallelError(RuntimeError):
    """A rank of a k-rank task failed (the message names the rank and the error).
    `startup`: it failed before any rank formed its process group (the rendezvous, Gloo's
    "connectFullMesh failed ... Connection closed by peer"): no rank ran the stage."""

    def __init__(self, message: str, startup: bool = False):
        super().__init__(message)
        self.startup = startup


@dataclass
class DistContext:
    """What a rank knows about its gang (passed to `entry` as its first argument)."""

    rank: int
    world_size: int
    device: str  # "cuda:<rank>" or "cpu"
    backend: str  # "nccl" | "gloo"
    _queue: Any = None
    strategy: str = "data_parallel"  # "data_parallel" | "fsdp" (set by pita.runtime.gang)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def group(self) -> Any:
        """The process group of the gang (the default one)."""
        return dist_mod.group.WORLD

    def shard(self, n_items: int) -> list[int]:
        """This rank's indices of an n-item batch (see `shard_indices`)."""
        return shard_indices(n_items, self.rank, self.world_size)

    def send(self, kind: str, payload: Any) -> None:
        """A message to the caller (`on_message(kind, rank, payload)`): "log", "heartbeat"."""
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


# --- wrapping a model -------------------------------------------------------------------------


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks FSDP2 shards one by one: the children of the model's largest
    `ModuleList` (a Llama's / GPT-2's layers)."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 0]
    if not lists:
        return []
    biggest = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
    return list(biggest)


def wrap_model(
    model: torch.nn.Module, dist: DistContext | None, strategy: str | None = None
) -> torch.nn.Module:
    """The model a rank trains (already on `dist.device`): DDP (`data_parallel`), FSDP2
    (`fsdp`: `fully_shard` per transformer block, then the root; a bf16 compute /
    fp32 reduce `MixedPrecisionPolicy` on CUDA only), or `model` itself on one process.

    FSDP2 shards in place: the returned object *is* `model`, whose parameters are now
    DTensors (an optimizer must be built after this call). `strategy` defaults to
    `dist.strategy`."""
    strategy = strategy or (dist.strategy if dist is not None else "none")
    if dist is None or dist.world_size == 1 or strategy == "none":
        return model
    if strategy == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        kwargs: dict[str, Any] = {}
        if dist.device.startswith("cuda"):
            kwargs["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32
            )
        for block in transformer_blocks(model):
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        return model
    if strategy != "data_parallel":
        raise ValueError(f"parallel strategy {strategy!r}: expected one of {STRATEGIES}")
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [torch.device(dist.device).index] if dist.device.startswith("cuda") else None
    return DistributedDataParallel(model, device_ids=device_ids)


def full_state_dict(model: torch.nn.Module, dist: DistContext | None) -> dict[str, Any]:
    """`model`'s whole state dict on the CPU. FSDP2: every shard gathered (a collective:
    every rank calls it, in the same order); otherwise the model's own."""
    from torch.distributed.tensor import DTensor

    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
        for k, v in model.state_dict().items()
    }


class FullState:
    """A model's (or, with `optimizer`, its optimizer's) state for a `Checkpointer` as full,
    unsharded tensors keyed by parameter name, whatever the strategy and k: `state_dict`
    gathers FSDP2's shards (a collective: every rank calls it; rank 0 gets the tensors),
    `load_state_dict` puts a full state into this rank's shards (or the whole model). So a
    checkpoint written by k ranks resumes on any k, DDP or FSDP2 or one process.

    Not `torch.distributed.checkpoint`'s sharded files: their `.metadata` is a pickle that
    DCP loads with `pickle.load`, and a pita checkpoint never unpickles (see
    pita/training/checkpoint.py). The price: rank 0 holds the whole state while saving."""

    def __init__(self, model: torch.nn.Module, optimizer: Any = None):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        if self.optimizer is None:
            return get_model_state_dict(self.model, options=options)
        return get_optimizer_state_dict(self.model, self.optimizer, options=options)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True)
        if self.optimizer is None:
            set_model_state_dict(self.model, state, options=options)
        else:
            set_optimizer_state_dict(self.model, self.optimizer, state, options=options)


@contextlib.contextmanager
def gathered(net: Any, dist: DistContext | None) -> Iterator[None]:
    """FSDP2: the root module's own parameters unsharded while the body reads the model
    outside its forward (held-out diagnostics); every rank must enter. No-op otherwise."""
    if dist is None or dist.world_size == 1 or dist.strategy != "fsdp":
        yield
        return
    net.unshard()
    try:
        yield
    finally:
        net.reshard()


# --- the rank side ----------------------------------------------------------------------------


def _die_with(launcher_pid: int) -> None:
    """SIGKILL this rank when the process that launched it dies, however it dies.

    `prctl(PR_SET_PDEATHSIG, SIGKILL)` covers a spawned rank, whose parent is the launcher.
    A forkserver rank's parent is the forkserver, which by design lives as long as any of
    its children (each holds its "alive" pipe), so the rank also watches the launcher
    itself through a pidfd (readable once that process has exited) from a daemon thread."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    try:
        pidfd = os.pidfd_open(launcher_pid)
    except ProcessLookupError:  # the launcher died before this rank started
        os._exit(1)

    def watch() -> None:
        select.select([pidfd], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="pita-launcher-watch", daemon=True).start()


def _first_line(exc: BaseException) -> str:
    lines = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return (lines[0] if lines else type(exc).__name__)[:500]


def _rank_main(
    launcher_pid: int,
    entry: Callable[..., Any],
    args: tuple,
    queue: Any,
    backend: str,
    device_type: str,
    threads: int,
    timeout_s: float,
) -> bytes:
    """One rank (started by the elastic agent, which set RANK, WORLD_SIZE, MASTER_ADDR/PORT)."""
    _die_with(launcher_pid)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if threads > 0:
        torch.set_num_threads(threads)
    device = "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    dist_mod.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    queue.put(("formed", rank, None))  # past the rendezvous: a failure now is the stage's
    try:
        result = entry(DistContext(rank, world, device, backend, queue), *args)
        # Plain pickle (a copy): torch's queue pickler would share tensors through file
        # descriptors that vanish when this process exits before the caller reads them.
        return pickle.dumps(result)
    except BaseException as exc:
        # When a rank fails its peers fail too ("connection closed by peer"): the caller
        # reports the earliest error, the cause.
        queue.put(("error", rank, (time.time(), _first_line(exc))))
        raise
    finally:
        dist_mod.destroy_process_group()


# --- the caller side --------------------------------------------------------------------------


def warm_forkserver() -> None:
    """Start this process's forkserver with torch, transformers and pita's training modules
    imported, and the run's gang stages with their trainers (TRL's for a TRL stage:
    `gang_preload`); a no-op when it runs already: the ranks of every later gang fork from it."""
    start_forkserver(extra=gang_preload())


def _drain(
    queue: Any,
    on_message: Callable[[str, int, Any], None] | None,
    errors: dict,
    formed: set[int] | None = None,
) -> None:
    """Forward ranks' messages until the None sentinel; keep their errors and which ranks
    formed their process group (`formed`)."""
    while True:
        try:
            item = queue.get(timeout=0.5)
        except queue_mod.Empty:
            continue
        except (EOFError, OSError):
            return
        if item is None:
            return
        kind, rank, payload = item
        if kind == "error":
            errors.setdefault(rank, payload)
        elif kind == "formed":
            if formed is not None:
                formed.add(rank)
        elif on_message is not None:
            try:
                on_message(kind, rank, payload)
            except Exception:  # noqa: BLE001 - a log handler must never stop the drain
                log.exception("forwarding a rank's %s failed", kind)


def _failure(
    exc: Exception, errors: dict, world_size: int, formed: set[int] | frozenset = frozenset()
) -> DataParallelError:
    """The earliest rank error the ranks reported, else the launcher's record of the first
    failed rank (a rank killed by a signal leaves no traceback). `formed`: the ranks that
    got past their process group; none did: a start-up fault (`DataParallelError.startup`)."""
    made = _failure_message(exc, errors, world_size)
    made.startup = not formed
    return made


def _failure_message(exc: Exception, errors: dict, world_size: int) -> DataParallelError:
    if errors:
        rank, (_, message) = min(errors.items(), key=lambda item: item[1][0])
        return DataParallelError(f"rank {rank} of {world_size} failed: {message}")
    failures = getattr(exc, "failures", None)
    if failures:
        rank, failure = min(failures.items(), key=lambda item: item[1].timestamp)
        message = failure.message
        if isinstance(message, dict):  # the error file's record
            message = message.get("message", "")
        lines = [ln for ln in str(message).strip().splitlines() if ln.strip()]
        text = lines[-1] if lines else f"exit code {failure.exitcode}"
        return DataParallelError(f"rank {rank} of {world_size} failed: {text}"[:700])
    return DataParallelError(f"a rank of {world_size} failed: {_first_line(exc)}")


def launch_ranks(
    entry: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    backend: str | None = None,
    *,
    device_type: str | None = None,
    on_message: Callable[[str, int, Any], None] | None = None,
    threads_per_rank: int | None = None,
    timeout_s: float = 1800.0,
    start_method: str = "forkserver",
) -> list[Any]:
    """Run `entry(dist, *args)` on `world_size` local ranks; their return values by rank.

    `entry` must be a module-level function (the ranks import it by name) and should
    return something small. `device_type` "cuda" puts rank r on cuda:r (NCCL); "cpu" uses
    gloo; None = cuda when this process sees at least `world_size` GPUs. `backend`
    overrides the choice. `threads_per_rank` (CPU) defaults to this process's torch
    threads / world_size. Raises `DataParallelError` naming the failed rank.

    A gang that fails before any rank formed its process group (the rendezvous, Gloo's
    full mesh: `DataParallelError.startup`, no rank ran `entry`) is started once more: a start-up fault, not the task's (a cold
    forkserver's first gang under load once failed in Gloo's connectFullMesh and the
    identical rerun passed). The task log says so (`on_message`'s "log").
    """
    launch = functools.partial(
        _launch,
        entry,
        world_size,
        args,
        backend,
        device_type=device_type,
        on_message=on_message,
        threads_per_rank=threads_per_rank,
        timeout_s=timeout_s,
        start_method=start_method,
    )
    try:
        return launch()
    except DataParallelError as exc:
        if not exc.startup:
            raise
        note = f"gang start-up fault ({exc}); starting the {world_size} ranks once more"
        log.warning("%s", note)
        if on_message is not None:
            on_message("log", 0, (logging.WARNING, note))
        return launch()


def _launch(
    entry: Callable[..., Any],
    world_size: int,
    args: Sequence[Any],
    backend: str | None,
    *,
    device_type: str | None,
    on_message: Callable[[str, int, Any], None] | None,
    threads_per_rank: int | None,
    timeout_s: float,
    start_method: str,
) -> list[Any]:
    """One start of `launch_ranks`' gang."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

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
            f"{world_size} ranks need {world_size} GPUs; this task sees {torch.cuda.device_count()}"
        )
    if backend is None:
        backend = "nccl" if device_type == "cuda" and dist_mod.is_nccl_available() else "gloo"
    if threads_per_rank is None:
        threads_per_rank = (
            max(1, torch.get_num_threads() // world_size) if device_type == "cpu" else 0
        )
    if start_method == "forkserver":
        warm_forkserver()
    if threading.current_thread() is not threading.main_thread():
        log.warning(
            "launch_ranks off the main thread: the launcher cannot stop its ranks on a signal"
        )
    queue = multiprocessing.get_context(start_method).Queue()
    errors: dict[int, tuple[float, str]] = {}
    formed: set[int] = set()
    drain = threading.Thread(
        target=_drain, args=(queue, on_message, errors, formed), name="pita-ranks", daemon=True
    )
    drain.start()
    saved = {
        name: signal.getsignal(getattr(signal, name))
        for name in _HANDLED_SIGNALS
        if threading.current_thread() is threading.main_thread()
    }
    log_dir = tempfile.mkdtemp(prefix="pita-ranks-")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world_size,
        run_id=f"pita-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        rdzv_configs={"timeout": int(min(timeout_s, 900))},
        max_restarts=0,
        monitor_interval=0.1,
        start_method=start_method,
        logs_specs=DefaultLogsSpecs(log_dir=log_dir),
    )
    log.info(
        "%d ranks via elastic_launch (%s, %s on %s)", world_size, start_method, backend, device_type
    )
    _quiet_launcher_logs()
    try:
        returned = elastic_launch(config, _rank_main)(
            os.getpid(),
            entry,
            tuple(args),
            queue,
            backend,
            device_type,
            threads_per_rank,
            timeout_s,
        )
    except ChildFailedError as exc:
        _stop_drain(queue, drain)
        raise _failure(exc, errors, world_size, formed) from exc
    except (RendezvousError, dist_mod.DistNetworkError) as exc:  # the agent's own rendezvous
        _stop_drain(queue, drain)
        raise DataParallelError(
            f"the {world_size} ranks' rendezvous failed: {_first_line(exc)}", startup=not formed
        ) from exc
    finally:
        for name, handler in saved.items():
            signal.signal(getattr(signal, name), handler)
        import shutil

        shutil.rmtree(log_dir, ignore_errors=True)
    _stop_drain(queue, drain)
    missing = [r for r in range(world_size) if r not in returned]
    if missing:
        raise DataParallelError(f"ranks {missing} of {world_size} finished without a result")
    return [pickle.loads(returned[r]) for r in range(world_size)]


def _stop_drain(queue: Any, drain: threading.Thread) -> None:
    """Let the drain forward what the ranks put before they exited, then stop it."""
    queue.put(None)
    drain.join(timeout=5.0)
    queue.close()


def _quiet_launcher_logs() -> None:
    """The launcher's INFO lines (rendezvous, agent state) would flood a task log."""
    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.WARNING)
