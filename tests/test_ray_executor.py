"""executor=ray: the same DAG runner on a local Ray cluster (real Ray tasks)."""

from __future__ import annotations

import pytest

from tests.conftest import journal, only, run_cli, run_dirs, sleep_overrides

pytest.importorskip("ray")


@pytest.mark.slow
def test_dag_runs_as_ray_tasks(tmp_path):
    args = [
        "executor=ray",
        "executor.ray_address=local",
        "experiment.name=ray",
        *only("reference", "QSharp"),
        "executor.progress=false",
        *sleep_overrides(),
    ]
    proc = run_cli(args, tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [run_dir] = run_dirs(tmp_path, "ray")
    done = [e for e in journal(run_dir) if e["event"] == "task_done"]
    assert len(done) == 11
    assert all((run_dir / "tasks" / e["task"] / "manifest.json").is_file() for e in done)
