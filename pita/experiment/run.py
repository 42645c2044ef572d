"""`run(cfg, run_dir) -> exit code`: validate, plan, place, execute, report.

Components are built in dependency order: config validation (nothing has started yet, so
a ConfigError costs nothing) -> devices (NVML, no CUDA context) -> plan (may refuse a task
no device can hold) -> run folder files (plan.json, journal) -> worker pool -> monitor ->
DAG runner -> report. Exit codes: 0 all tasks succeeded, 1 some failed (the rest still
ran), 2 bad config, 130 interrupted (resumable).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pita.core.dag import Plan
from pita.core.errors import ConfigError, ExecutorBroken
from pita.core.executor import Executor
from pita.core.forked_worker import GANG_STAGES
from pita.core.gpu_manager import GPUManager
from pita.core.host_share import HostShare, outside_load
from pita.core.journal import RUN_FILE_ERRNOS, Journal, RunFileError, read_events, run_file_error
from pita.core.parallel import Strategy
from pita.core.parallel_executor import DagRunner, DeviceState, Scheduler, simulate
from pita.core.parallel_generation import ParallelDataGenerator
from pita.core.paths import Artifact, RunPaths, TaskPaths, atomic_write_json
from pita.core.progress import Eta, TaskDurations, format_duration
from pita.core.resume import completed_tasks, remove_stale_tmp
from pita.core.run_lock import RunLock
from pita.core.safe_files import check_folder, share_with_group
from pita.experiment.config import validate
from pita.experiment.plan import check_resources, plan_experiment
from pita.runtime.worker import WARM_FORKSERVER, WARM_STAGES

log = logging.getLogger("pita")

EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 130  # 2 (bad config): cli.py
INTERRUPTED = "interrupted"  # why a session stopped early (else an ExecutorBroken message)


def make_gpu_manager(cfg: DictConfig) -> GPUManager:
    if cfg.executor.backend == "ray":  # slots = the Ray cluster's GPUs (or CPUs); Ray pins them
        from pita.core.ray_executor import RayExecutor, ray_devices_spec

        ray_exec = RayExecutor(cfg.executor)
        kind, n = ray_exec.slots()
        sizes = ray_exec.gpu_memory_mb() if kind == "gpu" else []  # NVML on each node: real memory
        gpu = GPUManager(ray_devices_spec(kind, n, sizes), cpu_workers=max(1, n))
        gpu.largest_gang = ray_exec.largest_node()  # a gang's ranks may span nodes
        return gpu
    spec = cfg.system.devices
    if cfg.system.gpu_mode == "cpu":
        spec = "cpu"
    gpu = GPUManager(
        spec, cpu_workers=cfg.executor.cpu_workers, threads_per_worker=cfg.system.threads_per_worker
    )
    if cfg.system.gpu_mode == "single_gpu" and gpu.is_gpu:
        gpu.devices = gpu.devices[:1]
    return gpu


def make_executor(cfg: DictConfig, gpu: GPUManager, run_dir: Path, pending: int = 1) -> Executor:
    """The executor of `executor.backend`: worker processes (local), this process
    (inprocess, or system.use_parallel_execution=false), or Ray tasks. `pending`: the
    tasks left to run (none: the local pool starts no forkserver, `forks_workers`)."""
    if cfg.executor.backend == "ray":
        from pita.core.ray_executor import RayExecutor
        from pita.runtime.ray_slot import SlotWorker
        from pita.runtime.worker import run_task_here

        return RayExecutor(cfg.executor, run_task=run_task_here, slot_worker=SlotWorker)
    if cfg.executor.backend == "inprocess" or not cfg.system.use_parallel_execution:
        from pita.core.inprocess import InProcessExecutor
        from pita.runtime.worker import InProcessRunner

        runner = InProcessRunner(cfg.executor.model_cache_size)
        return InProcessExecutor(runner, on_shutdown=runner.models.clear)
    from pita.core.worker_pool import WorkerPool

    return WorkerPool.from_config(
        gpu, cfg.executor, log_dir=RunPaths(run_dir).workers, pending=pending
    )


def make_scheduler(cfg: DictConfig, gpu: GPUManager) -> Scheduler:
    from pita.core.resources import max_tasks_per_device

    states = [DeviceState(d.index, d.total_mb, d.free_mb) for d in gpu.devices]
    value = cfg.executor.max_tasks_per_gpu
    if cfg.executor.backend == "ray" and value == "auto":
        value = 1  # Ray places by whole GPUs (num_gpus=1): it would queue a second task on a slot
    cap = max_tasks_per_device(value, gpu.kind, len(gpu.devices))
    return Scheduler(
        states,
        max_tasks_per_device=cap,
        simulated_memory=gpu.kind != "cuda",
        host=host_share(cfg, gpu, cap),
    )


def host_share(cfg: DictConfig, gpu: GPUManager, tasks_per_device: int) -> HostShare | None:
    """The cores the run's tasks share when they compute on this host's CPU (`fake:` devices,
    CPU slots), each rank with its workers' torch threads, and the other processes' load
    now; None on GPUs (pita/core/host_share.py)."""
    from pita.core.resources import host_cores, thread_budget

    kind = compute_kind(cfg, gpu)
    if kind == "cuda":
        return None
    n = len(gpu.devices)
    threads = thread_budget(kind, n, tasks_per_device, int(cfg.system.threads_per_worker))
    return HostShare(float(host_cores()), threads, outside_load(0.0))


def compute_kind(cfg: DictConfig, gpu: GPUManager) -> str:
    """What the workers compute on: "cuda", or "fake" / "cpu" (the CPU). A Ray cluster's GPU
    slots are listed as `fake:` sizes but are real GPUs (its nodes' torch has CUDA:
    `RayExecutor.gpu_memory_mb` checks)."""
    if cfg.executor.backend == "ray" and gpu.kind == "fake":
        return "cuda"
    return gpu.kind


def resolve_strategy(cfg: DictConfig, gpu: GPUManager) -> tuple[DictConfig, str | None]:
    """`cfg` with `training.parallel_strategy=auto` resolved for these devices (a copy; cfg
    itself when the key is explicit) and the run log's line (pita/experiment/strategy.py)."""
    from pita.experiment.strategy import resolved_config

    return resolved_config(cfg, compute_kind(cfg, gpu), len(gpu.devices))


