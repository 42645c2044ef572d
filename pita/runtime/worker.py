"""The worker process: `python -m pita.runtime.worker --address SOCKET --worker-id N`.

Started by `WorkerPool` with an explicit environment (its devices are pinned with
`CUDA_VISIBLE_DEVICES` before Python starts) and the channel's authkey on stdin. It
connects back to the orchestrator over a Unix socket in a private folder (the key never
appears on a command line), then loops: receive (task spec, resolved config as a
plain dict) -> rebuild the DictConfig -> run the stage function -> commit the task folder
atomically -> answer `done` or a classified `failed`. A heartbeat thread reports liveness
and memory every `heartbeat_s`. The worker exits when the orchestrator goes away.

Messages (tuples over a `multiprocessing.connection`):
  parent -> worker: ("run", task_dict, cfg_dict, run_dir, attempt) | ("stop",)
  worker -> parent: ("hello", worker_id, pid) | ("started", task_id)
                    ("heartbeat", task_id|None, stats) | ("done", task_id, result, stats)
                    ("failed", task_id, failure_class, message, stats)
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Client
from pathlib import Path
from typing import Any

from pita.core.errors import RECYCLE_WORKER, STOPPED, StoppedAtCheckpoint
from pita.runtime.oom import classify_exception


def _die_with_parent() -> None:
    """Linux: SIGTERM this process when the orchestrator dies (even by SIGKILL)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def memory_stats() -> dict[str, Any]:
    """RSS of this process, plus torch's CUDA allocator figures when CUDA is in use."""
    stats: dict[str, Any] = {"pid": os.getpid()}
    try:
        import psutil

        stats["rss_mb"] = round(psutil.Process().memory_info().rss / 2**20, 1)
    except Exception:
        pass
    torch = sys.modules.get("torch")  # never import torch just to report
    if torch is not None:
        try:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                stats["cuda"] = [
                    {
                        "allocated_mb": round(torch.cuda.memory_allocated(i) / 2**20, 1),
                        "reserved_mb": round(torch.cuda.memory_reserved(i) / 2**20, 1),
                        "peak_mb": round(torch.cuda.max_memory_reserved(i) / 2**20, 1),
                    }
                    for i in range(torch.cuda.device_count())
                ]
        except Exception:
            pass
    return stats


def reset_peak_memory() -> None:
    """Start a task's peak at what is resident now (cached models included); CUDA only."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                torch.cuda.reset_peak_memory_stats(i)
    except Exception:  # noqa: BLE001 - a measurement must never fail a task
        pass


def peak_memory_mb() -> float:
    """The largest `max_memory_reserved` over this worker's devices since the reset, in MB
    (0 without CUDA): the scheduler's next estimate for tasks like this one learns from it."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            return round(
                max(torch.cuda.max_memory_reserved(i) for i in range(torch.cuda.device_count()))
                / 2**20,
                1,
            )
    except Exception:  # noqa: BLE001
        pass
    return 0.0


class Channel:
    """A connection whose sends are serialised (main thread + heartbeat thread)."""

    def __init__(self, conn):
        self.conn = conn
        self.lock = threading.Lock()

    def send(self, msg: tuple) -> None:
        with self.lock:
            self.conn.send(msg)


def _task_logger(task_id: str, log_path: Path) -> logging.Logger:
    logger = logging.getLogger(f"pita.task.{task_id}")
    logger.handlers.clear()
    logger.propagate = False
    logger.setLevel(logging.INFO)
    handler = logging.FileHandler(log_path)
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(levelname)s] %(message)s"))
    logger.addHandler(handler)
    return logger


