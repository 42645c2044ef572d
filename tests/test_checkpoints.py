"""In-task checkpoints: a training task killed mid-way continues from its checkpoint."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from pita.training.checkpoint import COMPLETE
from tests.conftest import only, run_cli_later, run_dirs, start_cli

PRETRAIN = "pretrain.goal_walk.tiny"
# One CPU worker and 8 test prompts in every run here: what is checked is one task's resume,
# which neither a second worker (its own torch import) nor the evaluation's size changes.
ONE_WORKER = ["executor.cpu_workers=1", "dataset.test_size=8"]
ARGS = [
    "experiment=smoke",
    *only("reference"),
    "pretrain.steps=120",
    "training.checkpoint_every=20",
    "executor.progress=false",
    "executor.max_retries=2",
    *ONE_WORKER,
]


def _weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "tasks" / PRETRAIN / "model" / "model.safetensors"))


def _kill_pretrain_after_checkpoint(cwd: Path, min_step: int, timeout: float = 120) -> int:
    """Start the run, SIGKILL the worker running pretrain once step >= min_step is checkpointed."""
    proc = start_cli(ARGS, cwd)
    deadline = time.time() + timeout
    killed = None
    while time.time() < deadline and killed is None and proc.poll() is None:
        for run_dir in run_dirs(cwd, "smoke"):
            ckpts = run_dir / "tasks" / f"{PRETRAIN}.checkpoints"
            steps = [
                int(m.group(1))
                for p in (ckpts.iterdir() if ckpts.is_dir() else [])
                if (m := re.match(r"step-(\d+)$", p.name))
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
    clean_run = run_cli_later(ARGS, cwd=clean_cwd)  # the uninterrupted one, at the same time
    pid = _kill_pretrain_after_checkpoint(killed_cwd, min_step=40)
    run = run_dirs(killed_cwd, "smoke")[0]
    tasks = run / "tasks"
    assert (tasks / f".tmp-{PRETRAIN}-{pid}").is_dir()  # the dead attempt's folder, never committed
    log = (tasks / PRETRAIN / "log.txt").read_text()
    m = re.search(r"resumed from checkpoint \S+ \(step (\d+)\)", log)
    assert m and int(m.group(1)) >= 40, log[:2000]
    result = json.loads((tasks / PRETRAIN / "result.json").read_text())
    assert result["attempt"] == 2 and result["steps"] == 120
    assert not (tasks / f"{PRETRAIN}.checkpoints").exists()  # removed once the task committed

    done = clean_run.result()
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
    assert [p.name for p in (tmp_path / "ck").iterdir()] == ["step-6"]  # atomic, only the newest
    assert {p.name for p in (tmp_path / "ck" / "step-6").iterdir()} == {
        "manifest.json",
        "state.json",
        "tensors.safetensors",
    }  # tensors and JSON: no pickle
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


# --- faithful TRL resume: killed after every checkpoint boundary ---------------------------

# Two steps each, so a kill after the first checkpoint resumes mid-training and the retry
# writes the last checkpoint itself (a resumed attempt's checkpoint is then resumed from).
# Both chains run in one run, one worker: a task at a time, one pretrain, one pair of runs.
TRL_ALGOS = ("GRPO", "DPO")
TRL_ARGS = [
    "experiment=smoke",
    f"algos=[{','.join(TRL_ALGOS)}]",
    # pretrain checkpoints every step too: a short one, but long enough that GRPO's groups
    # hold both rewards (at 20 steps every sample failed: zero advantage, no weight moved)
    "pretrain.steps=40",
    "algos.GRPO.steps=2",
    # one epoch of DPO's pairs (56) in two whole batches of 28 (an epoch draws whole global
    # batches only: pita.algos.trl_common.whole_batches)
    "data_collection.max_examples=10",
    "algos.DPO.batch_size=28",
    "training.checkpoint_every=1",
    "executor.progress=false",
    "executor.max_retries=12",
    *ONE_WORKER,
]
# values of a run that are times, not results (TRL's and pita's own clocks)
_CLOCKS = (
    "elapsed_s",
    "runtime",
    "per_second",
    "time",
    "wall_s",
    "cpu_s",
    "first_step_s",
    "performance",
    "attempt",
)
_PATHS = ("start",)  # where the run folder is


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _kill_at_every_boundary(cwd: Path, timeout: float = 420) -> dict[str, list[int]]:
    """Run both TRL chains; each time a new Trainer checkpoint of a train task is committed,
    SIGKILL the worker training it (the retry resumes from that checkpoint).
    -> {algo: the steps its train task was killed at}."""
    proc = start_cli(TRL_ARGS, cwd)
    killed: dict[str, list[int]] = {algo: [] for algo in TRL_ALGOS}
    pids: set[int] = set()
    deadline = time.time() + timeout
    while proc.poll() is None and time.time() < deadline:
        for algo in TRL_ALGOS:
            task = f"{algo}.goal_walk.tiny.r0.train"
            pattern = f"outputs/smoke/*/tasks/{task}.checkpoints/checkpoint-*/{COMPLETE}"
            for marker in cwd.glob(pattern):
                step = int(marker.parent.name.split("-")[1])
                tasks = marker.parents[2]
                live = [
                    int(p.name.rsplit("-", 1)[1])
                    for p in tasks.glob(f".tmp-{task}-*")
                    if int(p.name.rsplit("-", 1)[1]) not in pids
                ]
                live = [pid for pid in live if _alive(pid)]
                if step not in killed[algo] and live:
                    os.kill(live[0], signal.SIGKILL)
                    pids.add(live[0])
                    killed[algo].append(step)
        time.sleep(0.005)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out[-3000:]
    return killed


@pytest.fixture(scope="module")
def trl_kill_runs(tmp_path_factory) -> tuple[dict[str, list[int]], Path, Path]:
    """The run killed at every checkpoint boundary and the uninterrupted one, run at once:
    (steps killed at per algo, the killed run's folder, the clean run's folder)."""
    root = tmp_path_factory.mktemp("trl_kills")
    killed_cwd, clean_cwd = root / "killed", root / "clean"
    killed_cwd.mkdir()
    clean_cwd.mkdir()
    clean_run = run_cli_later(TRL_ARGS, clean_cwd, timeout=420)  # meanwhile
    killed = _kill_at_every_boundary(killed_cwd)
    done = clean_run.result()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return killed, run_dirs(killed_cwd, "smoke")[0], run_dirs(clean_cwd, "smoke")[0]


def _results(run_dir: Path, algo: str) -> dict[str, dict]:
    """The committed result.json of the chain's tasks, clocks left out."""

    def strip(obj):
        if isinstance(obj, dict):
            return {
                k: strip(v)
                for k, v in obj.items()
                if k not in _PATHS and not any(c in k for c in _CLOCKS)
            }
        if isinstance(obj, list):
            return [strip(v) for v in obj]
        return obj

    return {
        p.name: strip(json.loads((p / "result.json").read_text()))
        for p in (run_dir / "tasks").iterdir()
        if p.name.startswith(algo) and (p / "result.json").is_file()
    }


