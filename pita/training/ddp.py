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
- `dist.gang`: the task's `Gang` (pita/core/parallel.py) on this world: DDP or FSDP2.
- `dist.shard(n)`: this rank's indices of an n-item batch (torch's `DistributedSampler`).
- `dist.log(msg)` / `dist.send("heartbeat", msg)`: reach the caller's `on_message(kind,
  rank, payload)` (a queue drained by a thread of the caller), so every rank's lines and
  heartbeats end in the task's log.
- `apply_gang(model, dist, precision)`: the one function that applies the gang to a model
  (DDP, or FSDP2: `fully_shard` per block the model names in `_no_split_modules`, then the
  root, mixed precision from the run's `Precision`), or the model itself on one process.

How it keeps its promises:
- A failing rank: its exception line goes to the caller with a timestamp; the agent stops
  the others (SIGTERM, then SIGKILL) and `launch_ranks` raises `DataParallelError("rank r of
  k failed: <Type>: <message>")` naming the earliest failure (its peers fail next, with
  "connection closed by peer"). An out-of-memory text is kept, so the executor's classifier
  calls it `oom`.
- A rank that dies of a signal (the OOM killer's SIGKILL) reports nothing; the launcher sees
  its exit: `RankDied("rank r of k died of SIGKILL ...")`, class `killed`, never the
  survivors' "Connection reset by peer" (a rank that lost a peer waits 2 s before it exits,
  so the launcher sees the dead rank first).
- A stalled rank (SIGSTOP, a hung collective): ranks report steps (`DistContext.step`); with
  a `StallRule`, a watch thread kills every rank of a gang one of whose ranks made no step
  for the rule's bound: `GangStalled`, class `stalled`, naming the rank.
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
import re
import select
import shutil
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist_mod

from pita.core.forked_worker import (  # ranks and CPU workers: one PRELOAD
    gang_preload,
    start_forkserver,
)
from pita.core.parallel import Gang, Strategy
from pita.core.worker_pool import RANKS_DIR_PREFIX  # swept once this process is dead

log = logging.getLogger(__name__)

_HANDLED_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


class DataParallelError(RuntimeError):
    """A rank of a k-rank task failed (the message names the rank and the error).
    `startup`: no rank got past its process group (the rendezvous, Gloo's "connectFullMesh
    failed ... Connection closed by peer"): no rank ran the stage (`launch_ranks` retries)."""

    startup: bool = False


class RankDied(DataParallelError):
    """A rank was killed by a signal (the kernel's OOM killer sends SIGKILL) or died without
    a word: the gang's fault, not the stage's code. The task is retried (`killed`), from its
    checkpoint when it wrote one."""

    failure_class = "killed"


class GangStalled(DataParallelError):
    """No step from a rank for longer than the gang's stall bound (`StallRule`): the ranks
    were killed; the task is retried (`stalled`)."""

    failure_class = "stalled"


# What a rank's collective says when a peer vanished: the peer is the cause, not this rank.
PEER_LOST = re.compile(
    r"Connection reset by peer|Connection closed by peer|Broken pipe|ECONNRESET|EPIPE"
    r"|NCCL communicator was aborted|remote process exited",
    re.I,
)
PEER_LOST_GRACE_S = 2.0  # a rank that lost a peer waits this long before it exits: see _rank_main
STEP_FACTOR = 20.0  # a derived stall bound: this many times the longest gap between two steps


@dataclass(frozen=True)
class StallRule:
    """When a gang counts as stalled: a rank reported no step for `after_s` seconds when set
    (`executor.gang_stall_s`, from the moment every rank joined the process group), else for
    STEP_FACTOR x the longest gap between two of the gang's steps seen so far, at least
    `floor_s` — derived only once the gang has stepped: a stage that reports no steps, or
    is still loading its models, is bounded by `executor.task_timeout_s` and the collectives'
    timeout, never killed for a step time nobody measured. A rank whose last report was its
    loop's last step (saving the model follows) is not expected to step again."""

    after_s: float | None = None
    floor_s: float = 300.0

    def bound(self, longest_gap_s: float | None) -> float | None:
        """Seconds without a step that count as a stall; None: not judged yet."""
        if self.after_s is not None:
            return self.after_s
        if longest_gap_s is None:
            return None
        return max(self.floor_s, STEP_FACTOR * longest_gap_s)