class FirstStep:
    """Seconds from a task's start to its first optimizer step: the first progress line a
    stage reports in steps (`step 1/400 ...`, pita.core.progress.progress_line), on one
    process or from rank 0 of its gang. Recorded in the task's result (`first_step_s`) and
    from there in the duration history: the measured start-up of that stage kind on k
    ranks that the sizer reads (pita/core/elastic.py GangStartup)."""

    def __init__(self, t0: float, forward: Callable[[str], None]):
        self.t0, self.forward = t0, forward
        self.seconds: float | None = None

    def heartbeat(self, message: str) -> None:
        if self.seconds is None and _is_step(message):
            self.seconds = time.time() - self.t0
        self.forward(message)


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and its waited-for children."""
    import resource

    own, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _is_step(message: str) -> bool:
    from pita.core.progress import PROGRESS_RE

    m = PROGRESS_RE.match(message or "")
    return m is not None and m["unit"] == "step" and int(m["done"]) >= 1


def execute_task(
    task,
    cfg_dict: dict,
    run_dir: str | Path,
    attempt: int,
    *,
    device: str,
    models,
    heartbeat=lambda msg: None,
    reraise_interrupt: bool = False,
) -> tuple[bool, str | None, str, dict]:
    """Run one stage function and commit its folder; shared by workers and in-process runs.

    Returns (ok, failure class, one-line message, result). On success the task folder is
    committed atomically (manifest last); on failure the temporary folder, with the log
    and error.json, is kept as `tasks/<id>.attempt<N>.failed/` and resume ignores it.
    """
    from pita.core.journal import run_folder_problem
    from pita.core.paths import TaskPaths
    from pita.core.schema import recording_reads
    from pita.runtime.context import resolve_function

    paths = TaskPaths(run_dir, task.id)
    tmp = paths.tmp(os.getpid())
    try:  # an immutable tasks/ folder or a full disk: one line for the run, not a dead worker
        logger = _open_attempt(tmp, task.id)
    except OSError as exc:
        why = run_folder_problem(exc, run_dir) or f"cannot write {tmp}: {exc.strerror or exc}"
        return False, "error", why, {}
    t0 = time.time()
    try:
        where = (task.id, attempt, device, os.environ.get("CUDA_VISIBLE_DEVICES"), os.getpid())
        logger.info("task %s (attempt %d) on %s, CUDA_VISIBLE_DEVICES=%r, pid %d", *where)
        fn = resolve_function(task.fn)
        reset_peak_memory()
        first_step = FirstStep(t0, heartbeat)
        cpu0 = cpu_seconds()
        ctx = _stage_context(
            task, cfg_dict, run_dir, tmp, logger, device, models, first_step.heartbeat
        )
        with recording_reads() as reads:  # the config keys this task computed with
            returned = fn(ctx) or {}
        result = _result(task.id, attempt, t0, returned, first_step, cpu0)
        _commit(paths, tmp, logger, task.outputs, result, reads)
        return True, None, "", result
    except StoppedAtCheckpoint as stop:  # asked to stop (a resize): not a failure
        logger.info("stopped at the checkpoint of step %d after %.2fs", stop.step, time.time() - t0)
        _close(logger)
        _keep_stopped(paths, tmp, attempt, stop.step)
        return False, STOPPED, str(stop), {"stopped_at_step": stop.step}
    except BaseException as exc:  # noqa: BLE001 - every failure is reported, classified
        interrupted = isinstance(exc, (KeyboardInterrupt, SystemExit))
        failure = "interrupted" if interrupted else classify_exception(exc)
        run_file = run_folder_problem(exc, run_dir, tmp)
        _keep_failed(paths, tmp, logger, task.id, attempt, failure, exc)
        if failure == "interrupted" and reraise_interrupt:
            raise  # in-process runs: Ctrl-C inside a stage stops the whole run
        if run_file is not None:
            return False, "error", run_file, {}
        return False, failure, _one_line(exc), {}


def _result(
    task_id: str, attempt: int, t0: float, returned: dict, first_step: FirstStep, cpu0: float
) -> dict:
    """The stage's result with the task's id, wall seconds and attempt, its dispatch -> first
    step seconds (the sizer's start-up) and this process's CPU seconds in the task (a gang's
    ranks are not its children): the work the forecast learns, whatever else ran on the
    cores (pita/core/host_share.py)."""
    wall = round(time.time() - t0, 3)
    result = {"task_id": task_id, "wall_s": wall, "attempt": attempt, **returned}
    if first_step.seconds is not None:
        result.setdefault("first_step_s", round(first_step.seconds, 3))
    result.setdefault("cpu_s", round(cpu_seconds() - cpu0, 3))
    return result


def _one_line(exc: BaseException) -> str:
    """`Type: message`, its first line, at most 500 characters."""
    message = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return message[0][:500] if message else ""


def _open_attempt(tmp: Path, task_id: str) -> logging.Logger:
    """An attempt's fresh temporary folder and its task log (OSError when the run folder
    cannot take them)."""
    from pita.core.paths import Artifact

    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return _task_logger(task_id, tmp / Artifact.LOG)


def _stage_context(
    task: Any,
    cfg_dict: dict,
    run_dir: str | Path,
    out_dir: Path,
    logger: logging.Logger,
    device: str,
    models: Any,
    heartbeat: Any,
) -> Any:
    """The task's `StageContext` (its chain's config, typed once), its process seeded."""
    from pita.runtime.context import StageContext

    cfg, settings = _stage_config(cfg_dict, task)
    seed_task_globals(cfg_dict, task)
    return StageContext(
        task=task,
        cfg=cfg,
        settings=settings,
        run_dir=Path(run_dir),
        out_dir=out_dir,
        logger=logger,
        device=device,
        models=models,
        heartbeat=heartbeat,
        chain_merged=True,
    )


def _commit(
    paths: Any, tmp: Path, logger: logging.Logger, outputs: list[str], result: dict, reads: Any
) -> None:
    """A finished attempt's result.json (a NaN metric is a failed task, not a row of the
    results table), then its folder committed (manifest last); its in-task checkpoints are
    no longer needed."""
    from pita.core.paths import Artifact, atomic_write_json, nan_numbers

    bad = nan_numbers(result)
    if bad:
        raise FloatingPointError(f"NaN value(s) in the stage's result: {', '.join(bad[:5])}")
    peak = peak_memory_mb()
    if peak:
        result["peak_gpu_mb"] = peak
    atomic_write_json(tmp / Artifact.RESULT, result)
    logger.info("done in %.2fs", result["wall_s"])
    _close(logger)
    paths.commit(tmp, required=outputs, reads=reads)
    shutil.rmtree(paths.checkpoints, ignore_errors=True)


def _keep_stopped(paths: Any, tmp: Path, attempt: int, step: int) -> None:
    """An attempt stopped at a checkpoint: its folder (its log) kept beside the other
    attempts' (`TaskPaths.stopped`)."""
    kept = paths.stopped(attempt, step)
    shutil.rmtree(kept, ignore_errors=True)
    with contextlib.suppress(OSError):
        os.replace(tmp, kept)


