"""`run(cfg, run_dir) -> exit code`: validate, plan, place, execute, report.

Components are built in dependency order: config validation (nothing has started yet, so
a ConfigError costs nothing) -> devices (NVML, no CUDA context) -> plan (may refuse a task
no device can hold) -> run folder files (plan.json, journal) -> worker pool -> monitor ->
DAG runner -> report. Exit codes: 0 all tasks succeeded, 1 some failed (the rest still
ran), 2 bad config, 130 interrupted (resumable).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from collections.abc import Set as AbstractSet
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from pita.core.dag import Plan
from pita.core.errors import ConfigError, ExecutorBroken
from pita.core.executor import Executor
from pita.core.gpu_manager import GPUManager
from pita.core.journal import Journal
from pita.core.parallel_executor import DagRunner, DeviceState, Scheduler, simulate
from pita.core.parallel_generation import ParallelDataGenerator
from pita.core.paths import Artifact, RunPaths, TaskPaths, atomic_write_json
from pita.core.progress import Eta, TaskDurations, format_duration
from pita.core.resume import completed_tasks, remove_stale_tmp
from pita.core.run_lock import RunLock
from pita.core.safe_files import check_folder
from pita.experiment.config import validate
from pita.experiment.plan import check_resources, plan_experiment

log = logging.getLogger("pita")

EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 130  # 2 (bad config): cli.py


def make_gpu_manager(cfg: DictConfig) -> GPUManager:
    if cfg.executor.backend == "ray":  # slots = the Ray cluster's GPUs (or CPUs); Ray pins them
        from pita.core.ray_executor import RayExecutor, ray_devices_spec

        ray_exec = RayExecutor(cfg.executor)
        kind, n = ray_exec.slots()
        sizes = ray_exec.gpu_memory_mb() if kind == "gpu" else []  # NVML on each node: real memory
        return GPUManager(ray_devices_spec(kind, n, sizes), cpu_workers=max(1, n))
    spec = cfg.system.devices
    if cfg.system.gpu_mode == "cpu":
        spec = "cpu"
    gpu = GPUManager(
        spec, cpu_workers=cfg.executor.cpu_workers, threads_per_worker=cfg.system.threads_per_worker
    )
    if cfg.system.gpu_mode == "single_gpu" and gpu.is_gpu:
        gpu.devices = gpu.devices[:1]
    return gpu


def make_executor(cfg: DictConfig, gpu: GPUManager, run_dir: Path) -> Executor:
    """The executor of `executor.backend`: worker processes (local), this process
    (inprocess, or system.use_parallel_execution=false), or Ray tasks."""
    if cfg.executor.backend == "ray":
        from pita.core.ray_executor import RayExecutor
        from pita.runtime.worker import run_task_here

        return RayExecutor(cfg.executor, run_task=run_task_here)
    if cfg.executor.backend == "inprocess" or not cfg.system.use_parallel_execution:
        from pita.core.inprocess import InProcessExecutor
        from pita.runtime.worker import InProcessRunner

        runner = InProcessRunner(cfg.executor.model_cache_size)
        return InProcessExecutor(runner, on_shutdown=runner.models.clear)
    from pita.core.worker_pool import WorkerPool

    return WorkerPool.from_config(gpu, cfg.executor, log_dir=RunPaths(run_dir).workers)


def make_scheduler(cfg: DictConfig, gpu: GPUManager) -> Scheduler:
    from pita.core.resources import max_tasks_per_device

    states = [DeviceState(d.index, d.total_mb, d.free_mb) for d in gpu.devices]
    value = cfg.executor.max_tasks_per_gpu
    if cfg.executor.backend == "ray" and value == "auto":
        value = 1  # Ray places by whole GPUs (num_gpus=1): it would queue a second task on a slot
    cap = max_tasks_per_device(value, gpu.kind, len(gpu.devices))
    return Scheduler(states, max_tasks_per_device=cap, simulated_memory=gpu.kind != "cuda")


def build_plan(cfg: DictConfig, gpu: GPUManager) -> Plan:
    return plan_experiment(
        cfg,
        len(gpu.devices),
        device_mb=[d.total_mb for d in gpu.devices],
        distribute=ParallelDataGenerator(gpu).shard_fractions,
    )


def task_durations(cfg: DictConfig, gpu: GPUManager) -> TaskDurations:
    """Expected task durations: earlier runs' recorded ones (pita/experiment/timeline.py),
    then work units; the run adds its own finished tasks as they come."""
    from pita.experiment.timeline import duration_key, load_durations

    return TaskDurations(load_durations(), duration_key(cfg, gpu.kind))


def estimated_wall_time(plan: Plan, cfg: DictConfig, gpu: GPUManager) -> tuple[float, str]:
    """(seconds, source): the plan simulated on the devices with the expected durations."""
    durations = task_durations(cfg, gpu)
    eta = Eta(plan.tasks, set(), durations, make_scheduler(cfg, gpu))
    return eta.remaining({}, time.time())


def print_dry_run(plan: Plan, cfg: DictConfig, gpu: GPUManager) -> None:
    scheduler = make_scheduler(cfg, gpu)
    sized = _dry_run_sizing(plan, cfg, gpu)
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
        f"{'task':58s} {'device':9s} {'mem GB':>7s} {'prio':>6s}  {'estimate from':40s} depends on"
    )
    for t in plan.tasks.values():
        devs = "+".join(str(d) for d in placement.get(t.id, [])) or "-"
        deps = ", ".join(t.deps) if len(t.deps) <= 2 else f"{t.deps[0]} (+{len(t.deps) - 1})"
        print(
            f"{t.id:58s} {devs:9s} {t.mem_mb / 1024:7.2f} {t.priority:6.1f}  {t.mem_source[:40]:40s} {deps}"
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
        print(
            f"Predicted makespan: ~{format_duration(sized['makespan_s'])} with these ranks, "
            f"~{format_duration(sized['rigid_makespan_s'])} with one rank each "
            f"({sized['sized']} tasks sized in {sized['sizing_s']:.2f} s)."
        )
    seconds, source = estimated_wall_time(plan, cfg, gpu)
    print(f"Estimated wall time: ~{format_duration(seconds)} ({source}).")


def _dry_run_sizing(plan: Plan, cfg: DictConfig, gpu: GPUManager) -> dict | None:
    """The dry run's simulation with elastic tasks sized at their simulated dispatch."""
    if not any(t.elastic for t in plan.tasks.values()):
        return None
    from pita.experiment.sizing import dry_run_sizing, make_sizer

    scheduler = make_scheduler(cfg, gpu)
    sizer = make_sizer(cfg, plan.tasks, task_durations(cfg, gpu), scheduler)
    if not sizer.enabled:
        return None
    return dry_run_sizing(plan, scheduler, sizer)


