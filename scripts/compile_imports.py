"""Write the bytecode of what pita's runs and its tests import, by importing it once.

Called by scripts/setup.sh after the packages are installed without compiling them. Pip
compiles every file it installs, and `uv pip install --compile-bytecode` did the same:
20k files, two thirds of a fresh setup's minute on 2 cores, for packages of which a run
imports about a quarter (torch, transformers and TRL pull in mlflow, wandb, sympy and
pandas whole). Python writes a module's bytecode the first time it imports it, except where
PYTHONDONTWRITEBYTECODE is set (this project's CI machines): there every process would
compile torch's and transformers' sources again. So this imports what a run, its workers,
gang ranks and the suite import, with bytecode writing on, in two processes at once (one
per core). A module that is not here is compiled when something first imports it (and
cached, unless PYTHONDONTWRITEBYTECODE is set).

Prints the line setup.sh ends with: the versions of torch (imported here: a wrong build
fails), transformers, TRL and Hydra. Exit 1, naming the module, when a required one fails.
Done once per set of installed packages (a stamp in the venv; `_stamp`).
"""

from __future__ import annotations

import compileall
import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# What the orchestrator and the suite import beyond the training group (`_training_modules`); the
# dev extras (Ray, the trackers, pytest) are skipped when not installed.
ORCHESTRATION = ("pita.experiment.cli", "pita.experiment.run", "pita.results.report")
OPTIONAL = (
    "matplotlib.pyplot",
    "ray",
    "ray.util.placement_group",
    "pita.core.ray_executor",
    "wandb",
    "mlflow",
    "pytest",
    "xdist",
)
# Compiled whole: what runs in processes pita does not start itself (Ray's agents on every
# node, its workers), or is found at run time (Hydra's plugins), so an import list misses it.
WHOLE = (
    # first: what the training group imports after torch, compiled while it imports torch
    "trl",
    "accelerate",
    "datasets",
    "peft",
    "transformers/generation",
    "transformers/integrations",
    "transformers/utils",
    "transformers/models/auto",
    "transformers/models/llama",
    "transformers/models/gpt2",
    "hydra",
    "hydra_plugins",
    "omegaconf",
    "ray/_private",
    "ray/_common",
    "ray/autoscaler",
    "ray/core",
    "ray/dashboard",
    "ray/util",
    "tensorboard",
    "torch/distributed",
    "torch/utils/tensorboard",
    "pydantic",
    "PIL",
)
GROUPS = ("training", "orchestration")  # one process each, at once


def _training_modules() -> list[str]:
    """What a worker and a gang rank import first: the forkserver's `PRELOAD` and every
    registered stage module (read from pita without importing torch)."""
    from pita.algos.registry import ALGORITHMS, EXTRA_FUNCTIONS, SHARED_FUNCTIONS
    from pita.core.forked_worker import PRELOAD

    functions = [*SHARED_FUNCTIONS.values(), *EXTRA_FUNCTIONS.values()]
    functions += [fn for algo in ALGORITHMS.values() for fn in algo.functions.values()]
    return [*PRELOAD, *sorted({fn.partition(":")[0] for fn in functions})]


def _import_training() -> None:
    """`_training_modules`, then the libraries the stages name in `WARM_IMPORTS` (TRL's
    trainers: `gang_preload`, what a gang's ranks preload)."""
    from pita.core.forked_worker import PRELOAD, gang_preload

    modules = _training_modules()
    _import_all(modules)  # a stage that fails to import fails here, named
    _import_all(gang_preload(",".join(m for m in modules if m not in PRELOAD)))


def _import_all(names: list[str]) -> None:
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:
            sys.exit(f"setup: importing {name} failed: {type(exc).__name__}: {exc}")


def _compile_group(group: str) -> None:
    """Import (and so compile) one group, in this process (started without
    PYTHONDONTWRITEBYTECODE by `main`)."""
    if group == "training":
        _import_training()
        return
    for folder in WHOLE:
        top, _, sub = folder.partition("/")
        spec = importlib.util.find_spec(top)
        for root in (spec and spec.submodule_search_locations) or ():
            compileall.compile_dir(f"{root}/{sub}" if sub else root, quiet=2)
    _import_all(list(ORCHESTRATION))
    for name in OPTIONAL:
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def _stamp() -> str:
    """What this venv's compiled bytecode was written for: the installed distributions and
    this script's lists. Unchanged, a second setup (the README commands run it every time)
    skips the imports (~10 s on a set-up machine)."""
    from importlib.metadata import distributions

    installed = sorted(f"{d.metadata['Name']}=={d.version}" for d in distributions())
    lists = (_training_modules(), ORCHESTRATION, OPTIONAL, WHOLE)
    return "\n".join([*installed, repr(lists)]) + "\n"


def main(argv: list[str]) -> int:
    if argv[:1] == ["--group"]:
        _compile_group(argv[1])
        return 0
    stamp_file, stamp = Path(sys.prefix) / "pita-compiled-imports.txt", _stamp()
    if not (stamp_file.is_file() and stamp_file.read_text() == stamp):
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        procs = [
            subprocess.Popen([sys.executable, __file__, "--group", g], cwd=ROOT, env=env)
            for g in GROUPS
        ]
        if any([p.wait() != 0 for p in procs]):  # a list: wait for both
            return 1
        stamp_file.write_text(stamp)  # torch was imported above: a wrong build failed
    from importlib.metadata import version

    names = ("torch", "transformers", "trl", "hydra-core")
    print("pita env ready: " + ", ".join(f"{n} {version(n)}" for n in names))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