def _keep_failed(
    paths: Any,
    tmp: Path,
    logger: logging.Logger,
    task_id: str,
    attempt: int,
    failure: str,
    exc: BaseException,
) -> None:
    """A failed attempt's folder, with its log and error.json, kept as
    `tasks/<id>.attempt<N>.failed/` (on a full disk these writes fail too: the tmp folder
    stays, resume removes it)."""
    from pita.core.paths import Artifact

    try:
        if not logger.handlers:  # the commit itself failed (a declared output is missing)
            logger = _task_logger(task_id, tmp / Artifact.LOG)
        logger.error("failed (%s): %s\n%s", failure, exc, traceback.format_exc())
        _close(logger)
        (tmp / Artifact.ERROR).write_text(
            json.dumps({"failure": failure, "message": str(exc), "type": type(exc).__name__})
        )
        failed_dir = paths.failed(attempt)
        shutil.rmtree(failed_dir, ignore_errors=True)
        os.replace(tmp, failed_dir)
    except OSError:
        _close(logger)


def seed_task_globals(cfg_dict: dict, task) -> int:
    """Seed the global generators (Python, numpy, torch) for this task: a function of the
    run seed and the task id, so a task draws the same stream on any worker, on a retry and
    in-process, and two tasks draw different ones (a forked worker would otherwise continue
    its forkserver's stream, the same in every worker). Returns the seed."""
    from pita.core.forked_worker import reseed_globals
    from pita.core.schema import default_of
    from pita.models.seeds import example_seed

    seed = (cfg_dict.get("experiment") or {}).get("seed")
    run_seed = int(seed if seed is not None else default_of("experiment.seed"))
    return reseed_globals(example_seed(run_seed, "global-generators", task.id))


_CONFIG_CACHE: dict = {
    "source": None,
    "by_chain": {},
}  # last plain dict; its DictConfig per (dataset, family), its settings per algo too