def _train_log(run_dir: Path, algo: str) -> list[dict]:
    path = run_dir / "tasks" / f"{algo}.goal_walk.tiny.r0.train" / "train_log.jsonl"
    return [
        {k: v for k, v in json.loads(line).items() if not any(c in k for c in _CLOCKS)}
        for line in path.read_text().splitlines()
    ]


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize("algo", TRL_ALGOS)
def test_trl_stage_killed_after_every_checkpoint_resumes_faithfully(trl_kill_runs, algo):
    """Killed after each checkpoint boundary (the last one included: a resume there must
    not train one step past max_steps), each retry resumes from the newest committed Trainer
    checkpoint (pita_complete.json written after it) and runs exactly the remaining steps,
    its train_log.jsonl holds every step once, the checkpoints are removed once the task
    commits, and what it commits equals an uninterrupted run's: the trained weights bit for
    bit (and moved from π_ref's, so the comparison can fail), the task results and the
    logged metrics."""
    from safetensors.torch import load_file

    killed_at, run, clean = trl_kill_runs
    task = f"{algo}.goal_walk.tiny.r0.train"
    steps = json.loads((clean / "tasks" / task / "result.json").read_text())["steps"]
    killed = killed_at[algo]
    assert steps == 2 and killed == [1, 2], f"killed at {killed}, {steps} steps"
    result = json.loads((run / "tasks" / task / "result.json").read_text())
    assert result["attempt"] == steps + 1 and result["steps"] == steps
    log = (run / "tasks" / task / "log.txt").read_text()
    resumed = [int(s) for s in re.findall(r"resumed from checkpoint \S+ \(step (\d+)\)", log)]
    assert resumed == [steps]  # the task log is the last attempt's: it resumed at the end
    logged = _train_log(run, algo)
    # every step once (the lines up to a checkpoint are replayed from it), then TRL's summary
    assert [r["step"] for r in logged if "loss" in r] == list(range(1, steps + 1))
    assert logged == _train_log(clean, algo)
    assert not (run / "tasks" / f"{task}.checkpoints").exists()  # removed on commit
    assert _results(run, algo) == _results(clean, algo)
    a = load_file(str(run / "tasks" / task / "model" / "model.safetensors"))
    b = load_file(str(clean / "tasks" / task / "model" / "model.safetensors"))
    assert a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)
    ref = load_file(str(clean / "tasks" / PRETRAIN / "model" / "model.safetensors"))
    moved = [k for k in a.keys() & ref.keys() if not bool((a[k] == ref[k]).all())]
    assert moved, "training moved no weight"


