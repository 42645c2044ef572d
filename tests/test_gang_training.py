"""pita's own training loops on a k-rank gang (issue 31 item 2): the value trainer (Q#'s
train stage) and pretrain under `training.parallel_strategy=data_parallel` (DDP) and `fsdp`
(FSDP2) on 2 gloo ranks match one process on the same global batch: loss curve, final
weights (within TOL) and the results row."""

from __future__ import annotations

import dataclasses
import json
import logging
import random
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from pita.experiment import cli
from pita.experiment.run import build_plan, make_gpu_manager
from tests.conftest import only

# Float reduction order (gloo's all-reduce / reduce-scatter vs one process' sum) is all that
# differs: measured ~1e-7 on these sizes.
TOL = 1e-5
PRETRAIN, TRAIN = "pretrain.goal_walk.tiny", "QSharp.goal_walk.tiny.r0.train"
# the row's fields that are timings or memory, not results
TIMING = {"train_s", "samples_per_s", "peak_memory_mb", "tokens_per_s"}


def _plan(strategy: str, *more: str):
    cfg = cli.compose_config(
        [
            "experiment=smoke",
            "logger=csv",  # every step's loss in logs/csv/<task>.csv
            "system.devices=fake:2",
            f"training.parallel_strategy={strategy}",
            "algos.QSharp.steps=6",
            "algos.QSharp.batch_size=12",
            "algos.QSharp.holdout_fraction=0.25",
            "algos.QSharp.probe_steps=0",
            "pretrain.steps=6",
            "pretrain.batch_size=16",
            *only("QSharp"),
            *more,
        ]
    )
    return cfg, build_plan(cfg, make_gpu_manager(cfg))


def _context(run_dir: Path, strategy: str, task_id: str, gpus: int, name: str, *more: str):
    from pita.runtime.context import ModelCache, StageContext, chain_config

    cfg, plan = _plan(strategy, *more)
    task = dataclasses.replace(plan.tasks[task_id], gpus=gpus)
    out = run_dir / name
    out.mkdir(parents=True)
    logger = logging.getLogger(f"test.gang.{name}.{random.random()}")
    logger.setLevel(logging.INFO)
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger.addHandler(handler)
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    ctx = StageContext(
        task=task,
        cfg=chain_config(cfg_dict, task),
        run_dir=run_dir,
        out_dir=out,
        logger=logger,
        models=ModelCache(1),
        chain_merged=True,
    )
    return ctx, lines


def with_pi_ref(run: Path) -> Path:
    """`run` holding a committed tiny π_ref (one process) for the value trainer."""
    from pita.stages.pretrain import pretrain

    ctx, _ = _context(run, "none", PRETRAIN, 1, f"tasks/{PRETRAIN}")
    pretrain(ctx)
    return run


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return with_pi_ref(tmp_path_factory.mktemp("gang"))


def _items(n: int = 40, seed: int = 0) -> list[tuple]:
    """Value-training items (prompt, response, first trained index, target, alt) over the
    tiny tokenizer's ids."""
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(3, 11) for _ in range(4)],
            [rng.randrange(3, 11) for _ in range(rng.randrange(2, 5))],
            0,
            [float(rng.random() < 0.5)],
            None,
        )
        for _ in range(n)
    ]


def _value_train(run_dir: Path, strategy: str, gpus: int, name: str, *more: str):
    """The train stage in its own run folder (its own csv), reading the shared π_ref."""
    import shutil

    own = run_dir / name
    shutil.copytree(run_dir / "tasks", own / "tasks")
    return value_train_in(own, strategy, gpus, *more)


def value_train_in(own: Path, strategy: str, gpus: int, *more: str):
    """The train stage in the run folder `own` (π_ref committed there) on `gpus` ranks."""
    from pita.algos.value_training import train_value

    ctx, lines = _context(own, strategy, TRAIN, gpus, "out", *more)
    result = train_value(ctx, _items())
    return ctx, result, lines


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder))