def _stage_config(cfg_dict: dict, task) -> Any:
    """(config, typed settings) a stage sees: the run's config with `dataset` and `model`
    replaced by the task's own chain groups (one channel; in a multi-dataset experiment the
    selected groups would be another chain's), and its groups as schema instances.
    OmegaConf.create on the full config costs ~10 ms and every task of a run sends the same
    dict, so a worker builds both once per chain."""
    from pita.runtime.context import chain_config, stage_settings

    if _CONFIG_CACHE["source"] != cfg_dict:
        _CONFIG_CACHE.update(source=cfg_dict, by_chain={})
    by_chain = _CONFIG_CACHE["by_chain"]
    key = (task.dataset, task.family)
    if key not in by_chain:
        by_chain[key] = chain_config(cfg_dict, task)
    cfg = by_chain[key]
    chain = (*key, task.algo, task.algo_schema)
    if chain not in by_chain:
        by_chain[chain] = stage_settings(cfg, task)
    return cfg, by_chain[chain]


def run_task_here(
    task,
    cfg_dict: dict,
    run_dir: str | Path,
    attempt: int,
    *,
    models=None,
    reraise_interrupt: bool = False,
):
    """Run `task` in this process and return a `TaskOutcome` (the `RunTask` the in-process
    and Ray executors are given). The device follows CUDA_VISIBLE_DEVICES."""
    from pita.core.executor import TaskOutcome
    from pita.core.tasks import TaskSpec
    from pita.runtime.context import ModelCache

    if isinstance(task, dict):  # a Ray task receives plain data
        task = TaskSpec.from_dict(task)
    device = "cuda" if os.environ.get("CUDA_VISIBLE_DEVICES") else "cpu"
    t0 = time.time()
    ok, failure, message, result = execute_task(
        task,
        cfg_dict,
        run_dir,
        attempt,
        device=device,
        models=models if models is not None else ModelCache(1),
        reraise_interrupt=reraise_interrupt,
    )
    return TaskOutcome(
        task.id, ok, failure, message, result, round(time.time() - t0, 3), os.getpid()
    )


class InProcessRunner:
    """The `RunTask` of the in-process executor: tasks share one model LRU and Ctrl-C in a
    stage stops the run (pdb works). Each task runs with a pool worker's thread budget and
    without library progress bars (`quiet_threads`): left alone, torch takes every core
    in-process and is many times slower than the pool (issue 22)."""

    def __init__(self, model_cache_size: int = 2):
        from pita.runtime.context import ModelCache

        self.models = ModelCache(model_cache_size)

    def __call__(self, task, cfg_dict: dict, run_dir: str, attempt: int):
        with quiet_threads(inprocess_threads(cfg_dict)):
            return run_task_here(
                task, cfg_dict, run_dir, attempt, models=self.models, reraise_interrupt=True
            )


def inprocess_threads(cfg_dict: dict) -> int:
    """The torch threads a pool worker would get for one task on this host: the CPU slot's
    `system.threads_per_worker`, or on a GPU (one task at a time here) the GPU budget."""
    from pita.core.resources import thread_budget
    from pita.core.schema import SystemConfig, settings

    per_worker = settings(SystemConfig, cfg_dict.get("system")).threads_per_worker
    kind = "cuda" if os.environ.get("CUDA_VISIBLE_DEVICES") else "cpu"
    return thread_budget(kind, 1, 1, per_worker)


QUIET_ENV = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


class quiet_threads:  # noqa: N801 - used as a context manager, like a function
    """While a task runs in this process: torch uses `threads` threads and transformers,
    datasets and the hub show no progress bars (as a pool worker: its environment and
    `Worker._setup_torch`). Every setting is restored on exit, so the caller's own torch
    work (a notebook, a debugger session) keeps its threads and bars."""

    def __init__(self, threads: int):
        self.threads = threads
        self._saved: list[tuple[Any, ...]] = []

    def __enter__(self) -> quiet_threads:
        for var, value in QUIET_ENV.items():
            self._saved.append(("env", var, os.environ.get(var)))
            os.environ[var] = value
        torch = _optional("torch")
        if torch is not None:
            self._saved.append(("torch", torch.get_num_threads()))
            torch.set_num_threads(self.threads)
        hf = _optional("transformers.utils.logging")
        if hf is not None:
            self._saved.append(("hf", hf.is_progress_bar_enabled(), hf.get_verbosity()))
            hf.disable_progress_bar()
            hf.set_verbosity_error()
        ds = _optional("datasets")
        if ds is not None and hasattr(ds, "disable_progress_bars"):
            self._saved.append(("datasets", ds.is_progress_bar_enabled()))
            ds.disable_progress_bars()
        return self

    def __exit__(self, *exc: object) -> None:
        for saved in reversed(self._saved):
            _restore(saved)
        self._saved.clear()