def test_checkpoint_state_is_tensors_and_json_and_round_trips_every_loop_state(tmp_path):
    """What the loops store (optimizer with int keys and tuples, a transformers schedule, a
    GradScaler, value training's shuffled order and torch.Generator, metric rows with NaN)
    comes back equal from safetensors + JSON; no pickle is written."""
    import math

    import torch
    from transformers import get_cosine_schedule_with_warmup

    from pita.training.checkpoint import load_state, save_state

    model = torch.nn.Linear(3, 2)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = get_cosine_schedule_with_warmup(optim, 2, 10)
    model(torch.randn(4, 3)).sum().backward()
    optim.step()
    sched.step()
    gen = torch.Generator().manual_seed(3)
    state = {
        "optimizer": optim.state_dict(),
        "scheduler": sched.state_dict(),
        "scaler": torch.amp.GradScaler("cpu", enabled=True).state_dict(),
        "extra": {"order": torch.randperm(10, generator=gen), "cursor": 4, "gen": gen.get_state()},
        "rows": [{"loss": float("nan"), "lr": 1e-3}],
    }
    save_state(tmp_path, state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json", "tensors.safetensors"]
    back = load_state(tmp_path)
    optim2 = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters(), lr=1e-3)
    optim2.load_state_dict(back["optimizer"])
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)
    for k, v in optim.state_dict()["state"][0].items():
        assert torch.equal(v, back["optimizer"]["state"][0][k])
    assert back["scheduler"] == sched.state_dict() and back["scaler"]["scale"] == 65536.0
    again = torch.Generator()
    again.set_state(back["extra"]["gen"])
    assert torch.equal(torch.randperm(10, generator=again), torch.randperm(10, generator=gen))
    assert math.isnan(back["rows"][0]["loss"]) and back["extra"]["cursor"] == 4


VALUE_TRAIN = "QSharp.goal_walk.tiny.r0.train"
VALUE_ARGS = [
    "experiment=smoke",
    "algos=[QSharp]",
    "training.checkpoint_every=5",
    "executor.progress=false",
    *ONE_WORKER,
]


