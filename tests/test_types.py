"""The torch-free parent side type-checks: `mypy pita/core pita/results pita/experiment` (config in
pyproject.toml, [tool.mypy]) finds no error."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.slow  # a cold mypy of the whole parent side: minutes on a busy 2-core machine
def test_core_and_experiment_are_mypy_clean():
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (pip install -e '.[dev]')")
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "pita/core", "pita/results", "pita/experiment"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