def _losses(ctx) -> list[float]:
    """Every step's loss (the csv tracker's rows: rank 0 logs the mean over the ranks)."""
    import csv

    [path] = (ctx.run_dir / "logs").rglob(f"{ctx.task.id}.csv")
    with open(path, newline="") as f:
        return [float(r["train/loss"]) for r in csv.DictReader(f)]


def _row(result: dict) -> dict:
    """The results row without timings, nested figures flattened (held-out accuracy)."""
    flat: dict = {}
    for key, value in result.items():
        if isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        elif key not in TIMING:
            flat[key] = value
    return flat


def _assert_same(single, gang, weights_file: str, curve: bool = True) -> None:
    (ctx1, row1, _), (ctx2, row2, _) = single, gang
    assert _row(row1) == pytest.approx(_row(row2), abs=TOL)
    if curve:  # (a resumed task's csv holds the dead attempt's rows too)
        curve1, curve2 = _losses(ctx1), _losses(ctx2)
        assert len(curve1) >= 2 and curve1 == pytest.approx(curve2, abs=TOL)
    a, b = _weights(ctx1.out_dir / weights_file), _weights(ctx2.out_dir / weights_file)
    assert a.keys() == b.keys()
    moved = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert moved <= TOL, f"2 ranks' weights differ from one process' by {moved}"


@pytest.fixture(scope="module")
def value_single(run_dir):
    return _value_train(run_dir, "none", 1, "single")


@pytest.fixture(scope="module")
def pretrain_single(tmp_path_factory):
    from pita.stages.pretrain import pretrain

    ctx, lines = _context(tmp_path_factory.mktemp("single"), "none", PRETRAIN, 1, "out")
    return ctx, pretrain(ctx), lines


@pytest.mark.parametrize("strategy", ["data_parallel", "fsdp"])
def test_value_training_on_two_ranks_matches_one_process(run_dir, value_single, strategy):
    single = value_single
    gang = _value_train(run_dir, strategy, 2, f"gang-{strategy}")
    what = "DDP" if strategy == "data_parallel" else "FSDP2"
    assert any(f"{what}" in ln and "over 2 ranks" in ln for ln in gang[2]), gang[2][:5]
    assert gang[1]["batch_size"] == single[1]["batch_size"] == 12
    _assert_same(single, gang, "value_model/model.safetensors")


@pytest.mark.parametrize("strategy", ["data_parallel", "fsdp"])
def test_pretrain_on_two_ranks_matches_one_process(tmp_path, pretrain_single, strategy):
    from pita.stages.pretrain import pretrain

    ctx, lines = _context(tmp_path, strategy, PRETRAIN, 2, "out")
    runs = [pretrain_single, (ctx, pretrain(ctx), lines)]
    assert runs[1][1]["effective_batch"] == runs[0][1]["effective_batch"] == 16
    assert "x 2 rank(s)" in (runs[1][0].out_dir / "performance_summary.txt").read_text()
    _assert_same(runs[0], runs[1], "model/model.safetensors")
    if strategy == "fsdp":  # consolidated from the ranks' shards, never gathered
        _is_the_same_hf_folder(runs[0][0].out_dir / "model", runs[1][0].out_dir / "model")


def _is_the_same_hf_folder(single: Path, sharded: Path) -> None:
    """The FSDP2 gang's model folder (shards merged file by file) holds what one process'
    `save_pretrained` writes, and `from_pretrained` loads it."""
    from transformers import AutoModelForCausalLM

    assert sorted(p.name for p in sharded.iterdir()) == sorted(p.name for p in single.iterdir())
    assert not list(sharded.parent.glob(".*shards*")), "the ranks' shards were left behind"
    config = [json.loads((f / "config.json").read_text()) for f in (single, sharded)]
    assert config[0] == config[1]
    model = AutoModelForCausalLM.from_pretrained(sharded)
    loaded = model.state_dict()
    weights = _weights(sharded / "model.safetensors")
    assert all(torch.equal(loaded[k], weights[k]) for k in weights)


