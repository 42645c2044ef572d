"""test_parallel_setup.py end to end: real worker processes on two simulated GPUs, and a bad
--devices value refused with exit code 2 and one line, before anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "test_parallel_setup.py"


def run_diagnostic(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_fake_devices_pass():
    proc = run_diagnostic("--devices", "fake:2", "executor.heartbeat_s=1")
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    for expected in (
        "GPU-fake-00",
        "GPU-fake-01",
        "import pita.core",
        "import pita.datasets",
        "import pita.models",
        "config composes, validates, serialises",
        "device detection",
        "worker on GPU 0",
        "worker on GPU 1",
        "distinct worker PIDs",
        "orchestrator holds no CUDA context",
        "All 9 checks passed.",
    ):
        assert expected in out, f"{expected!r} missing from:\n{out}"
    check_rows = [line for line in out.splitlines() if "PASS" in line or "FAIL" in line]
    assert len(check_rows) == 9 and all("PASS" in row for row in check_rows), out
    # each worker saw exactly its own pinned fake UUID and no CUDA device
    assert "pinned to 'GPU-fake-00'" in out and "pinned to 'GPU-fake-01'" in out, out
    # the temporary run folder is removed unless --keep
    assert "Run folder kept" not in out


def test_bad_devices_value_exits_2_with_one_line():
    for bad in ("fake:0", "gpu"):
        proc = run_diagnostic("--devices", bad, timeout=60)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
        assert len(lines) == 1, lines
        assert "--devices" in lines[0] and "system.devices" in lines[0] and "allowed" in lines[0], (
            lines[0]
        )
