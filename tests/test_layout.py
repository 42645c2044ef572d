"""The package layout is the flow: no package imports upward, and the parent side stays torch-free.

Layers, lowest first (a package may import itself and any package of a lower layer):

    core                      parent process: devices, scheduler, executors, journal (torch-free)
    datasets, eval            tasks, prompts, rewards, metrics
    models                    loading, generation, value model, placement
    training                  the shared training stack; takes values (a model, a folder, a
                              logger config), knows no task and no StageContext
    runtime                   worker side: worker main, StageContext, OOM classes, batch size,
                              a context unpacked into values (kit), per-rank DDP glue (gang)
    algos                     the algorithm table, PITA / Q# / DPO / GRPO stages, roll-outs
    stages                    stages every chain shares: pretrain, evaluate, collect_merge
    results                   what a run leaves: report, matched-KL, aggregate, timeline
    experiment                config schema, planner, run, cli

Function-level imports count too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "pita"

LAYER = {
    "core": 0,
    "datasets": 1,
    "eval": 1,
    "models": 2,
    "training": 3,
    "runtime": 4,
    "algos": 5,
    "stages": 6,
    "results": 7,
    "experiment": 8,
    "": 9,  # pita/__init__.py, pita/__main__.py
}


def _package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "pita" and (PKG / parts[1]).is_dir() else ""


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported pita module) for every import statement in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("pita")]
        elif (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.level == 0
            and node.module.startswith("pita")
        ):
            out += [
                (node.lineno, node.module + ("." + a.name if node.module == "pita" else ""))
                for a in node.names
            ]
    return out


def test_every_package_has_a_layer():
    packages = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages <= set(LAYER), (
        f"give {sorted(packages - set(LAYER))} a layer in this test and its docstring"
    )


def test_no_package_imports_upward():
    violations = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        source = _package_of(".".join(rel.parts))
        for line, module in _imports(path):
            target = _package_of(module)
            if target != source and LAYER[target] >= LAYER[source]:
                violations.append(
                    f"{path.relative_to(ROOT)}:{line}: pita.{source or '<root>'} imports {module}"
                )
    assert not violations, "upward or sideways imports:\n" + "\n".join(violations)


def test_parent_side_imports_without_torch():
    """Every module of pita.core and pita.experiment imports with torch and transformers
    unavailable (the orchestrator never loads them; workers do)."""
    modules = [
        ".".join(p.relative_to(ROOT).with_suffix("").parts)
        for sub in ("core", "experiment")
        for p in sorted((PKG / sub).glob("*.py"))
    ]
    code = (
        "import sys\n"
        "for name in ('torch', 'transformers', 'trl', 'accelerate', 'datasets'):\n"
        "    sys.modules[name] = None  # an import of it raises ImportError\n"
        "import importlib\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        "print('ok', len(sys.modules))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("ok")


def test_algorithm_table_matches_conf():
    """conf/config.yaml loads one algo group per row of the table, in the same order."""
    import re

    from pita.algos.registry import ALGO_NAMES

    text = (ROOT / "conf" / "config.yaml").read_text()
    assert tuple(re.findall(r"algo@algos\.([\w-]+):", text)) == ALGO_NAMES


def test_every_stage_entry_point_says_what_it_reads_and_writes():
    import importlib

    from pita.algos.registry import ALGORITHMS, EXTRA_FUNCTIONS, SHARED_FUNCTIONS

    dotted = {
        *SHARED_FUNCTIONS.values(),
        *EXTRA_FUNCTIONS.values(),
        *(f for a in ALGORITHMS.values() for f in a.functions.values()),
    }
    missing = []
    for d in sorted(dotted):
        module, _, name = d.partition(":")
        doc = getattr(importlib.import_module(module), name).__doc__ or ""
        if "Reads:" not in doc and "Writes" not in doc and "as `" not in doc:
            missing.append(d)
    assert not missing, (
        f"stage entry points without a docstring saying what they read and write: {missing}"
    )