@dataclass
class DistContext:
    """What a rank knows about its gang (passed to `entry` as its first argument)."""

    rank: int
    world_size: int
    device: str  # "cuda:<rank>" or "cpu"
    backend: str  # "nccl" | "gloo"
    _queue: Any = None
    # the task's gang on this world (set by pita.runtime.gang; DDP for a bare launch_ranks)
    gang: Gang = field(default_factory=lambda: Gang(Strategy.DDP))

    def __post_init__(self) -> None:
        if self.gang.world != self.world_size:
            self.gang = self.gang.resized(self.world_size)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def strategy(self) -> str:
        """The gang's strategy by its config name ("data_parallel" | "fsdp"), as logged."""
        return self.gang.strategy.key

    @property
    def group(self) -> Any:
        """The process group of the gang (the default one)."""
        return dist_mod.group.WORLD

    def shard(self, n_items: int, pad: bool = True) -> list[int]:
        """This rank's indices of an n-item batch (see `shard_indices`)."""
        return shard_indices(n_items, self.rank, self.world_size, pad)

    def send(self, kind: str, payload: Any) -> None:
        """A message to the caller (`on_message(kind, rank, payload)`): "log", "heartbeat"."""
        if self._queue is not None:
            self._queue.put((kind, self.rank, payload))

    def log(self, message: str, level: int = logging.INFO) -> None:
        self.send("log", (level, message))

    def step(self, done: int, total: int) -> None:
        """Tell the caller this rank made a step (the gang's stall watch, `StallRule`)."""
        self.send("step", (int(done), int(total)))

    def barrier(self) -> None:
        dist_mod.barrier()


def shard_indices(n_items: int, rank: int, world_size: int, pad: bool = True) -> list[int]:
    """This rank's indices of an n-item batch: torch's `DistributedSampler` in order (strided;
    padded by wrapping so every rank gets ceil(n / world) items: a padded batch counts its
    first items twice). `pad=False`: only the rank's real items (a loop that weighs each
    item by its share of the batch, as the value trainer does, must not count one twice)."""
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(
        range(n_items), num_replicas=world_size, rank=rank, shuffle=False, drop_last=False
    )
    indices = list(sampler)
    return indices if pad else indices[: len(range(rank, n_items, world_size))]