def build_plan(cfg: DictConfig, gpu: GPUManager) -> Plan:
    return plan_experiment(
        cfg,
        len(gpu.devices),
        device_mb=[d.total_mb for d in gpu.devices],
        distribute=ParallelDataGenerator(gpu).shard_fractions,
        device_kind=compute_kind(cfg, gpu),
        largest_gang=gpu.largest_gang,
    )


def task_durations(cfg: DictConfig, gpu: GPUManager) -> TaskDurations:
    """Expected task durations: earlier runs' recorded ones (pita/experiment/durations.py),
    exact or of the same kind scaled by size, then work units; the run adds its own
    finished tasks as they come."""
    from pita.experiment.durations import duration_key, load_history

    key, history = duration_key(cfg, gpu.kind), load_history()
    return TaskDurations(history.exact, key, lambda t: history.scaled(t, key))


def print_dry_run(plan: Plan, cfg: DictConfig, gpu: GPUManager) -> None:
    scheduler = make_scheduler(cfg, gpu)
    durations = task_durations(cfg, gpu)
    sized = _dry_run_sizing(plan, cfg, gpu, durations)
    placement, makespan = (
        (sized["placement"], sized["makespan_s"]) if sized else simulate(plan, scheduler)
    )
    print(
        f"Plan: {len(plan.tasks)} tasks on {len(gpu.devices)} device(s) "
        f"({gpu.kind}, up to {scheduler.max_tasks} task(s) per device while memory allows); "
        f"dry run, nothing started."
    )
    for line in gpu.describe():
        print("  " + line)
    print(
        f"{'task':58s} {'device':9s} {'gang':8s} {'mem GB':>7s} {'GB/rank':>7s} {'prio':>6s}  "
        f"{'estimate from':40s} depends on"
    )
    for t in plan.tasks.values():
        devs = "+".join(str(d) for d in placement.get(t.id, [])) or "-"
        deps = ", ".join(t.deps) if len(t.deps) <= 2 else f"{t.deps[0]} (+{len(t.deps) - 1})"
        gang = f"{t.strategy}x{t.gpus}" if t.strategy is not Strategy.NONE else str(t.gpus)
        print(
            f"{t.id:58s} {devs:9s} {gang:8s} {t.mem_mb / 1024:7.2f} "
            f"{t.mem_mb / max(1, t.gpus) / 1024:7.2f} {t.priority:6.1f}  "
            f"{t.mem_source[:40]:40s} {deps}"
        )
    if sized:
        print(
            f"Elastic training tasks (executor.max_ranks_per_task="
            f"{cfg.executor.max_ranks_per_task}), ranks chosen at dispatch by simulating the "
            f"rest of the plan:"
        )
        for t in plan.tasks.values():
            if t.elastic:
                print(f"  {t.id:58s} k={t.gpus}")
        print(makespan_line(sized, no_history(plan, durations)))
    for line in gang_notes(plan):
        print(line)
    eta = Eta(plan.tasks, set(), durations, make_scheduler(cfg, gpu))
    if sized:  # the sized simulation is the ETA's (the same durations at the chosen ranks)
        from pita.experiment.sizing import wire_eta

        seconds, source = sized["makespan_s"], wire_eta(eta, sized["sizer"]).source()
    else:
        seconds, source = eta.remaining({}, time.time())
    print(wall_time_line(seconds, source, plan, durations))
    host = eta.scheduler.host
    if host is not None and host.external >= 0.5:  # the estimate counts them: say so
        print(
            f"The host's {host.cores:g} cores are shared with {host.external:.1f} busy threads "
            f"of other processes now (runnable threads); the estimate counts them."
        )
    print(history_line(plan, durations))