@pytest.mark.long
@pytest.mark.slow
def test_sigkilled_value_training_resumes_from_its_checkpoint_like_an_uninterrupted_run(tmp_path):
    """Value training (the guide's loop, pita's own checkpoints: shuffled order, cursor,
    torch.Generator) killed after a checkpoint commits the same value model bit for bit."""
    from safetensors.torch import load_file

    killed_cwd, clean_cwd = tmp_path / "killed", tmp_path / "clean"
    killed_cwd.mkdir()
    clean_cwd.mkdir()
    clean_run = run_cli_later(VALUE_ARGS, cwd=clean_cwd)  # the uninterrupted one, meanwhile
    proc = start_cli(VALUE_ARGS, killed_cwd)
    killed, deadline = None, time.time() + 240
    while killed is None and proc.poll() is None and time.time() < deadline:
        for manifest in killed_cwd.glob(
            f"outputs/smoke/*/tasks/{VALUE_TRAIN}.checkpoints/step-*/manifest.json"
        ):
            tmp = next(manifest.parents[2].glob(f".tmp-{VALUE_TRAIN}-*"))
            os.kill(int(tmp.name.rsplit("-", 1)[1]), signal.SIGKILL)
            killed = int(manifest.parent.name.split("-")[1])
            break
        time.sleep(0.005)
    out, _ = proc.communicate(timeout=240)
    assert killed is not None, out[-2000:]
    assert proc.returncode == 0, out[-3000:]
    done = clean_run.result()
    assert done.returncode == 0, done.stderr[-2000:]
    run, clean = run_dirs(killed_cwd, "smoke")[0], run_dirs(clean_cwd, "smoke")[0]
    task = run / "tasks" / VALUE_TRAIN
    m = re.search(r"resumed from checkpoint \S+ \(step (\d+)\)", (task / "log.txt").read_text())
    assert m and int(m.group(1)) >= killed
    assert json.loads((task / "result.json").read_text())["attempt"] == 2
    a = load_file(str(task / "value_model" / "model.safetensors"))
    b = load_file(str(clean / "tasks" / VALUE_TRAIN / "value_model" / "model.safetensors"))
    assert a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)


def _tiny_model_and_adam(seed: int, tied: bool = False):
    import torch
    from transformers import LlamaForCausalLM

    from tests.archs import llama

    torch.manual_seed(seed)
    config = llama(16, 16, 32, 1, 2, 2, tie_word_embeddings=tied)
    model = LlamaForCausalLM(config)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


@pytest.mark.parametrize("files, tied", [(1, False), (8, False), (1, True)])
def test_a_sharded_checkpoint_round_trips_the_model_and_the_optimizer_on_one_process(
    tmp_path, monkeypatch, files, tied
):
    """`ShardedState` on one process (FSDP2's format at k=1, no process group), its shards
    in one file or cut into 8 or more (`shards.FILES`: what a large model's rank writes),
    tied embeddings written once: the model and every optimizer entry come back exactly,
    param groups by JSON."""
    import torch

    import pita.training.shards as shards
    from pita.training.checkpoint import Checkpointer
    from pita.training.shards import ShardedState

    if files > 1:
        monkeypatch.setattr(shards, "MIN_FILE", 0)  # this tiny state cut as a large one is

    model, optim = _tiny_model_and_adam(0, tied)
    ids = torch.randint(0, 16, (2, 8))
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        optim.step()
        optim.zero_grad()
    saved = {"model": ShardedState(model), "optimizer": ShardedState(model, optim)}
    Checkpointer(tmp_path, 1).maybe_save(2, lambda: saved)
    written = len(list(tmp_path.glob("step-2/shards/*.safetensors")))
    assert written == 1 if files == 1 else written >= files, written
    fresh, fresh_optim = _tiny_model_and_adam(1, tied)
    restored = {"model": ShardedState(fresh), "optimizer": ShardedState(fresh, fresh_optim)}
    assert Checkpointer(tmp_path, 1).restore(max_step=4, **restored)[0] == 2
    a, b = model.state_dict(), fresh.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    sa, sb = optim.state_dict(), fresh_optim.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for i, entry in sa["state"].items():
        assert all(torch.equal(v, sb["state"][i][k]) for k, v in entry.items())


def test_without_torch_s_safetensors_storage_fsdp_gathers_and_says_so_once(tmp_path, monkeypatch):
    """A torch without `hf_storage`: a sharded plan falls back to the gathered full state,
    and the task log says so in one line."""
    import logging

    import pita.training.shards as shards
    from pita.training.checkpoint import CheckpointPlan
    from pita.training.ddp import FullState

    monkeypatch.setattr(shards, "hf_storage", lambda: None)
    plan = CheckpointPlan(tmp_path, 1, by_name=True, sharded=True)
    lines: list[str] = []
    logger = logging.getLogger("test.ckpt.fallback")
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    plan.checkpointer(logger)
    model, optim = _tiny_model_and_adam(0)
    assert all(isinstance(o, FullState) for o in plan.objects(model, optim))
    assert len([ln for ln in lines if "no safetensors storage" in ln]) == 1, lines