# --- applying a gang to a model ---------------------------------------------------------------


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks FSDP2 shards one by one: the modules whose class a Hugging Face model names
    in its `_no_split_modules` (what accelerate's FSDP auto-wrap reads: a Llama's / GPT-2's
    decoder layers), that of the model and of every pretrained model inside it (a value
    model's backbone). None named: the root alone is sharded."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return [m for m in model.modules() if m is not model and type(m).__name__ in names]


def apply_gang(
    model: torch.nn.Module, dist: DistContext | None, precision: Any = None
) -> torch.nn.Module:
    """The model a rank trains (already on `dist.device`) under its gang (`dist.gang`), as
    torchtitan's `parallelize`: DDP; FSDP2 (`fully_shard` on each of `transformer_blocks`,
    then the root, with a `MixedPrecisionPolicy` from the run's precision: parameters in its
    compute dtype, gradients reduced in fp32; none in fp32, as on the CPU); or `model`
    itself on one process. `precision`: a `pita.training.precision.Precision` (None: fp32).

    FSDP2 shards in place: the returned object *is* `model`, whose parameters are now
    DTensors (an optimizer must be built after this call)."""
    if dist is None or dist.world_size == 1 or dist.gang.runs is Strategy.NONE:
        return model
    if dist.gang.runs is Strategy.FSDP:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        kwargs: dict[str, Any] = {}
        compute = getattr(precision, "autocast_dtype", None)
        if compute is not None:
            kwargs["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=compute, reduce_dtype=torch.float32
            )
        for block in transformer_blocks(model):
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        return model
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
    if dist is None or dist.world_size == 1 or dist.gang.runs is not Strategy.FSDP:
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
    # SIGTERM ends a rank at once, as under spawn and forkserver. A rank forked ("fork")
    # inherits the agent's handler, which raises only between bytecodes: a rank blocked in a
    # rendezvous whose peer died ignored the agent's SIGTERM until its SIGKILL 30 s later.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _die_with(launcher_pid)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if threads > 0:
        torch.set_num_threads(threads)
    device = "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    dist_mod.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    queue.put(("started", rank, os.getpid()))  # the stall watch's clock starts, and may kill it
    try:
        result = entry(DistContext(rank, world, device, backend, queue), *args)
        queue.put(("done", rank, None))
        # Plain pickle (a copy): torch's queue pickler would share tensors through file
        # descriptors that vanish when this process exits before the caller reads them.
        return pickle.dumps(result)
    except BaseException as exc:
        # When a rank fails its peers fail too ("connection closed by peer"): the caller
        # reports the earliest error, the cause.
        queue.put(("error", rank, (time.time(), _first_line(exc))))
        if PEER_LOST.search(str(exc)):  # a peer died: let the launcher see its death first
            time.sleep(PEER_LOST_GRACE_S)
        raise
    finally:
        dist_mod.destroy_process_group()


# --- the caller side --------------------------------------------------------------------------


def warm_forkserver() -> None:
    """Start this process's forkserver with torch, transformers and pita's training modules
    imported, and the run's gang stages with their trainers (TRL's for a TRL stage:
    `gang_preload`); a no-op when it runs already: the ranks of every later gang fork from it."""
    start_forkserver(extra=gang_preload())


WATCH_EVERY_S = 0.5  # how often the stall watch looks at its ranks' steps


def _proc_state(pid: int) -> str:
    """A process's state letter from /proc (T: stopped; "" when it is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


class _GangWatch:
    """The caller's view of its ranks, fed by the drain: their pids ("started"), steps,
    results ("done") and errors. With a `StallRule`, a thread kills a gang one of whose
    ranks made no step for longer than the rule's bound, and says which rank."""

    def __init__(self, world: int, rule: StallRule | None):
        self.world, self.rule = world, rule
        self.pids: dict[int, int] = {}
        self.done: set[int] = set()
        self.errors: dict[int, tuple[float, str]] = {}
        self.last: dict[int, tuple[float, int, int]] = {}  # rank -> (time, done, total)
        self.longest_gap: float | None = None
        self.since: float | None = None  # when every rank had joined
        self.stalled = ""  # the line naming the stalled rank, once the watch killed the gang
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def started(self, rank: int, pid: int) -> None:
        self.pids[rank] = pid
        if len(self.pids) == self.world:
            self.since = time.monotonic()
            if self.rule is not None and self._thread is None:
                self._thread = threading.Thread(target=self._run, name="pita-gang-watch")
                self._thread.daemon = True
                self._thread.start()

    def step(self, rank: int, done: int, total: int) -> None:
        now = time.monotonic()
        prev = self.last.get(rank)
        if prev is not None and (done, total) == prev[1:]:
            return  # no progress: the clock keeps running (a new phase's step 1 is progress)
        if prev is not None:
            self.longest_gap = max(self.longest_gap or 0.0, now - prev[0])
        self.last[rank] = (now, done, total)

    def stop(self) -> None:
        self._stop.set()

    def _stepping(self, rank: int) -> bool:
        """Whether `rank` is still expected to step: not finished, and its last step report
        is not its loop's last (saving a model after it is no step, and may take long)."""
        last = self.last.get(rank)
        return rank not in self.done and (last is None or last[1] < last[2])

    def _quietest(self, now: float) -> tuple[int, float] | None:
        """(the rank to blame, seconds since its last step): a stopped rank first; None
        when no rank is expected to step."""
        assert self.since is not None
        quiet = {
            r: now - (self.last[r][0] if r in self.last else self.since)
            for r in range(self.world)
            if self._stepping(r)
        }
        if not quiet:
            return None
        stopped = [r for r in quiet if _proc_state(self.pids.get(r, 0)) in ("T", "t")]
        rank = stopped[0] if stopped else max(quiet, key=lambda r: quiet[r])
        return rank, max(quiet.values())

    def _run(self) -> None:
        assert self.rule is not None
        while not self._stop.wait(WATCH_EVERY_S):
            found = self._quietest(time.monotonic())
            if found is None:
                continue
            rank, quiet = found
            bound = self.rule.bound(self.longest_gap)
            if bound is not None and quiet > bound:
                self.stalled = self._line(rank, quiet, bound)
                for pid in self.pids.values():  # a stopped process dies of SIGKILL too
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                return

    def _line(self, rank: int, quiet: float, bound: float) -> str:
        pid = self.pids.get(rank, 0)
        state = " stopped," if _proc_state(pid) in ("T", "t") else ""
        at = self.last.get(rank)
        where = f"after step {at[1]}/{at[2]}" if at else "before its first step"
        rule = self.rule
        how = (
            f"executor.gang_stall_s={bound:g}"
            if rule is not None and rule.after_s is not None
            else f"the bound derived from its step time: {bound:.0f} s"
        )
        return (
            f"rank {rank} of {self.world} (pid {pid},{state} {where}) made no step for "
            f"{quiet:.0f} s ({how}); the gang was killed"
        )


def _drain(
    queue: Any, on_message: Callable[[str, int, Any], None] | None, watch: _GangWatch
) -> None:
    """Forward ranks' messages until the None sentinel; what the watch needs goes to it."""
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
            watch.errors.setdefault(rank, payload)
        elif kind == "started":
            watch.started(rank, int(payload))
        elif kind == "done":
            watch.done.add(rank)
        elif kind == "step":
            watch.step(rank, *payload)
        elif on_message is not None:
            try:
                on_message(kind, rank, payload)
            except Exception:  # noqa: BLE001 - a log handler must never stop the drain
                log.exception("forwarding a rank's %s failed", kind)


def _signal_death(exc: Exception, watch: _GangWatch) -> RankDied | None:
    """A rank the launcher saw die of a signal without a Python error of its own (SIGKILL
    from the OOM killer, SIGSEGV), or a rank that said nothing while every rank that spoke
    only lost a peer: the gang's cause, named with its signal."""
    for rank, failure in sorted((getattr(exc, "failures", None) or {}).items()):
        if failure.exitcode is not None and failure.exitcode < 0 and rank not in watch.errors:
            name = failure.signal_name()
            oom = " (what the kernel's OOM killer sends)" if name == "SIGKILL" else ""
            return RankDied(f"rank {rank} of {watch.world} died of {name}{oom}, pid {failure.pid}")
    lost_peer = watch.errors and all(PEER_LOST.search(m) for _, m in watch.errors.values())
    silent = [r for r in range(watch.world) if r not in watch.errors and r not in watch.done]
    if lost_peer and silent:
        rank, (_, message) = min(watch.errors.items(), key=lambda item: item[1][0])
        return RankDied(
            f"rank {silent[0]} of {watch.world} died without an error (pid "
            f"{watch.pids.get(silent[0], '?')}); rank {rank} lost it: {message}"[:700]
        )
    return None


def _failure(exc: Exception, watch: _GangWatch) -> DataParallelError:
    """Why the gang failed: the stall watch's line; else a rank that died of a signal
    (`_signal_death`); else the earliest rank error the ranks reported; else the launcher's
    record of the first failed rank."""
    world_size, errors = watch.world, watch.errors
    if watch.stalled:
        return GangStalled(watch.stalled)
    died = _signal_death(exc, watch)
    if died is not None:
        return died
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
    stall: StallRule | None = None,
) -> list[Any]:
    """Run `entry(dist, *args)` on `world_size` local ranks; their return values by rank.

    `entry` must be a module-level function (the ranks import it by name) and should
    return something small. `device_type` "cuda" puts rank r on cuda:r (NCCL); "cpu" uses
    gloo; None = cuda when this process sees at least `world_size` GPUs. `backend`
    overrides the choice. `threads_per_rank` (CPU) defaults to this process's torch
    threads / world_size. Raises `DataParallelError` naming the failed rank: `RankDied` for a
    rank killed by a signal, `GangStalled` when `stall` is given and a rank made no step
    (`DistContext.step`) for longer than its bound (the ranks are then killed).

    A gang that fails before any rank got past its process group (the rendezvous, Gloo's
    full mesh: `DataParallelError.startup`, no rank ran `entry`) is started once more: a
    start-up fault, not the task's (a cold forkserver's first gang under load once failed
    in Gloo's connectFullMesh and the identical rerun passed). The task log says so
    (`on_message`'s "log").
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
        stall=stall,
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
    stall: StallRule | None,
) -> list[Any]:
    """One start of `launch_ranks`' gang."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.launcher.api import elastic_launch

    device_type, backend, threads_per_rank = _rank_devices(
        world_size, device_type, backend, threads_per_rank
    )
    if start_method == "forkserver":
        warm_forkserver()
    queue = multiprocessing.get_context(start_method).Queue()
    watch = _GangWatch(world_size, stall)
    drain = threading.Thread(
        target=_drain, args=(queue, on_message, watch), name="pita-ranks", daemon=True
    )
    drain.start()
    # named after this process: a sweep removes the folders of dead ones (a killed worker)
    log_dir = tempfile.mkdtemp(prefix=f"{RANKS_DIR_PREFIX}{os.getpid()}-")
    config = _launch_config(world_size, timeout_s, start_method, log_dir)
    log.info(
        "%d ranks via elastic_launch (%s, %s on %s)", world_size, start_method, backend, device_type
    )
    _quiet_launcher_logs()
    try:
        rank_args = (entry, tuple(args), queue, backend, device_type, threads_per_rank)
        with _signals_kept():
            returned = elastic_launch(config, _rank_main)(os.getpid(), *rank_args, timeout_s)
    except ChildFailedError as exc:
        _stop_drain(queue, drain)
        failure = _failure(exc, watch)
        failure.startup = not watch.pids  # no rank got past its process group
        raise failure from exc
    except (RendezvousError, dist_mod.DistNetworkError) as exc:  # the agent's own rendezvous
        _stop_drain(queue, drain)
        failure = DataParallelError(
            f"the {world_size} ranks' rendezvous failed: {_first_line(exc)}"
        )
        failure.startup = not watch.pids
        raise failure from exc
    finally:
        watch.stop()
        shutil.rmtree(log_dir, ignore_errors=True)
    _stop_drain(queue, drain)
    return _results(returned, world_size)