def no_history(plan: Plan, durations: TaskDurations) -> bool:
    """True when no task of `plan` has a measured duration (its own or its kind's)."""
    return bool(plan.tasks) and all(durations.history(t) is None for t in plan.tasks.values())


def makespan_line(sized: dict[str, Any], blind: bool) -> str:
    """The sized dry run's makespans; without any measured duration only their ratio means
    something (work units in seconds were 40x short of a first GPU run, issue 45)."""
    if blind:
        ratio = sized["makespan_s"] / max(1e-9, sized["rigid_makespan_s"])
        return (
            f"Predicted makespan: unknown without measured durations; on work units these ranks "
            f"take {ratio:.0%} of the least ranks' ({sized['sized']} tasks sized in "
            f"{sized['sizing_s']:.2f} s)."
        )
    return (
        f"Predicted makespan: ~{format_duration(sized['makespan_s'])} with these ranks, "
        f"~{format_duration(sized['rigid_makespan_s'])} with the least ranks each "
        f"({sized['sized']} tasks sized in {sized['sizing_s']:.2f} s)."
    )


def wall_time_line(seconds: float, source: str, plan: Plan, durations: TaskDurations) -> str:
    """The dry run's estimate; none when no task has a measured duration (its own or its
    kind's): work units only order the tasks, and in seconds they were 40x short of a first
    run on a GPU (33 s for a run whose pretrain alone took 22 min, issue 45)."""
    if no_history(plan, durations):
        return (
            f"Estimated wall time: unknown until tasks have run here: none of the "
            f"{len(plan.tasks)} tasks has a measured duration on these devices yet (this run "
            f"records them in $PITA_CACHE_DIR/task_durations.json; its live ETA learns from "
            f"its own finished tasks)."
        )
    return f"Estimated wall time: ~{format_duration(seconds)} ({source})."


def history_line(plan: Plan, durations: TaskDurations) -> str:
    """Which tasks the estimate has no measured duration for (their own or their kind's,
    scaled by size), so a reader knows how far to trust it."""
    blind = [t.id for t in plan.tasks.values() if durations.history(t) is None]
    if not blind:
        return "Every task's estimate comes from a measured duration (its own or its kind's)."
    shown = ", ".join(blind[:6]) + (f" (+{len(blind) - 6} more)" if len(blind) > 6 else "")
    return (
        f"No history for {len(blind)} of {len(plan.tasks)} task(s), estimated from work "
        f"units: {shown}."
    )


def gang_notes(plan: Plan) -> list[str]:
    """One line per TRL task that runs DDP under training.parallel_strategy=fsdp (CPU): its
    gang asked FSDP and runs DDP (pita/experiment/gangs.py `planned_gang`)."""
    from pita.algos.trl_common import cpu_fsdp_note, fsdp_runs_ddp

    return [cpu_fsdp_note(t.id) for t in plan.tasks.values() if fsdp_runs_ddp(t.gang)]


def _dry_run_sizing(
    plan: Plan, cfg: DictConfig, gpu: GPUManager, durations: TaskDurations
) -> dict | None:
    """The dry run's simulation with elastic tasks sized at their simulated dispatch."""
    if not any(t.elastic for t in plan.tasks.values()):
        return None
    from pita.experiment.sizing import dry_run_sizing, make_sizer

    scheduler = make_scheduler(cfg, gpu)
    sizer = make_sizer(cfg, plan.tasks, durations, scheduler)
    if not sizer.enabled:
        return None
    return {**dry_run_sizing(plan, scheduler, sizer), "sizer": sizer}