def lock_run_folder(cfg: DictConfig, run_dir: Path, share: bool = False) -> RunLock:
    """Check the run folder (yours, nobody else can write it, its output folders writable)
    and take its lock, before anything is written in it. The command line calls this
    before Hydra writes `.hydra/` (`share=True`); `run()` calls it again (nested in the
    same process)."""
    paths = RunPaths(run_dir)
    trust_group = bool(cfg.system.get("trust_group", False))
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
        check_resources(plan, len(gpu.devices), [d.total_mb for d in gpu.devices])
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
    validate(cfg)
    run_dir = Path(run_dir)
    paths = RunPaths(run_dir)
    gpu = make_gpu_manager(cfg)
    plan = Plan.load(paths.plan) if resumed else build_plan(cfg, gpu)
    if resumed:
        check_plan_fits(plan, gpu, cfg)
    if cfg.dry_run:
        warn_stage_overrides(cfg, plan)
        print_dry_run(plan, cfg, gpu)
        return EXIT_OK

    with lock_run_folder(cfg, run_dir):  # one orchestrator per run folder (a second exits 2)
        return _run_locked(cfg, run_dir, paths, gpu, plan, resumed, absolutized)


def _run_locked(
    cfg: DictConfig,
    run_dir: Path,
    paths: RunPaths,
    gpu: GPUManager,
    plan: Plan,
    resumed: bool,
    absolutized: list[str],
) -> int:
    if resumed:
        remove_stale_tmp(run_dir)
    else:
        atomic_write_json(paths.plan, plan.to_json())
        if (
            absolutized or not paths.saved_config.exists()
        ):  # Hydra writes it; tests get it here; resume
            paths.saved_config.parent.mkdir(parents=True, exist_ok=True)
            paths.saved_config.write_text(OmegaConf.to_yaml(cfg, resolve=True))
    from pita.experiment import run_info

    run_info.write(run_dir, gpu, resumed=resumed)  # git commit, packages, devices, command
    done = completed_tasks(plan, run_dir) if resumed else set()
    journal = Journal(paths.journal)
    journal.append(
        "run_resumed" if resumed else "run_started", tasks=len(plan.tasks), already_done=len(done)
    )
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

    from pita.core.journal import read_events
    from pita.core.monitor import Monitor
    from pita.core.progress import Progress
    from pita.experiment.timeline import done_walls

    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(cfg_dict, dict)
    executor = make_executor(cfg, gpu, run_dir)
    if any(t.elastic for t in plan.tasks.values()) and hasattr(executor, "extra_env"):
        executor.extra_env["PITA_WARM_FORKSERVER"] = "1"  # gangs fork ranks from warm workers
    executor.warm_up([(d.index,) for d in gpu.devices][: len(plan.tasks) - len(done)])
    scheduler = make_scheduler(cfg, gpu)
    monitor = Monitor(
        gpu,
        executor,
        paths.gpu_monitor,
        cfg.executor.monitor_interval_s,
        reservations=lambda: [sum(d.running.values()) for d in scheduler.devices],
    ).start()
    durations = task_durations(cfg, gpu)
    for tid, wall in done_walls(read_events(paths.journal)).items():
        if tid in done:  # a resumed run's earlier session: this run's durations
            durations.observe(plan.tasks[tid], wall)
    from pita.experiment.sizing import make_sizer, wire_eta

    sizer = make_sizer(cfg, plan.tasks, durations, scheduler)
    progress = Progress(
        len(plan.tasks),
        [d.label for d in gpu.devices],
        len(done),
        worker_info=executor.workers,
        live=None if cfg.executor.progress else False,
        eta=wire_eta(Eta(plan.tasks, done, durations, scheduler), sizer),
    )
    from pita.experiment.estimates import PeakEstimator, peaks_cache_path

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
    )
    log.info(
        "Packing: up to %d task(s) per device while their memory estimates fit (executor.max_tasks_per_gpu=%s)",
        scheduler.max_tasks,
        cfg.executor.max_tasks_per_gpu,
    )
    interrupted = False
    lost: str | None = None
    previous_sigterm = signal.signal(signal.SIGTERM, _raise_interrupt)
    t0 = time.time()
    try:
        with progress:
            summary = runner.run()
    except KeyboardInterrupt:
        interrupted = True
        summary = runner.summary
    except (
        ExecutorBroken
    ) as exc:  # a pool thread stopped: fail now, loudly, rather than wait forever
        lost = str(exc)
        summary = runner.summary
    finally:
        signal.signal(signal.SIGTERM, previous_sigterm)
        monitor.stop()
        if not interrupted:
            try:
                monitor.sample()  # a last summary while the workers still report
            except Exception:
                pass
        executor.shutdown(kill=interrupted or lost is not None)
        _record_durations(run_dir, plan, durations.key, sizer.curves.one_rank)
    if lost is not None:
        journal.append(
            "run_failed", reason=lost, done=len(runner.done), wall_s=round(time.time() - t0, 2)
        )
        journal.close()
        log.error(
            "Run stopped: %s. Finished tasks are kept; resume with:\n  %s",
            lost,
            resume_command(run_dir),
        )
        return EXIT_FAILED
    end = {
        "done": len(runner.done),
        "failed": len(summary.failed),
        "skipped": len(summary.skipped),
        "wall_s": round(time.time() - t0, 2),
    }
    if interrupted:
        journal.append("run_interrupted", **end)
        journal.close()
        log.warning(
            "Interrupted: workers stopped, journal flushed. Resume with:\n  %s",
            resume_command(run_dir),
        )
        return EXIT_INTERRUPTED

    # run_finished is journaled after the report: a report killed midway leaves a run that
    # resume_from=auto finishes (it redoes no task, it writes the report)
    reported = _report(cfg, plan, run_dir)
    _time_report(run_dir, plan, [d.label for d in gpu.devices])
    journal.append("run_finished", **end, report=reported)
    journal.close()
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
            tail = TaskPaths(run_dir, tid).failed(runner.attempts.get(tid, 1)) / Artifact.LOG
            if tail.is_file():
                log.error("    log: %s (%s)", tail, last_line(tail.read_text(errors="replace")))
        log.error("Fix the cause, then finish the run with: %s", resume_command(run_dir))
        _end_lines(paths)
        return EXIT_FAILED
    log.info("All %d tasks done in %.1fs.", len(plan.tasks), time.time() - t0)
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
    """Results table and plots from the evaluate tasks (pita/experiment/report.py).
    False (one ERROR line, the traceback at DEBUG in run.log) when it could not be
    written: the run then exits 1, never 0 with an old or missing summary."""
    from pita.experiment.report import write_report

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


def _record_durations(run_dir: Path, plan: Plan, key, one_rank=None) -> None:
    """Keep this run's task durations for the next run's ETA and speedup curves (never
    fails the run)."""
    from pita.experiment.timeline import record_durations

    try:
        record_durations(run_dir, plan.tasks, key, one_rank=one_rank)
    except Exception as exc:
        log.debug("recording task durations failed: %s", exc, exc_info=True)


def _time_report(run_dir: Path, plan: Plan, labels: list[str]) -> None:
    """results/timeline.png and the "where the time went" table, also in run.log."""
    from pita.experiment.timeline import write_time_report

    try:
        table = write_time_report(run_dir, plan.tasks, labels)
    except Exception as exc:
        log.debug("time report traceback", exc_info=True)
        log.warning("writing the time report failed: %s: %s", type(exc).__name__, exc)
        return
    if table:
        log.info("%s", table)


def _end_lines(paths: RunPaths) -> None:
    """The run's last lines: where the results and plots are, and what the columns mean."""
    from pita.experiment.report import legend

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
