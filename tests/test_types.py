"""pita type-checks: `mypy` over the files pyproject.toml's [tool.mypy] lists (the whole package:
the parent side and the stage code) finds no error, so a stage's read of a typed setting
(`ctx.training.x`, `ctx.algo_as(Schema).y`) is checked against the schema (pita/core/schema.py)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.slow  # cold: 6 s on a quiet 2-core machine (heavy packages skipped: pyproject.toml)
def test_parent_side_and_stage_code_are_mypy_clean():
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (pip install -e '.[dev]')")
    proc = subprocess.run(
        [sys.executable, "-m", "mypy"],  # files: pyproject.toml [tool.mypy]
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