def _optional(module: str):
    """`module` if it imports, else None (a stage may not need it)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def _restore(saved: tuple[Any, ...]) -> None:
    what = saved[0]
    if what == "env":
        _, var, value = saved
        if value is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = value
    elif what == "torch":
        sys.modules["torch"].set_num_threads(saved[1])
    elif what == "hf":
        hf = sys.modules["transformers.utils.logging"]
        (hf.enable_progress_bar if saved[1] else hf.disable_progress_bar)()
        hf.set_verbosity(saved[2])
    elif what == "datasets" and saved[1]:
        sys.modules["datasets"].enable_progress_bars()


def _close(logger: logging.Logger) -> None:
    for h in logger.handlers:
        h.close()
    logger.handlers.clear()


def _warm_ranks(cfg_dict: dict) -> None:
    """A run that trains on gangs (`pita.core.parallel.run_trains_on_gangs`): start this
    worker's forkserver now, so it imports torch and transformers while other tasks run and
    a later gang's ranks fork warm (pita.training.ddp.warm_forkserver; a no-op once it runs)."""
    from pita.core.parallel import run_trains_on_gangs

    if run_trains_on_gangs(cfg_dict):
        from pita.training.ddp import warm_forkserver

        warm_forkserver()


class Worker:
    def __init__(
        self,
        channel: Channel,
        worker_id: int,
        heartbeat_s: float,
        cache_size: int,
        preimport: bool = True,
    ):
        from pita.runtime.context import ModelCache

        self.channel = channel
        self.preimport = preimport
        self.worker_id = worker_id
        self.heartbeat_s = heartbeat_s
        self.models = ModelCache(cache_size)
        self.current: str | None = None
        self.progress: str = ""
        self.device = "cpu"
        self.kind = os.environ.get("PITA_DEVICE_KIND", "cpu")
        self._torch_ready = False

    # ---- liveness ------------------------------------------------------------------------
    def heartbeat_loop(self, parent_pid: int) -> None:
        while True:
            time.sleep(self.heartbeat_s)
            if os.getppid() != parent_pid:
                os._exit(3)  # orchestrator gone: nothing to report to
            try:
                stats = memory_stats()
                stats["progress"] = self.progress
                self.channel.send(("heartbeat", self.current, stats))
            except (OSError, EOFError, BrokenPipeError):
                os._exit(3)

    def _set_progress(self, message: str) -> None:
        self.progress = message

    def _setup_torch(self) -> None:
        if self._torch_ready:
            return
        self._torch_ready = True
        threads = int(os.environ.get("PITA_TORCH_THREADS", "0") or 0)
        try:
            import torch
        except ImportError:
            return
        if threads > 0:
            torch.set_num_threads(threads)
        try:  # per-task logs say what happens; library progress bars only clutter them
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
            hf_logging.set_verbosity_error()
        except ImportError:
            pass
        if self.kind == "cuda" and torch.cuda.is_available():
            self.device = "cuda"

    # ---- one task ------------------------------------------------------------------------
    def run_task(self, task_dict: dict, cfg_dict: dict, run_dir: str, attempt: int) -> None:
        from pita.core.tasks import TaskSpec

        if self.preimport or self.kind == "cuda":
            # Without preimport on CPU / fake devices, a stage that needs torch imports it
            # itself and the environment configures it the same way (OMP_NUM_THREADS,
            # TRANSFORMERS_VERBOSITY, HF_HUB_DISABLE_PROGRESS_BARS: GPUManager.worker_env);
            # a stage that needs none (the test suite's sleep stages) never pays the ~3-5 s
            # import of torch and transformers in every worker.
            self._setup_torch()
        _warm_ranks(cfg_dict)
        task = TaskSpec.from_dict(task_dict)
        self.current, self.progress = task.id, ""
        self.channel.send(("started", task.id))
        try:
            ok, failure, message, result = execute_task(
                task,
                cfg_dict,
                run_dir,
                attempt,
                device=self.device,
                models=self.models,
                heartbeat=self._set_progress,
            )
        finally:
            self.current = None
        if ok:
            self.channel.send(("done", task.id, result, memory_stats()))
            return
        self.channel.send(("failed", task.id, failure, message, memory_stats()))
        if failure in RECYCLE_WORKER:
            raise SystemExit(4)  # a broken CUDA context is not reused: the pool recycles us

    def serve(self) -> None:
        while True:
            try:
                msg = self.channel.conn.recv()
            except (EOFError, OSError):
                return
            if msg[0] == "stop":
                return
            if msg[0] == "run":
                _, task_dict, cfg_dict, run_dir, attempt = msg
                self.run_task(task_dict, cfg_dict, run_dir, attempt)