def lock_run_folder(cfg: DictConfig, run_dir: Path, share: bool = False) -> RunLock:
    """Check the run folder (yours, nobody else can write it, its output folders writable)
    and take its lock, before anything is written in it. The command line calls this
    before Hydra writes `.hydra/` (`share=True`); `run()` calls it again (nested in the
    same process)."""
    paths = RunPaths(run_dir)
    trust_group = bool(cfg.system.trust_group)
    share_with_group(trust_group)  # the lock is the group's too (0660), its files readable
    for folder in (run_dir, paths.tasks):  # a folder others can write steers what resume trusts
        check_folder(folder, trust_group)
    for folder in (paths.logs, paths.results, paths.workers):  # fail now, not after the run
        check_writable(folder)
    run_dir.mkdir(parents=True, exist_ok=True)
    return RunLock(run_dir).acquire(share=share)


def check_writable(folder: Path) -> None:
    """A folder pita will write into exists as a writable folder, or can be created."""
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        raise ConfigError(f"{folder} is not a folder; move it away")
    if folder.is_dir() and not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"{folder} is not writable; fix its permissions (chmod u+w)")


def check_plan_fits(plan: Plan, gpu: GPUManager, cfg: DictConfig) -> None:
    """A resumed run's saved plan onto (maybe other) devices: refuse a task none can hold."""
    try:
        check_resources(plan, len(gpu.devices), [d.total_mb for d in gpu.devices], gpu.largest_gang)
    except ConfigError as exc:
        raise ConfigError(
            f"system.devices={cfg.system.devices!r} on resume ({len(gpu.devices)} device(s)): "
            f"{exc.messages[0]}"
        ) from None


def warn_stage_overrides(cfg: DictConfig, plan: Plan, done: AbstractSet[str] = frozenset()) -> None:
    """Config is code: each `executor.stage_overrides` entry names a function that the
    workers import and run. Say so in run.log, one WARNING per entry that some task still
    to run uses (a resumed run whose overridden tasks are all done runs none of them)."""
    for algo, stages in (cfg.executor.stage_overrides or {}).items():
        for stage, target in stages.items():
            pending = [t for t in plan.tasks.values() if t.fn == target and t.id not in done]
            if not pending:
                continue
            log.warning(
                "executor.stage_overrides.%s.%s=%s: config is code, workers will import and run "
                "this function instead of the registered stage (%d task(s))",
                algo,
                stage,
                target,
                len(pending),
            )


def run(cfg: DictConfig, run_dir: Path | str, *, resumed: bool = False) -> int:
    """Run the experiment `cfg` in `run_dir`; returns the process exit code."""
    from pita.experiment.preflight import absolutize_paths

    absolutized = absolutize_paths(cfg)  # workers run from the project root, not the user's folder
    recorded = _record_hydra_dataset_file(cfg)  # kept in the saved config for a resume
    validate(cfg)
    from pita.experiment.config import path_secret_error

    secret = path_secret_error(run_dir)  # as the command line's check: a job of a launcher too
    if secret:
        raise ConfigError(secret)
    share_with_group(bool(cfg.system.trust_group))  # every control file read
    run_dir = Path(run_dir)
    paths = RunPaths(run_dir)
    gpu = make_gpu_manager(cfg)
    cfg, strategy_line = resolve_strategy(cfg, gpu)  # once per run, before anything plans
    if strategy_line:
        log.info(strategy_line)
    plan = Plan.load(paths.plan) if resumed else build_plan(cfg, gpu)
    change = resume_change(cfg, run_dir, gpu, plan) if resumed else None
    if change is not None:
        plan = change.plan
    if resumed:
        check_plan_fits(plan, gpu, cfg)
    from pita.core.paths import path_length_errors

    too_long = path_length_errors(run_dir, plan.tasks)  # ENAMETOOLONG mid-run otherwise
    if too_long:
        raise ConfigError(too_long)
    if cfg.dry_run:
        warn_stage_overrides(cfg, plan)
        print_dry_run(plan, cfg, gpu)
        if resumed:
            print_resume_dry_run(plan, run_dir, change)
        return EXIT_OK

    with lock_run_folder(cfg, run_dir):  # one orchestrator per run folder (a second exits 2)
        try:
            if change is not None:
                from pita.experiment.resume_fix import apply_change

                apply_change(cfg, run_dir, change)
            from pita.experiment.code_keys import record

            record(cfg, run_dir)  # the code-bearing values this user runs with (their choice)
            rewrite = bool(absolutized) or recorded or strategy_line is not None  # saved config
            return _run_locked(cfg, run_dir, paths, gpu, plan, resumed, rewrite)
        except RunFileError as exc:  # the journal cannot be opened: immutable, read-only
            return run_files_failed(run_dir, exc)
        except OSError as exc:  # plan.json, run_info.json on a full disk, before any task
            if exc.errno not in RUN_FILE_ERRNOS:
                raise
            return run_files_failed(run_dir, exc)