def _results(returned: dict[int, bytes], world_size: int) -> list[Any]:
    """The ranks' pickled return values, by rank (every rank must have returned)."""
    missing = [r for r in range(world_size) if r not in returned]
    if missing:
        raise DataParallelError(f"ranks {missing} of {world_size} finished without a result")
    return [pickle.loads(returned[r]) for r in range(world_size)]


@contextlib.contextmanager
def _signals_kept() -> Iterator[None]:
    """The launcher installs its own signal handlers (on the main thread, where it can stop
    its ranks on a signal): this process's are put back afterwards."""
    main = threading.current_thread() is threading.main_thread()
    if not main:
        log.warning(
            "launch_ranks off the main thread: the launcher cannot stop its ranks on a signal"
        )
    saved = {name: signal.getsignal(getattr(signal, name)) for name in _HANDLED_SIGNALS if main}
    try:
        yield
    finally:
        for name, handler in saved.items():
            signal.signal(getattr(signal, name), handler)


def _rank_devices(
    world_size: int, device_type: str | None, backend: str | None, threads: int | None
) -> tuple[str, str, int]:
    """(device type, backend, torch threads per rank) of a k-rank launch (see
    `launch_ranks`); refuses a CUDA gang with fewer GPUs than ranks."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: must be >= 1")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device_type is None:
        device_type = "cuda" if gpus >= world_size else "cpu"
    if device_type == "cuda" and gpus < world_size:
        raise DataParallelError(f"{world_size} ranks need {world_size} GPUs; this task sees {gpus}")
    if backend is None:
        backend = "nccl" if device_type == "cuda" and dist_mod.is_nccl_available() else "gloo"
    if threads is None:
        threads = max(1, torch.get_num_threads() // world_size) if device_type == "cpu" else 0
    return device_type, backend, threads


def _launch_config(world_size: int, timeout_s: float, start_method: str, log_dir: str) -> Any:
    """torch's elastic `LaunchConfig` of one node's k ranks: c10d rendezvous on a free local
    port, no restarts (pita's retry policy owns them), the agent's monitor every 0.1 s."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    return LaunchConfig(
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


def _stop_drain(queue: Any, drain: threading.Thread) -> None:
    """Let the drain forward what the ranks put before they exited, then stop it."""
    queue.put(None)
    drain.join(timeout=5.0)
    queue.close()


def _quiet_launcher_logs() -> None:
    """The launcher's INFO lines (rendezvous, agent state) would flood a task log."""
    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.WARNING)
