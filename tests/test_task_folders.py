"""Task folders prove completion (issue 13): a sha256 per file, the declared outputs
required, NaN metrics failing the task (an infinite KL commits: tests/test_kl.py), and on resume a redone task redoing its
dependants and the dead attempts' `.tmp-*` folders removed. Real files, real runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pita.core.paths import TaskPaths, atomic_write_json, atomic_write_text
from pita.core.tasks import TaskSpec
from pita.runtime.context import ModelCache
from pita.runtime.worker import execute_task
from tests.conftest import ROOT, journal, only, run_cli, run_dirs, sleep_overrides, task_spec

TID = "QSharp.goal_walk.tiny.r0.evaluate"


def _committed(tmp_path, outputs=("metrics.json", "model")) -> TaskPaths:
    paths = TaskPaths(tmp_path, TID)
    tmp = paths.tmp(1)
    (tmp / "model").mkdir(parents=True)
    (tmp / "model" / "model.safetensors").write_bytes(os.urandom(4096))
    atomic_write_json(tmp / "metrics.json", [{"eta": 0.0, "pass@1": 0.5}])
    atomic_write_json(tmp / "result.json", {"task_id": TID})
    (tmp / "log.txt").write_text("done\n")
    paths.commit(tmp, required=outputs)
    assert paths.verify(outputs) is None
    return paths


def _manifest(paths: TaskPaths) -> dict:
    return json.loads(paths.manifest.read_text())


def test_same_size_edit_of_a_metric_is_caught(tmp_path):
    paths = _committed(tmp_path)
    metrics = paths.final / "metrics.json"
    text = metrics.read_text()
    metrics.write_text(text.replace("0.5", "0.9"))  # same size, other number
    assert metrics.stat().st_size == len(text)
    assert "metrics.json does not match its sha256" in paths.verify(["metrics.json"])


def test_bit_flip_in_a_checkpoint_is_caught(tmp_path):
    paths = _committed(tmp_path)
    weights = paths.final / "model" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[1000] ^= 0x01
    weights.write_bytes(bytes(data))
    assert "model/model.safetensors does not match its sha256" in paths.verify()


def test_manifest_edited_to_drop_a_file_is_caught(tmp_path):
    paths = _committed(tmp_path)
    manifest = _manifest(paths)
    del manifest["files"]["metrics.json"]
    (paths.final / "metrics.json").unlink()
    paths.manifest.write_text(json.dumps(manifest))
    assert paths.verify(["metrics.json", "model"]) == "manifest lacks metrics.json"


def test_emptied_folder_with_empty_file_list_is_caught(tmp_path):
    paths = _committed(tmp_path)
    for p in sorted(paths.final.rglob("*"), reverse=True):
        p.rmdir() if p.is_dir() else p.unlink()
    paths.manifest.write_text(json.dumps({"task_id": TID, "version": 2, "files": {}}))
    assert paths.verify().startswith("manifest lacks result.json")


def test_size_only_manifest_of_older_pita_is_not_trusted(tmp_path):
    paths = _committed(tmp_path)
    files = {rel: e["size"] for rel, e in _manifest(paths)["files"].items()}
    paths.manifest.write_text(json.dumps({"task_id": TID, "files": files}))
    assert "without checksums" in paths.verify()


def test_commit_refuses_a_folder_without_its_declared_outputs(tmp_path):
    paths = TaskPaths(tmp_path, TID)
    tmp = paths.tmp(2)
    tmp.mkdir(parents=True)
    (tmp / "result.json").write_text("{}")
    (tmp / "log.txt").write_text("")
    with pytest.raises(ValueError, match="declared output.*metrics.json"):
        paths.commit(tmp, required=["metrics.json"])
    assert not paths.final.exists()


def _task(fn: str, outputs=()) -> TaskSpec:
    return task_spec(
        id=TID,
        stage="evaluate_merge",
        fn=fn,
        outputs=list(outputs),
    )


@pytest.mark.parametrize(
    "fn, outputs, expected",
    [
        (
            "tests.fault_stages:nan_stage",
            (),
            "NaN value(s) in the stage's result: result['rows'][0]['pass@1']=nan",
        ),
        (
            "tests.fault_stages:forgetful_stage",
            ("metrics.json",),
            "declared output(s): metrics.json",
        ),
    ],
)
def test_bad_stage_output_fails_the_task_and_commits_nothing(tmp_path, fn, outputs, expected):
    ok, failure, message, _ = execute_task(
        _task(fn, outputs), {}, tmp_path, 1, device="cpu", models=ModelCache()
    )
    assert not ok and failure == "error" and expected in message
    assert not TaskPaths(tmp_path, TID).final.exists()
    assert expected in (TaskPaths(tmp_path, TID).failed(1) / "log.txt").read_text()


def test_an_infinite_kl_commits_the_task(tmp_path):
    """A row whose policy sampled off π_ref's support under its rule has kl = +inf
    (docs/ALGORITHMS.md, "KL: the three columns"): a value, not a NaN bug."""
    ok, _, message, result = execute_task(
        _task("tests.fault_stages:infinite_kl_stage"),
        {},
        tmp_path,
        1,
        device="cpu",
        models=ModelCache(),
    )
    assert ok, message
    assert result["rows"][0]["kl"] == float("inf")
    assert json.loads((TaskPaths(tmp_path, TID).final / "result.json").read_text())["rows"][0][
        "kl"
    ] == float("inf")


def test_resume_redoes_a_corrupted_task_and_its_dependants_and_removes_tmp(tmp_path, markers):
    env = {"PITA_TEST_MARKERS": str(markers)}
    args = [
        "system.devices=fake:2",
        "executor.progress=false",
        "executor.heartbeat_s=0.5",
        "experiment.name=proof",
        *only("reference", "QSharp"),
        *sleep_overrides(),
    ]
    first = run_cli(args, tmp_path, env)
    assert first.returncode == 0, first.stdout + first.stderr
    [run_dir] = run_dirs(tmp_path, "proof")
    victim = "QSharp.goal_walk.tiny.r0.collect.s01"
    artifact = run_dir / "tasks" / victim / "artifact.txt"
    artifact.write_text(artifact.read_text().replace(victim, victim[::-1]))  # same size
    stale = run_dir / "tasks" / ".tmp-QSharp.goal_walk.tiny.r0.train-99999"
    stale.mkdir()
    (stale / "half.bin").write_bytes(b"x" * 100)
    resumed = run_cli(["resume_from=" + str(run_dir), "executor.progress=false"], tmp_path, env)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "artifact.txt does not match its sha256" in resumed.stdout
    runs = {
        p.name.rsplit(".started", 1)[0]: len(p.read_text().splitlines())
        for p in markers.glob("*.started")
    }
    redone = {tid for tid, n in runs.items() if n == 2}
    assert redone == {
        victim,
        "QSharp.goal_walk.tiny.r0.collect",
        "QSharp.goal_walk.tiny.r0.train",
        "QSharp.goal_walk.tiny.r0.evaluate.s00",
        "QSharp.goal_walk.tiny.r0.evaluate.s01",
        "QSharp.goal_walk.tiny.r0.evaluate",
    }, runs
    assert not stale.exists()
    assert journal(run_dir)[-1]["event"] == "run_finished"


def test_files_follow_the_umask(tmp_path):
    """Results, manifests and plan.json are group-readable under umask 022 (mkstemp's 0600
    used to leak through atomic writes) and not under 027 for others."""
    code = (
        "import os, sys; os.umask(int(sys.argv[2], 8)); from pathlib import Path;"
        "from pita.core.paths import atomic_write_text; atomic_write_text(Path(sys.argv[1]), 'x')"
    )
    for mask, mode in (("022", 0o644), ("027", 0o640)):
        target = tmp_path / f"f{mask}.json"
        subprocess.run(
            [sys.executable, "-c", code, str(target), mask],
            check=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert target.stat().st_mode & 0o777 == mode, (mask, oct(target.stat().st_mode))
    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "here.txt", "x")
        assert (tmp_path / "here.txt").stat().st_mode & 0o777 == 0o644
    finally:
        os.umask(old)


def test_a_run_is_group_readable_under_umask_022(tmp_path):
    args = [
        "system.devices=fake:1",
        "executor.progress=false",
        "experiment.name=perms",
        *only("reference"),
        *sleep_overrides(),
    ]
    proc = subprocess.run(
        [
            "bash",
            "-c",
            'umask 022 && exec "$@"',
            "_",
            sys.executable,
            str(ROOT / "run_parallel.py"),
            *args,
        ],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [run_dir] = run_dirs(tmp_path, "perms")
    private = [
        str(p.relative_to(run_dir))
        for p in run_dir.rglob("*")
        if p.is_file() and p.stat().st_mode & 0o044 != 0o044 and p.name != ".lock"
    ]  # .lock is 0600 on purpose: nobody else may flock it (tests/test_hostile.py)
    assert not private, private
    assert (run_dir / "plan.json").is_file() and list(run_dir.glob("tasks/*/manifest.json"))
