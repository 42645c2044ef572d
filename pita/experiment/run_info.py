"""`run_info.json`: what a run folder needs to be reproduced or shared.

Written atomically when a run starts (and extended on every resume): the git commit of
the pita source and whether the tree was dirty, package versions, the devices the run saw,
the host, and the command line. Package versions come from installed metadata (no heavy
import); git is asked only when the source is a checkout.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from pita.core.paths import RunPaths, atomic_write_json

PACKAGES = (
    "pita",
    "torch",
    "transformers",
    "trl",
    "accelerate",
    "datasets",
    "tokenizers",
    "safetensors",
    "hydra-core",
    "omegaconf",
    "nvidia-ml-py",
    "ray",
    "tensorboard",
    "wandb",
    "mlflow",
    "math-verify",
    "hydra-submitit-launcher",
    "numpy",
)
ENV_KEYS = (
    "CUDA_VISIBLE_DEVICES",
    "SLURM_JOB_ID",
    "SLURM_ARRAY_JOB_ID",
    "SLURM_ARRAY_TASK_ID",
    "SLURM_NODELIST",
    "SLURM_RESTART_COUNT",
)


def git_state(source: Path | None = None) -> dict[str, Any]:
    """{"commit", "dirty", "branch"} of the checkout holding pita's source (empty outside one)."""
    source = source or Path(__file__).resolve().parents[2]
    if not (source / ".git").exists():
        return {}

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(
                ["git", "-C", str(source), *args], capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {}
    status = git("status", "--porcelain", "--untracked-files=no")
    return {
        "commit": commit,
        "dirty": bool(status),
        "branch": git("rev-parse", "--abbrev-ref", "HEAD"),
        "source": str(source),
    }


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def _typed_command() -> list[str]:
    """The command line as typed (the CLI expands shortcuts such as algos=[...] for Hydra)."""
    try:
        return list(json.loads(os.environ["PITA_COMMAND"]))
    except (KeyError, ValueError, TypeError):
        return list(sys.argv)


def collect(
    gpu: Any = None, argv: list[str] | None = None, strategy: str | None = None
) -> dict[str, Any]:
    info: dict[str, Any] = {
        "time": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": [Path(sys.executable).name, *(argv or _typed_command())],
        "cwd": os.getcwd(),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "git": git_state(),
        "packages": package_versions(),
        "env": {k: os.environ[k] for k in ENV_KEYS if k in os.environ},
    }
    if gpu is not None:
        info["devices"] = {
            "kind": gpu.kind,
            "count": len(gpu.devices),
            "inventory": list(gpu.describe()),
        }
    if strategy is not None:  # training.parallel_strategy as the run resolved it (never auto)
        info["parallel_strategy"] = strategy
    return info


def write(
    run_dir: Path | str, gpu: Any = None, *, resumed: bool = False, strategy: str | None = None
) -> Path:
    """Record this start (or resume) of the run in `<run_dir>/run_info.json`."""
    path = RunPaths(run_dir).run_info
    info = collect(gpu, strategy=strategy)
    if resumed and path.is_file():
        try:
            previous = json.loads(path.read_text())
        except ValueError:
            previous = {}
        previous.setdefault("resumes", []).append(info)
        atomic_write_json(path, previous)
    else:
        atomic_write_json(path, {**info, "resumes": []})
    return path
