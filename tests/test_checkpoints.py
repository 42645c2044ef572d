"""In-task checkpoints: a training task killed mid-way continues from its checkpoint."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, only, run_cli, run_dirs

PRETRAIN = "pretrain.goal_walk.tiny"
ARGS = [
    "experiment=smoke",
    *only("reference"),
    "pretrain.steps=300",
    "training.checkpoint_every=20",
    "executor.progress=false",
    "executor.max_retries=2",
]


def _weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "tasks" / PRETRAIN / "model" / "model.safetensors"))


def _kill_pretrain_after_checkpoint(cwd: Path, min_step: int, timeout: float = 120) -> int:
    """Start the run, SIGKILL the worker running pretrain once step >= min_step is checkpointed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "run_parallel.py"), *ARGS],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + timeout
    killed = None
    while time.time() < deadline and killed is None and proc.poll() is None:
        for run_dir in run_dirs(cwd, "smoke"):
            ckpts = run_dir / "tasks" / f"{PRETRAIN}.checkpoints"
            steps = [
                int(m.group(1))
                for p in (ckpts.iterdir() if ckpts.is_dir() else [])
                if (m := re.match(r"step-(\d+)\.pt$", p.name))
            ]
            if steps and max(steps) >= min_step:
                tmp = next((run_dir / "tasks").glob(f".tmp-{PRETRAIN}-*"))
                killed = int(tmp.name.rsplit("-", 1)[1])
                os.kill(killed, signal.SIGKILL)
                break
        time.sleep(0.02)
    out, _ = proc.communicate(timeout=timeout)
    assert killed is not None, (
        f"the pretrain task finished before it could be killed:\n{out[-2000:]}"
    )
    assert proc.returncode == 0, out[-3000:]
    return killed


@pytest.mark.slow
def test_sigkilled_pretrain_retries_from_its_checkpoint_and_matches_an_uninterrupted_run(tmp_path):
    killed_cwd, clean_cwd = tmp_path / "killed", tmp_path / "clean"
    killed_cwd.mkdir()
    clean_cwd.mkdir()
    pid = _kill_pretrain_after_checkpoint(killed_cwd, min_step=60)
    run = run_dirs(killed_cwd, "smoke")[0]
    tasks = run / "tasks"
    assert (tasks / f".tmp-{PRETRAIN}-{pid}").is_dir()  # the dead attempt's folder, never committed
    log = (tasks / PRETRAIN / "log.txt").read_text()
    m = re.search(r"resumed from checkpoint \S+ \(step (\d+)\)", log)
    assert m and int(m.group(1)) >= 60, log[:2000]
    result = json.loads((tasks / PRETRAIN / "result.json").read_text())
    assert result["attempt"] == 2 and result["steps"] == 300
    assert not (tasks / f"{PRETRAIN}.checkpoints").exists()  # removed once the task committed

    done = run_cli(ARGS, cwd=clean_cwd)
    assert done.returncode == 0, done.stderr[-2000:]
    clean = run_dirs(clean_cwd, "smoke")[0]
    a, b = _weights(run), _weights(clean)
    assert a.keys() == b.keys()
    worst = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    assert worst <= 1e-5, f"resumed weights differ from the uninterrupted run's by {worst}"
    clean_result = json.loads((clean / "tasks" / PRETRAIN / "result.json").read_text())
    assert result["final_loss"] == pytest.approx(clean_result["final_loss"], abs=1e-5)


def test_checkpointer_keeps_only_the_newest_and_restores_rng_and_step(tmp_path):
    import random

    import torch

    from pita.training.checkpoint import Checkpointer
    from pita.training.loop import TrainStep
    from pita.training.precision import choose_precision

    def make():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, optim, TrainStep(model, optim, choose_precision("auto", False, "cpu"))

    def train(model, step, rng, n0, n1, ckpt=None):
        for i in range(n0, n1):
            x = torch.tensor([[rng.random() for _ in range(4)]])
            step.run([x], lambda mb: model(mb).pow(2).mean())
            if ckpt is not None:
                ckpt.maybe_save(
                    i + 1,
                    lambda: {"model": model, "optimizer": step.optimizer},
                    step=step,
                    extra=lambda: {"rng": rng.getstate()},
                )

    model, _, step = make()
    ckpt = Checkpointer(tmp_path / "ck", every_steps=3)
    train(model, step, random.Random(1), 0, 7, ckpt)
    assert [p.name for p in (tmp_path / "ck").iterdir()] == ["step-6.pt"]  # atomic, only the newest
    reference = {k: v.clone() for k, v in model.state_dict().items()}

    model2, optim2, step2 = make()
    start, extra = Checkpointer(tmp_path / "ck", every_steps=3).restore(
        model=model2, optimizer=optim2, step=step2
    )
    assert start == 6 and step2.step == 6 and len(step2.metrics.rows) == 6
    rng = random.Random()
    rng.setstate(extra["rng"])
    train(model2, step2, rng, start, 7)
    for k, v in model2.state_dict().items():
        assert torch.equal(v, reference[k])


GRPO_TRAIN = "GRPO.goal_walk.tiny.r0.train"


@pytest.mark.slow
def test_sigkilled_grpo_retry_resumes_from_the_last_committed_trainer_checkpoint(tmp_path):
    """TRL stages: Trainer checkpoints count once pita_complete.json is written after them;
    the retry passes the newest to resume_from_checkpoint and trains only the rest."""
    args = [
        "experiment=smoke",
        "algos=[GRPO]",
        "algos.GRPO.steps=30",
        "training.checkpoint_every=5",
        "executor.progress=false",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "run_parallel.py"), *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    killed_at, deadline = None, time.time() + 240
    while killed_at is None and proc.poll() is None and time.time() < deadline:
        for marker in tmp_path.glob(
            f"outputs/smoke/*/tasks/{GRPO_TRAIN}.checkpoints/checkpoint-*/pita_complete.json"
        ):
            step = int(marker.parent.name.split("-")[1])
            if step >= 10:
                tmp = next(marker.parents[2].glob(f".tmp-{GRPO_TRAIN}-*"))
                os.kill(int(tmp.name.rsplit("-", 1)[1]), signal.SIGKILL)
                killed_at = step
                break
        time.sleep(0.01)
    out, _ = proc.communicate(timeout=300)
    assert killed_at is not None, out[-2000:]
    assert proc.returncode == 0, out[-3000:]
    task = run_dirs(tmp_path, "smoke")[0] / "tasks" / GRPO_TRAIN
    m = re.search(
        r"resumed from checkpoint \S+checkpoint-(\d+) \(step \d+\)", (task / "log.txt").read_text()
    )
    assert (
        m and int(m.group(1)) >= killed_at
    )  # the newest committed one (a later half-written one is dropped)
    result = json.loads((task / "result.json").read_text())
    assert result["attempt"] == 2 and result["steps"] == 30
    logged = [
        json.loads(line)["step"] for line in (task / "train_log.jsonl").read_text().splitlines()
    ]
    assert (
        min(logged) > int(m.group(1)) and max(logged) == 30
    )  # the retry trained only the remaining steps
    assert not (task.parent / f"{GRPO_TRAIN}.checkpoints").exists()