def _record_hydra_dataset_file(cfg: DictConfig) -> bool:
    """Under `@hydra.main`: record the selected dataset file (dataset_choice.py)."""
    from hydra.core.hydra_config import HydraConfig

    from pita.experiment.dataset_choice import record_dataset_file

    if not HydraConfig.initialized():
        return False
    return record_dataset_file(cfg, HydraConfig.get().runtime.choices)


def run_files_failed(run_dir: Path, exc: BaseException, journal: Journal | None = None) -> int:
    """The run's own files cannot be written (a full disk, an immutable journal or task
    folder): one line naming the file and the cause, and the command that finishes the
    run once the cause is gone. Finished tasks are kept (their folders prove it)."""
    if isinstance(exc, OSError):
        exc = run_file_error(run_dir, exc)
    if journal is not None:
        try:
            journal.append("run_failed", reason=str(exc))
        except RunFileError:
            pass  # the journal itself is what failed
        journal.close()
    log.error(
        "Run stopped: %s. Finished tasks are kept; once that is fixed, finish the run with: %s",
        exc,
        resume_command(run_dir),
    )
    return EXIT_FAILED


def resume_change(cfg: DictConfig, run_dir: Path, gpu: GPUManager, saved: Plan):
    """What a resume's other values change (pita/experiment/resume_fix.py), or None."""
    from pita.core.schema import resume_safe  # affects="place" | "record": never a result
    from pita.experiment.resume_fix import plan_change

    return plan_change(cfg, run_dir, saved, lambda c: build_plan(c, gpu), resume_safe)


def print_resume_dry_run(plan: Plan, run_dir: Path, change) -> None:
    """Which tasks a resume will run, and why (a changed key, a failure, an input)."""
    from pita.core.resume import resume_reasons
    from pita.experiment.resume_fix import print_resume_plan

    print_resume_plan(plan, resume_reasons(plan, run_dir, change and change.touched), change)


@dataclass
class Session:
    """What one run session holds between its start and its end (the steps of `_run_locked`)."""

    journal: Journal
    executor: Executor
    monitor: Any
    durations: TaskDurations
    progress: Any
    runner: DagRunner
    one_rank: Any = None  # (task, wall s, k) -> its one-rank seconds (the speedup curves)
    t0: float = field(default_factory=time.time)


def _run_locked(
    cfg: DictConfig,
    run_dir: Path,
    paths: RunPaths,
    gpu: GPUManager,
    plan: Plan,
    resumed: bool,
    rewrite_config: bool,
) -> int:
    """One run session in a locked folder: write what the run starts from, start the pool,
    the monitor and the DAG runner, run to the end (or a stop), then record and report."""
    _write_run_files(cfg, paths, gpu, plan, resumed, rewrite_config)
    done = completed_tasks(plan, run_dir) if resumed else set()
    journal = Journal(paths.journal)
    from pita.experiment.resume_fix import config_sha256

    journal.append(  # the saved config's hash: a resume names a file edited since
        "run_resumed" if resumed else "run_started",
        tasks=len(plan.tasks),
        already_done=len(done),
        config_sha256=config_sha256(run_dir),
    )
    _log_start(cfg, run_dir, gpu, plan, done, resumed)
    session = _start_session(cfg, paths, gpu, plan, done, journal)
    stop, summary = _execute(session)
    events = _final_events(paths)  # the journal, read once at the run's end
    _record_durations(run_dir, plan, session, events)
    end = {
        "done": len(session.runner.done),
        "failed": len(summary.failed),
        "skipped": len(summary.skipped),
        "wall_s": round(time.time() - session.t0, 2),
    }
    if isinstance(stop, RunFileError):
        return run_files_failed(run_dir, stop, journal)
    if stop is not None:
        return _stopped(journal, run_dir, stop, end)
    # run_finished is journaled after the report: a report killed midway leaves a run that
    # resume_from=auto finishes (it redoes no task, it writes the report)
    reported = _report(cfg, plan, run_dir)
    _time_report(run_dir, plan, [d.label for d in gpu.devices], events, cfg.executor.timeline_plot)
    journal.append("run_finished", **end, report=reported)
    journal.close()
    return _final_lines(run_dir, paths, plan, session, summary, reported)


def _final_events(paths: RunPaths) -> list[dict]:
    """The run's journal events for its end (none when the journal cannot be read: the
    durations and the time report are then skipped, the run's end says why)."""
    try:
        return read_events(paths.journal)
    except OSError as exc:
        log.warning("cannot read the journal %s: %s", paths.journal, exc)
        return []