CHECKPOINTED = ("training.checkpoint_every=2",)


def _killed_two_rank_task(run_dir: Path, tmp_path: Path, strategy: str) -> Path:
    """A run folder whose 2-rank value-training task was SIGKILLed once a checkpoint was
    committed (its checkpoints folder kept, its output removed)."""
    import os
    import shutil
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import ROOT

    killed = tmp_path / "killed"
    shutil.copytree(run_dir / "tasks", killed / "tasks")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.gang_processes", "value", str(killed), strategy],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    ckpts = killed / "tasks" / f"{TRAIN}.checkpoints"
    deadline = time.time() + 300
    while not list(ckpts.glob("step-*/manifest.json")) and time.time() < deadline:
        assert proc.poll() is None, "the task ended before a checkpoint"
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert not (killed / "out" / "value_model").exists(), "killed too late: the task finished"
    shutil.rmtree(killed / "out")
    return killed


def _resumes_like_the_uninterrupted_run(
    killed: Path, tmp_path: Path, value_single, strategy: str, ranks: tuple[int, ...]
) -> None:
    """The killed task's checkpoint resumes on each k of `ranks` with the numbers of the
    uninterrupted run. Its files: DDP, every tensor in full by parameter name (rank 0's
    tensors.safetensors); FSDP2, each rank's shards (shards/*.safetensors, no DCP
    `.metadata` pickle) beside rank 0's tensors and JSON."""
    import shutil

    ckpts = killed / "tasks" / f"{TRAIN}.checkpoints"
    manifest = json.loads(next(ckpts.glob("step-*/manifest.json")).read_text())
    files = set(manifest["files"])
    assert {"tensors.safetensors", "state.json"} <= files
    if strategy == "fsdp":
        shards = files - {"tensors.safetensors", "state.json"}
        assert len(shards) == 2 and all(
            f.startswith("shards/") and f.endswith(".safetensors") for f in shards
        ), files
    else:
        assert files == {"tensors.safetensors", "state.json"}
    for k in ranks:
        resumed = tmp_path / f"resumed-{k}"
        shutil.copytree(killed, resumed)
        ctx, result, lines = value_train_in(resumed, strategy, k, *CHECKPOINTED)
        assert any(ln.startswith("resumed from checkpoint") for ln in lines), lines
        _assert_same(
            value_single, (ctx, result, lines), "value_model/model.safetensors", curve=False
        )


@pytest.mark.parametrize(
    "strategy",
    [
        pytest.param("data_parallel", marks=[pytest.mark.slow, pytest.mark.long]),
        pytest.param("fsdp", marks=[pytest.mark.slow, pytest.mark.long]),
    ],
)
def test_a_killed_two_rank_task_resumes_on_two_and_on_one_rank(
    run_dir, value_single, tmp_path, strategy
):
    """SIGKILL a 2-rank value-training task once a checkpoint is committed; the checkpoint
    resumes on 2 ranks and on 1 (the ranks left after a node loss) with the numbers of the
    uninterrupted run."""
    killed = _killed_two_rank_task(run_dir, tmp_path, strategy)
    _resumes_like_the_uninterrupted_run(killed, tmp_path, value_single, strategy, (2, 1))


@pytest.mark.long
@pytest.mark.slow
def test_a_killed_two_rank_fsdp_task_resumes_on_four_ranks(run_dir, value_single, tmp_path):
    """The 2 ranks' shards resharded over 4 gloo ranks (DCP reads each rank's part of
    every shard): the numbers of the uninterrupted run."""
    killed = _killed_two_rank_task(run_dir, tmp_path, "fsdp")
    _resumes_like_the_uninterrupted_run(killed, tmp_path, value_single, "fsdp", (4,))
