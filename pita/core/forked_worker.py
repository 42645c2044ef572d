"""CPU and fake-device workers forked from a warm forkserver instead of started fresh.

A fresh worker process spends 3-5 s of CPU importing torch, transformers and pita's
training modules before its first task. On CPU and `fake:` devices those cores are the
run's compute, and every worker of a run (and every one that replaces a killed one)
imported the same modules again. Here the orchestrator's multiprocessing forkserver imports
them once (`PRELOAD`, the list gang ranks fork warm from too: pita/training/ddp.py) and each
worker forks from it: a second worker, or a retry's worker after a SIGKILL, is running its
task within milliseconds (bench/worker_start.py).

What a fresh process gets from `subprocess.Popen`, the forked child does itself before the
worker's `main` runs: a session of its own (the pool signals the worker's process group),
its explicit environment (devices, threads, the run's variables), the pool's working folder,
stdout and stderr appended to its log file, and the channel's authkey as an argument (a
forked child's stdin is /dev/null).

CUDA workers still start as fresh processes: `CUDA_VISIBLE_DEVICES` is fixed when a
process first touches CUDA, and that a preloaded torch never touched it before the fork has
not been checked on a GPU with this path (the gang forkserver on CUDA workers has been).
"""

from __future__ import annotations

import atexit
import importlib
import multiprocessing
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Protocol

# Imported once in a forkserver: every process forked from it starts with them loaded.
# transformers imports its model classes lazily: the families' own are named here, else
# every child imports them again. A module that does not import is skipped by the forkserver.
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint.state_dict",
    "torch.nn.parallel",
    "omegaconf",
    "safetensors.torch",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.optimization",
    "pita.training.ddp",
    "pita.training.loop",
    "pita.training.checkpoint",
    "pita.runtime.gang",
    "pita.runtime.kit",
    "pita.runtime.worker",
    "pita.algos.value_training",
    "pita.models.value_model",
    "pita.stages.pretrain",
)
WORKER_MODULE = "pita.runtime.worker"  # the program a worker runs (`python -m` when fresh)


def forks_workers(kind: str, preimport: bool, pending: int = 1) -> bool:
    """Whether a pool on `kind` devices forks its workers: when they import torch up front
    (`executor.preimport`), are not CUDA workers, and a task is `pending` (a resume of a
    finished run only writes its report: a forkserver would import torch for no worker)."""
    return preimport and kind != "cuda" and pending > 0


class WorkerProcess(Protocol):
    """What the pool needs of a worker process: `subprocess.Popen` has it."""

    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class ForkedWorker:
    """A worker forked from the forkserver, seen through Popen's `pid`, `poll` and `wait`
    (exit code, or minus the signal that ended it)."""

    def __init__(self, process: multiprocessing.process.BaseProcess):
        self._process = process
        assert process.pid is not None  # started
        self.pid: int = process.pid

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(WORKER_MODULE, timeout or 0.0)
        return code


def start_forkserver(env: dict[str, str] | None = None, extra: Sequence[str] = ()) -> None:
    """Start this process's forkserver (a no-op when it runs) with `PRELOAD` imported: the
    pool's forked workers and a worker's gang ranks (pita.training.ddp.warm_forkserver) fork
    from it. `env`: the server's environment (the pool's: a worker's, its devices aside;
    libraries read some variables when they are imported, huggingface_hub its progress-bar
    switch, and they are imported there); None: this process's. `extra`: more modules to
    preload (a gang's stage and its trainer: `gang_preload`).

    os.environ is swapped only while the server process is spawned: call this before the
    pool's own threads start."""
    from multiprocessing import forkserver

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([*PRELOAD, *(m for m in extra if m not in PRELOAD)])
    if env is None:
        forkserver.ensure_running()
        return
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)


# The stage modules of the run's gang tasks (comma-separated, set by pita.experiment.run):
# a worker's forkserver preloads them and their `WARM_IMPORTS` (TRL's trainer for a TRL
# stage), so each rank of such a gang forks with its trainer imported instead of importing
# it itself (a 2-rank DPO gang: 15-19 s to its first step without, 4-5 s with).
GANG_STAGES = "PITA_GANG_STAGES"


def gang_preload(modules: str | None = None) -> list[str]:
    """What a gang's ranks import before their first step, beyond `PRELOAD`: each stage
    module of `modules` (default: $PITA_GANG_STAGES) and the names in its `WARM_IMPORTS`.
    A module that does not import is left out (the stage reports it when it runs)."""
    names = os.environ.get(GANG_STAGES, "") if modules is None else modules
    out: list[str] = []
    for name in filter(None, names.split(",")):
        try:
            module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - only a head start
            continue
        out += [name, *getattr(module, "WARM_IMPORTS", ())]
    return list(dict.fromkeys(out))


def start_forked_worker(
    argv: list[str],
    env: dict[str, str],
    cwd: str,
    log_path: str | None,
    authkey: bytes,
    module: str = WORKER_MODULE,
) -> ForkedWorker:
    """Fork a worker running `<module>.main(argv)` (pita.runtime.worker's) from the
    forkserver. The first call waits for the server's imports; later ones take milliseconds."""
    ctx = multiprocessing.get_context("forkserver")
    process = ctx.Process(
        target=_forked_child, args=(argv, env, cwd, log_path, authkey, module), name="pita-worker"
    )
    process.start()
    return ForkedWorker(process)


def _forked_child(
    argv: list[str],
    env: dict[str, str],
    cwd: str,
    log_path: str | None,
    authkey: bytes,
    module: str = WORKER_MODULE,
) -> None:
    """In the forked child: what Popen would have set up, then the worker's main."""
    reseed_globals()  # else every worker forked from the server draws the server's stream
    os.setsid()
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    if log_path is not None:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)  # umask applies
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    worker = importlib.import_module(module)  # named as the fresh path's `-m` names it
    worker.leave(worker.main(argv, authkey=authkey))


def reseed_globals(seed: int | None = None) -> int:
    """Seed Python's, numpy's and torch's global generators with `seed` (None: fresh bytes
    from the OS) and return it. A forked child inherits its forkserver's generator states,
    so without this every worker forked from one server (and every gang rank) draws the
    same "random" numbers; a fresh process seeds itself from the OS. pita's stages seed
    their own generators (pita/models/seeds.py); this is for the library and plugin code
    that draws from the global ones. numpy and torch are reseeded only when already
    imported (the forkserver preloads them), never imported here."""
    import random

    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little") >> 1
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed % 2**32)  # numpy's legacy seeds stop at 2**32
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "manual_seed"):
        torch.manual_seed(seed)  # CUDA's generators are seeded lazily, no context made here
    return seed


def kill_at_exit(pids: Callable[[], list[int]]) -> None:
    """At this process's exit, SIGKILL the process groups of the forked workers still alive.
    multiprocessing joins its children at exit and a worker is one; the pool stops them
    first (shutdown), so this only matters when the orchestrator leaves without it."""

    def kill() -> None:
        for pid in pids():
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    atexit.register(kill)