def _write_run_files(
    cfg: DictConfig, paths: RunPaths, gpu: GPUManager, plan: Plan, resumed: bool, rewrite: bool
) -> None:
    """plan.json and the saved config of a new run (Hydra writes the config; tests get it
    here, and a config whose paths were absolutized or whose `auto` strategy was resolved
    is written again: a resume reads what the run ran with), stale temporary folders of a
    resumed one gone, and run_info.json (git commit, packages, devices, strategy, command)."""
    from pita.experiment import run_info

    if resumed:
        remove_stale_tmp(paths.root)
    else:
        atomic_write_json(paths.plan, plan.to_json())
        if rewrite or not paths.saved_config.exists():
            paths.saved_config.parent.mkdir(parents=True, exist_ok=True)
            paths.saved_config.write_text(OmegaConf.to_yaml(cfg, resolve=True))
    run_info.write(paths.root, gpu, resumed=resumed, strategy=str(cfg.training.parallel_strategy))


def _log_start(
    cfg: DictConfig,
    run_dir: Path,
    gpu: GPUManager,
    plan: Plan,
    done: AbstractSet[str],
    resumed: bool,
) -> None:
    log.info("Run folder: %s", run_dir)
    warn_stage_overrides(cfg, plan, done)
    log.info("Devices (%s): %d", gpu.kind, len(gpu.devices))
    for line in gpu.describe():
        log.info("  %s", line)
    log.info(
        "Plan: %d tasks, %d already done%s",
        len(plan.tasks),
        len(done),
        " (resumed)" if resumed else "",
    )


def stage_modules(plan: Plan, done: set[str], gangs_only: bool = False) -> str:
    """The modules of the stage functions that the tasks still to run call, comma-separated
    (pita.runtime.worker.warm_stage_imports reads it); `gangs_only`: of the tasks that may
    run on a gang (elastic, or more than one device: pita.core.forked_worker.gang_preload)."""
    return ",".join(
        sorted(
            {
                t.fn.split(":")[0]
                for tid, t in plan.tasks.items()
                if tid not in done and (not gangs_only or t.elastic or t.gpus > 1)
            }
        )
    )


def _start_session(
    cfg: DictConfig, paths: RunPaths, gpu: GPUManager, plan: Plan, done: set[str], journal: Journal
) -> Session:
    """Workers (warmed up for the tasks still to run), the scheduler, the monitor, the ETA
    (earlier runs' durations and this run's finished tasks) and the DAG runner."""
    from pita.core.monitor import Monitor
    from pita.core.progress import Progress
    from pita.experiment.durations import work_walls
    from pita.experiment.estimates import PeakEstimator, peaks_cache_path

    run_dir = paths.root
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(cfg_dict, dict)
    executor = make_executor(cfg, gpu, run_dir, pending=len(plan.tasks) - len(done))
    if hasattr(executor, "extra_env"):  # the local pool's workers
        # CUDA workers import these stages' libraries while they wait for a task
        executor.extra_env[WARM_STAGES] = stage_modules(plan, done)
        if any(t.elastic for t in plan.tasks.values()):  # gangs fork ranks from warm workers
            executor.extra_env[WARM_FORKSERVER] = "1"
        # a gang's ranks fork with their stage's trainer imported (TRL for TRL stages)
        executor.extra_env[GANG_STAGES] = stage_modules(plan, done, gangs_only=True)
    if hasattr(executor, "prepare"):  # Ray: slots reserved, warm actors, shared storage checked
        executor.prepare(run_dir, stage_modules(plan, done), bool(cfg.executor.preimport))
    executor.warm_up([(d.index,) for d in gpu.devices][: len(plan.tasks) - len(done)])
    scheduler = make_scheduler(cfg, gpu)
    if hasattr(executor, "nodes_of"):  # Ray: a gang goes on one node when one has room
        scheduler.node_of = dict(enumerate(executor.nodes_of(range(len(gpu.devices)))))
    monitor = Monitor(
        gpu,
        executor,
        paths.gpu_monitor,
        cfg.executor.monitor_interval_s,
        reservations=lambda: [sum(d.running.values()) for d in scheduler.devices],
    ).start()
    durations = task_durations(cfg, gpu)
    if done:  # a resumed run's earlier sessions: this run's durations
        for tid, wall in work_walls(read_events(paths.journal), scheduler.host).items():
            if tid in done:
                durations.observe(plan.tasks[tid], wall)
    from pita.experiment.sizing import make_sizer, wire_eta

    sizer = make_sizer(cfg, plan.tasks, durations, scheduler)
    progress = Progress(
        len(plan.tasks),
        device_labels(gpu, executor),
        len(done),
        worker_info=executor.workers,
        live=None if cfg.executor.progress else False,
        eta=wire_eta(Eta(plan.tasks, done, durations, scheduler), sizer),
    )
    estimator = PeakEstimator(cfg, peaks_cache_path() if gpu.kind == "cuda" else None)
    estimator.learn_from_run(run_dir, plan.tasks, done)
    runner = DagRunner(
        plan,
        executor,
        scheduler,
        cfg_dict=cfg_dict,
        run_dir=str(run_dir),
        journal=journal,
        max_retries=cfg.executor.max_retries,
        already_done=done,
        on_event=progress.event,
        refresh_memory=lambda: _measured_memory(gpu, executor),
        estimator=estimator,
        sizer=sizer,
        grower=_grower(cfg, sizer, run_dir, executor),
    )
    log.info(
        "Packing: up to %d task(s) per device while their memory estimates fit (executor.max_tasks_per_gpu=%s)",
        scheduler.max_tasks,
        cfg.executor.max_tasks_per_gpu,
    )
    return Session(journal, executor, monitor, durations, progress, runner, sizer.curves.one_rank)