WARM_FORKSERVER = "PITA_WARM_FORKSERVER"
# The stage modules the run's remaining tasks call, comma-separated (pita.experiment.run)
WARM_STAGES = "PITA_WARM_STAGES"


def warm_stage_imports(modules: str) -> list[str]:
    """Import each stage module in `modules` (comma-separated) and the names in its
    `WARM_IMPORTS` (e.g. TRL's GRPO trainer, 5-10 s), so a CUDA worker does it while it
    waits for its first task instead of on the run's critical path (the GPU run of
    experiment=goal_walk spent 9 s importing before GRPO's first step). Returns what it
    imported; an import that fails is left for the stage to report."""
    imported = []
    for name in filter(None, modules.split(",")):
        try:
            module = importlib.import_module(name)
            for heavy in getattr(module, "WARM_IMPORTS", ()):
                importlib.import_module(heavy)
                imported.append(heavy)
        except Exception:  # only a head start: the task imports it again and says why
            continue
    return imported


def main(argv: list[str] | None = None, authkey: bytes | None = None) -> int:
    """The worker's loop. `authkey`: the channel's key, read from stdin when not given (a
    fresh process gets it there; a forked one as an argument: pita/core/forked_worker.py)."""
    parser = argparse.ArgumentParser(description="pita worker (started by the orchestrator)")
    parser.add_argument("--address", required=True, help="the orchestrator's Unix socket path")
    parser.add_argument("--worker-id", type=int, required=True)
    parser.add_argument("--heartbeat-s", type=float, default=2.0)
    parser.add_argument("--cache-size", type=int, default=2)
    parser.add_argument("--preimport", action="store_true")
    args = parser.parse_args(argv)

    _die_with_parent()
    parent_pid = os.getppid()
    if authkey is None:
        authkey = bytes.fromhex(sys.stdin.readline().strip())
    conn = Client(args.address, family="AF_UNIX", authkey=authkey)
    channel = Channel(conn)
    worker = Worker(channel, args.worker_id, args.heartbeat_s, args.cache_size, args.preimport)
    channel.send(("hello", args.worker_id, os.getpid()))
    threading.Thread(target=worker.heartbeat_loop, args=(parent_pid,), daemon=True).start()
    if args.preimport:
        worker._setup_torch()
        try:
            import transformers  # noqa: F401  - overlap the slow import with planning
        except ImportError:
            pass
        if worker.kind == "cuda":
            # A GPU host has cores to spare while the GPU works; on CPU and fake devices the
            # workers' cores are the run's compute, and a worker that never runs GRPO would
            # pay for importing its trainer.
            warm_stage_imports(os.environ.get(WARM_STAGES, ""))
        if os.environ.get(WARM_FORKSERVER) == "1":  # the run has elastic training tasks
            from pita.training.ddp import warm_forkserver

            try:  # a gang hosted here later forks its ranks from it (pita/core/elastic.py)
                warm_forkserver()
            except Exception:  # only a head start: the first gang starts it otherwise
                pass
    worker.serve()
    return 0


def leave(code: int) -> None:
    """Like multiprocessing's own children: flush, then leave without the interpreter's
    teardown of torch and transformers (1.5-2 s a worker on a busy 2-core machine, and
    every run's shutdown waits for it). Task outputs are committed and trackers closed
    per task; a recycled worker (SystemExit above) still exits the ordinary way."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    leave(main())
