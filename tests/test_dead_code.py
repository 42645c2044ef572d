"""No dead code: every definition in pita/ (and the entry scripts, bench/) is used outside tests/.

vulture (a dev extra) reads the code without importing it and reports what nothing references.
tests/ is not scanned, so a definition only a test calls counts as dead: wire it or delete it
with its tests. What vulture cannot see being used (a "module:function" string, a Hydra
`_target_`, a library's callback hook, a config key read by name) is listed, with who uses it,
in tests/vulture_whitelist.py.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ["pita", "bench", "run_parallel.py", "test_parallel_setup.py"]
WHITELIST = ROOT / "tests" / "vulture_whitelist.py"
# vulture rates an unused function, class, method, attribute, property or variable 60%, an
# unused import 90%, an unused argument or unreachable code 100%. 60 keeps all of them: a
# higher bar would drop exactly the test-only functions and classes this check is for.
MIN_CONFIDENCE = 60
# A package __init__ that re-exports its modules' names would make each of them look used.
EXCLUDED = ["pita/runtime/batch_size/__init__.py"]


def _vulture() -> None:
    if importlib.util.find_spec("vulture") is None:
        pytest.fail("vulture is not installed: pip install -e '.[dev]'")


def test_no_dead_code() -> None:
    _vulture()
    cmd = [sys.executable, "-m", "vulture", *SCANNED, str(WHITELIST)]
    cmd += ["--min-confidence", str(MIN_CONFIDENCE), "--exclude", ",".join(EXCLUDED)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (
        "unused code (delete it with its tests, or add it to tests/vulture_whitelist.py "
        f"saying who uses it):\n{proc.stdout}{proc.stderr}"
    )


def _defined_names() -> set[str]:
    """Every name the scanned code defines: functions, classes, arguments, assignment targets."""
    names: set[str] = set()
    files = [
        p for s in SCANNED for p in ([ROOT / s] if s.endswith(".py") else (ROOT / s).rglob("*.py"))
    ]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
    return names


def test_whitelist_has_no_stale_entry() -> None:
    """An entry whose name the code no longer defines would silently excuse a future one."""
    entries = []
    for stmt in ast.parse(WHITELIST.read_text(encoding="utf-8")).body:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, (ast.Name, ast.Attribute)):
            value = stmt.value
            entries.append(value.id if isinstance(value, ast.Name) else value.attr)
    assert entries, "tests/vulture_whitelist.py lists nothing"
    stale = sorted(set(entries) - _defined_names())
    assert not stale, f"tests/vulture_whitelist.py: nothing defines {stale} any more; drop them"
    duplicated = sorted({e for e in entries if entries.count(e) > 1})
    assert not duplicated, f"tests/vulture_whitelist.py lists {duplicated} twice"