def device_labels(gpu: GPUManager, executor: Any) -> list[str]:
    """The live table's device names; on Ray each says its node (`cpu2 @ 9bd6acfc`)."""
    labels = [d.label for d in gpu.devices]
    nodes_of = getattr(executor, "nodes_of", None)
    if nodes_of is None:
        return labels
    return [f"{label} @ {node[:8]}" for label, node in zip(labels, nodes_of(range(len(labels))))]


def _grower(cfg: DictConfig, sizer: Any, run_dir: Path, executor: Any) -> Any:
    """Growth at a checkpoint (pita/core/growth.py) where tasks are sized at dispatch and
    `executor.grow_idle_s` > 0; None otherwise."""
    idle_s = float(cfg.executor.grow_idle_s)
    if idle_s <= 0 or not sizer.enabled:
        return None
    from pita.core.growth import Grower

    def progress() -> dict[str, str]:
        return {
            w["task"]: str(w.get("progress") or "") for w in executor.workers() if w.get("task")
        }

    return Grower.for_sizer(sizer, run_dir, progress, idle_s)


def _execute(session: Session) -> tuple[str | RunFileError | None, Any]:
    """Run the DAG to its end; (why it stopped early: "interrupted", a lost executor's
    message or the run's own files failing; None when it ran to the end, summary). SIGTERM
    counts as Ctrl-C. The monitor and the workers are stopped whatever happened (killed on
    a stop)."""
    stop: str | RunFileError | None = None
    previous_sigterm = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        with session.progress:
            summary = session.runner.run()
    except KeyboardInterrupt:
        stop, summary = INTERRUPTED, session.runner.summary
    except ExecutorBroken as exc:  # a pool thread stopped: fail now, loudly, not wait forever
        stop, summary = str(exc), session.runner.summary
    except RunFileError as exc:  # a full disk, an immutable journal or task folder: stop now
        stop, summary = exc, session.runner.summary
    finally:
        signal.signal(signal.SIGTERM, previous_sigterm)
        session.monitor.stop()
        if stop != INTERRUPTED:
            with contextlib.suppress(Exception):
                session.monitor.sample()  # a last summary while the workers still report
        session.executor.shutdown(kill=stop is not None)
    return stop, summary


def _stopped(journal: Journal, run_dir: Path, stop: str, end: dict[str, Any]) -> int:
    """Journal an interrupted or failed run and say how to resume it."""
    if stop == INTERRUPTED:
        journal.append("run_interrupted", **end)
        journal.close()
        log.warning(
            "Interrupted: workers stopped, journal flushed. Resume with:\n  %s",
            resume_command(run_dir),
        )
        return EXIT_INTERRUPTED
    journal.append("run_failed", reason=stop, done=end["done"], wall_s=end["wall_s"])
    journal.close()
    log.error(
        "Run stopped: %s. Finished tasks are kept; resume with:\n  %s",
        stop,
        resume_command(run_dir),
    )
    return EXIT_FAILED


