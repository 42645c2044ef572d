"""House style is checked, not hoped for: `ruff check` and `ruff format --check` pass.

ruff comes with the dev extras (scripts/setup.sh installs them), so CI — which runs the
README's test command — fails on a lint error or an unformatted file.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ["pita", "tests", "bench", "run_parallel.py", "test_parallel_setup.py", "setup.py"]


def _ruff() -> list[str]:
    exe = Path(sys.executable).with_name("ruff")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("ruff")
    if found is None:
        pytest.fail("ruff is not installed: pip install -e '.[dev]' (scripts/setup.sh does)")
    return [found]


@pytest.mark.parametrize("args", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff(args: list[str]) -> None:
    proc = subprocess.run(
        [*_ruff(), *args, *TARGETS], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, (
        f"ruff {' '.join(args)} failed; fix or run `ruff {' '.join(args).replace(' --check', '')}`:\n{proc.stdout[-4000:]}{proc.stderr[-2000:]}"
    )
