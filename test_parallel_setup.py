#!/usr/bin/env python
"""Setup diagnostic: run this first on a new machine (the seed guide's "Test 1",
docs/guides/gpu_execution.txt).

    python test_parallel_setup.py                     # system.devices=auto: GPUs, else CPU slots
    python test_parallel_setup.py --devices fake:4    # simulated GPUs (also: cpu, [0,1], fake:[80GB,40GB])
    python test_parallel_setup.py --devices fake:2 executor.heartbeat_s=1   # extra args = config overrides

It checks, with the orchestrator's own parts and nothing mocked:
  - `import pita.core`, `pita.datasets`, `pita.models` work (and none of them imports torch);
  - the config composes from conf/ with the overrides, validates, and round-trips through
    `OmegaConf.to_container(cfg, resolve=True)` -> `OmegaConf.create` (what a worker receives);
  - `GPUManager` detects the devices (NVML for real GPUs; no CUDA context is created here);
  - one worker per device, started by `WorkerPool` (a real subprocess pinned with
    CUDA_VISIBLE_DEVICES), runs the real `pita.stages.diagnostic:device_check` stage in a
    temporary run folder: CUDA_VISIBLE_DEVICES is exactly the device's pinning value, torch sees
    1 GPU per pinned real GPU (0 on fake/CPU devices), its matmul matches the CPU result, its task
    folder is committed, and every worker has its own PID. Memory is reported per worker.

Exit code: 0 every check passed, 1 some check failed, 2 a bad --devices value or config override.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import wait
from pathlib import Path

import yaml
from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from pita.core.errors import ConfigError  # noqa: E402
from pita.core.gpu_manager import validate_devices_spec  # noqa: E402
from pita.experiment.config import validate  # noqa: E402

MATMUL_TOLERANCE = 0.05  # max abs error of a fp32 matmul (1024x1024 on GPU) against the CPU
console = Console(width=None if sys.stdout.isatty() else 140)


def parse_devices(text: str):
    """'[0,1]' -> [0, 1]; anything else stays a string (validated by validate_devices_spec)."""
    if text.strip().startswith("["):
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError:
            return text
    return text.strip()


def devices_override(spec) -> str:
    if isinstance(spec, list):
        return f"system.devices=[{','.join(str(i) for i in spec)}]"
    return f"system.devices='{spec}'"


def usage_error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--devices", help="auto | cpu | [0,2] | fake:N | fake:[80GB,40GB] (system.devices)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the temporary run folder")
    parser.add_argument(
        "--timeout", type=float, default=180.0, help="seconds for workers to start and answer"
    )
    parser.add_argument(
        "overrides", nargs="*", help="config overrides, e.g. executor.heartbeat_s=1"
    )
    args = parser.parse_args(argv)
    overrides = list(args.overrides)
    flag = ""
    if args.devices is not None:  # a bad value is reported before anything starts
        flag = f"--devices {args.devices}: "
        spec = parse_devices(args.devices)
        try:
            validate_devices_spec(spec)
        except ConfigError as exc:
            return usage_error(flag + exc.messages[0])
        overrides = [o for o in overrides if not o.startswith("system.devices=")] + [
            devices_override(spec)
        ]

    checks: list[tuple[str, bool, str]] = []  # (check, passed, detail)
    for module in ("pita.core", "pita.datasets", "pita.models"):
        try:
            importlib.import_module(module)
            checks.append((f"import {module}", True, ""))
        except Exception as exc:  # noqa: BLE001 - any import failure is a failed check
            checks.append((f"import {module}", False, f"{type(exc).__name__}: {exc}"))

    from pita.experiment.cli import compose_config

    try:
        cfg = compose_config(overrides)
        validate(cfg, project_root=ROOT)
        cfg_dict = OmegaConf.to_container(cfg, resolve=True)
        same = OmegaConf.to_container(OmegaConf.create(cfg_dict), resolve=True) == cfg_dict
        checks.append(
            (
                "config composes, validates, serialises",
                same,
                f"{len(cfg_dict)} top-level keys, round-trip {'ok' if same else 'CHANGED the config'}",
            )
        )
    except ConfigError as exc:
        return usage_error(exc.messages[0])
    except Exception as exc:  # noqa: BLE001 - a broken project, not a bad command line: go on
        from pita.experiment.config import PitaConfig

        checks.append(
            ("config composes, validates, serialises", False, f"{type(exc).__name__}: {exc}")
        )
        cfg = OmegaConf.structured(PitaConfig)
        if args.devices is not None:
            cfg.system.devices = spec
        cfg_dict = OmegaConf.to_container(cfg, resolve=True)

    from pita.experiment.run import make_gpu_manager

    try:
        gpu = make_gpu_manager(cfg)  # e.g. [0,1] on a machine without those GPUs
    except ConfigError as exc:
        return usage_error(flag + exc.messages[0])

    table = Table(
        title=f"Devices: {len(gpu.devices)} x {gpu.kind} (system.devices={cfg.system.devices})"
    )
    for col in ("#", "name", "UUID", "total GB", "free GB"):
        table.add_column(col, justify="right" if "GB" in col else "left")
    for d in gpu.devices:
        table.add_row(
            str(d.index), d.name, d.uuid, f"{d.total_mb / 1024:.2f}", f"{d.free_mb / 1024:.2f}"
        )
    console.print(table)
    note = (
        " (no NVIDIA GPU found: CPU slots)"
        if gpu.kind == "cpu" and cfg.system.devices == "auto"
        else ""
    )
    checks.append(
        ("device detection", bool(gpu.devices), f"{len(gpu.devices)} {gpu.kind} device(s){note}")
    )

    checks += run_workers(gpu, cfg, cfg_dict, keep=args.keep, timeout=args.timeout)

    torch = sys.modules.get("torch")
    no_context = torch is None or not torch.cuda.is_initialized()
    checks.append(
        (
            "orchestrator holds no CUDA context",
            no_context,
            "torch not imported here" if torch is None else "torch imported, CUDA not initialised",
        )
    )

    table = Table(title="Checks")
    for col in ("check", "result", "detail"):
        table.add_column(col)
    for name, ok, detail in checks:
        table.add_row(name, "[green]PASS[/green]" if ok else "[bold red]FAIL[/bold red]", detail)
    console.print(table)
    failed = [name for name, ok, _ in checks if not ok]
    if failed:
        console.print(
            f"[bold red]{len(failed)} of {len(checks)} checks failed:[/bold red] {', '.join(failed)}"
        )
        return 1
    console.print(f"[bold green]All {len(checks)} checks passed.[/bold green]")
    return 0


def run_workers(
    gpu, cfg, cfg_dict: dict, *, keep: bool, timeout: float
) -> list[tuple[str, bool, str]]:
    """One worker per device runs device_check; returns one check per worker + distinct PIDs."""
    from pita.core.paths import TaskPaths
    from pita.core.tasks import TaskSpec
    from pita.core.worker_pool import WorkerPool

    ex = cfg.executor
    run_dir = Path(tempfile.mkdtemp(prefix="pita-setup-"))
    # A worker says hello before its slow imports: one silent for a minute never connected.
    pool = WorkerPool(
        gpu,
        max_tasks_per_device=1,
        heartbeat_s=ex.heartbeat_s,
        heartbeat_timeout_s=ex.heartbeat_timeout_s,
        task_timeout_s=timeout,
        start_timeout_s=min(60.0, timeout),
        model_cache_size=1,
        preimport=ex.preimport,
    )
    t0 = time.time()
    tasks = {
        d.index: TaskSpec.standalone(
            f"diagnostic.device_check.d{d.index:02d}",
            "diagnostic",
            "device_check",
            "pita.stages.diagnostic:device_check",
            preferred_device=d.index,
        )
        for d in gpu.devices
    }
    futures: dict = {}
    interrupted = True
    try:
        with console.status(f"starting {len(tasks)} worker(s) and running device_check ..."):
            futures = {i: pool.submit(t, [i], cfg_dict, run_dir) for i, t in tasks.items()}
            wait(list(futures.values()), timeout=timeout + 10)
        committed = {i: TaskPaths(run_dir, t.id).verify() is None for i, t in tasks.items()}
        interrupted = False
    finally:
        pool.shutdown(kill=interrupted or not all(f.done() for f in futures.values()))
        if not keep:
            shutil.rmtree(run_dir, ignore_errors=True)

    table = Table(title=f"Workers (device_check, {time.time() - t0:.1f}s including start-up)")
    for col in (
        "device",
        "pid",
        "CUDA_VISIBLE_DEVICES",
        "torch.cuda.device_count",
        "matmul max err",
        "memory",
    ):
        table.add_column(col)
    checks, pids = [], []
    expected_count = 1 if gpu.kind == "cuda" else 0
    for i, fut in futures.items():
        label = gpu.devices[i].label
        expected_env = gpu.worker_env([i], base={})["CUDA_VISIBLE_DEVICES"]
        outcome = fut.result() if fut.done() else None
        if outcome is None or not outcome.ok:
            why = (
                f"no answer within {timeout:g}s"
                if outcome is None
                else f"{outcome.failure}: {outcome.message}"
            )
            checks.append((f"worker on {label}", False, why))
            table.add_row(label, "-", "-", "-", "-", why)
            continue
        r = outcome.result
        pids.append(r["pid"])
        problems = []
        if r["cuda_visible_devices"] != expected_env:
            problems.append(
                f"CUDA_VISIBLE_DEVICES={r['cuda_visible_devices']!r}, expected {expected_env!r}"
            )
        if r["torch_cuda_device_count"] != expected_count:
            problems.append(
                f"torch sees {r['torch_cuda_device_count']} GPU(s), expected {expected_count}"
            )
        if not r["matmul_max_abs_err"] <= MATMUL_TOLERANCE:
            problems.append(f"matmul error {r['matmul_max_abs_err']:.3g} > {MATMUL_TOLERANCE}")
        if r["pid"] != outcome.worker_pid:
            problems.append(f"stage ran in pid {r['pid']}, not in worker {outcome.worker_pid}")
        if not committed[i]:
            problems.append(
                f"task folder tasks/{tasks[i].id}/ not committed (manifest missing or wrong)"
            )
        if "allocated_mb" in r:
            memory = (
                f"{r['allocated_mb']:.0f} MB allocated, {r['reserved_mb']:.0f} MB reserved, "
                f"{r['free_mb'] / 1024:.1f} GB free"
            )
        else:
            memory = f"RSS {r['rss_mb']:.0f} MB"
        table.add_row(
            label,
            str(r["pid"]),
            repr(r["cuda_visible_devices"]),
            str(r["torch_cuda_device_count"]),
            f"{r['matmul_max_abs_err']:.2g} ({r['matmul_size']}x{r['matmul_size']}, {r['device']})",
            memory,
        )
        checks.append(
            (
                f"worker on {label}",
                not problems,
                "; ".join(problems) or f"pid {r['pid']} pinned to {expected_env!r}, {memory}",
            )
        )
    console.print(table)
    if keep:
        console.print(f"Run folder kept: {run_dir}")
    distinct = len(set(pids)) == len(pids) == len(futures) and os.getpid() not in pids
    checks.append(
        ("distinct worker PIDs", distinct, f"{len(set(pids))} PID(s) for {len(futures)} device(s)")
    )
    return checks


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