def _final_lines(
    run_dir: Path, paths: RunPaths, plan: Plan, session: Session, summary: Any, reported: bool
) -> int:
    """The run's exit code and last lines: a report that could not be written, the failed
    tasks with their logs' last lines, or where the results are."""
    if not reported:
        log.error(
            "The tasks are kept; fix the cause, then write the report with: %s",
            resume_command(run_dir),
        )
        return EXIT_FAILED
    if summary.failed or summary.skipped:
        log.error(
            "%d task(s) failed, %d skipped because a dependency failed:",
            len(summary.failed),
            len(summary.skipped),
        )
        for tid, why in summary.failed.items():
            log.error("  %s: %s", tid, why)
            attempt = session.runner.attempts.get(tid, 1)
            tail = TaskPaths(run_dir, tid).failed(attempt) / Artifact.LOG
            if tail.is_file():
                log.error("    log: %s (%s)", tail, last_line(tail.read_text(errors="replace")))
        log.error(
            "Fix the cause, then finish the run with: %s (add key=value to change a setting: "
            "the tasks it touches run again, the rest is kept; add dry_run=true to list them)",
            resume_command(run_dir),
        )
        _end_lines(paths)
        return EXIT_FAILED
    log.info("All %d tasks done in %.1fs.", len(plan.tasks), time.time() - session.t0)
    _end_lines(paths)
    return EXIT_OK


def _measured_memory(gpu: GPUManager, executor) -> list[tuple[int, int]]:
    """Per device: NVML free MB, and MB held by this run's worker processes."""
    ours = set(executor.worker_pids())
    return [
        (d.free_mb, sum(p["used_mb"] for p in d.processes if p["pid"] in ours))
        for d in gpu.refresh()
    ]


def _raise_interrupt(_signum, _frame):  # SIGTERM behaves like Ctrl-C: stop, flush, exit 130
    raise KeyboardInterrupt


def _report(cfg: DictConfig, plan: Plan, run_dir: Path) -> bool:
    """Results table and plots from the evaluate tasks (pita/results/report.py).
    False (one ERROR line, the traceback at DEBUG in run.log) when it could not be
    written: the run then exits 1, never 0 with an old or missing summary."""
    from pita.results.report import write_report

    try:
        write_report(cfg, plan, run_dir)
    except Exception as exc:
        log.debug("report traceback", exc_info=True)
        log.error("writing the report failed: %s: %s", type(exc).__name__, exc)
        return False
    return True


def last_line(text: str) -> str:
    """`last line: <the last non-empty line>` of a log, or that the log was empty."""
    lines = [line for line in text.splitlines() if line.strip()]
    return f"last line: {lines[-1].strip()}" if lines else "the log is empty"


def user_command(argv0: str | None = None) -> str:
    """How the user started pita, for the hints they copy: `pita`, `python -m pita` or
    `python run_parallel.py` (the command line as typed: PITA_COMMAND, else sys.argv)."""
    if argv0 is None:
        try:
            argv0 = str(json.loads(os.environ["PITA_COMMAND"])[0])
        except (KeyError, ValueError, TypeError, IndexError):
            argv0 = sys.argv[0] if sys.argv else ""
    path = Path(argv0)
    if path.name == "__main__.py" and path.parent.name == "pita":
        return "python -m pita"
    if path.name in ("pita", "pita.exe"):
        return "pita"
    return "python run_parallel.py"


def resume_command(run_dir: Path | str) -> str:
    return f"{user_command()} resume_from={run_dir}"


def _record_durations(run_dir: Path, plan: Plan, session: Session, events: list[dict]) -> None:
    """Keep this run's task durations for the next run's ETA and speedup curves (never
    fails the run)."""
    from pita.experiment.durations import record_durations

    key = session.durations.key
    try:
        record_durations(
            run_dir,
            plan.tasks,
            key,
            events=events,
            one_rank=session.one_rank,
            share=session.runner.scheduler.host,
        )
    except Exception as exc:
        log.debug("recording task durations failed: %s", exc, exc_info=True)


def _time_report(
    run_dir: Path, plan: Plan, labels: list[str], events: list[dict], plot: bool
) -> None:
    """results/timeline.png (`plot`) and the "where the time went" table, also in run.log."""
    from pita.results.timeline import write_time_report

    try:
        table = write_time_report(run_dir, plan.tasks, labels, events=events, plot=plot)
    except Exception as exc:
        log.debug("time report traceback", exc_info=True)
        log.warning("writing the time report failed: %s: %s", type(exc).__name__, exc)
        return
    if table:
        log.info("%s", table)


def _end_lines(paths: RunPaths) -> None:
    """The run's last lines: where the results and plots are, and what the columns mean."""
    from pita.results.report import legend

    results = paths.results
    if not (results / "summary.md").is_file():
        return
    plots = sorted(p.name for p in paths.plots.glob("*.png")) if paths.plots.is_dir() else []
    log.info("Summary: %s (csv: summary.csv)", results / "summary.md")
    if plots:
        log.info("Plots: %s (%s)", paths.plots, ", ".join(plots))
    if (results / "timeline.png").is_file():
        log.info("Where the time went: %s, %s", results / "time.md", results / "timeline.png")
    log.info("%s", legend())
