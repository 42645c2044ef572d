"""Data parallel training on the CPU: 2 gloo processes, each on half the batch, step like
one process on the whole batch (same init, same data)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pita.training.ddp import DataParallelError, apply_gang, launch_ranks, shard_indices
from pita.training.loop import TrainStep, split_batch
from pita.training.precision import choose_precision

STEPS, BATCH, LR = 3, 8, 0.1


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 1, generator=g)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _train(dist, micro: int) -> dict[str, torch.Tensor]:
    """SGD for a few steps; with `dist`, on this rank's shard of every batch (module level:
    the spawned ranks import it)."""
    model = _model()
    net = apply_gang(model, dist)
    step = TrainStep(
        net, torch.optim.SGD(model.parameters(), lr=LR), choose_precision("auto", True, "cpu")
    )
    for s in range(STEPS):
        x, y = _data(s)
        if dist is not None:
            idx = dist.shard(BATCH)
            x, y = x[idx], y[idx]
            dist.log(f"step {s} on {len(idx)} examples")
        step.run(
            split_batch((x, y), micro), lambda mb: torch.nn.functional.mse_loss(net(mb[0]), mb[1])
        )
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _fail_on_rank_one(dist) -> None:
    if dist.rank == 1:
        raise ValueError("rank one is broken")
    dist.barrier()  # rank 0 waits for a peer that never comes: it must be stopped, not hang


def test_shard_indices_are_strided_and_padded():
    assert shard_indices(8, 0, 2) == [0, 2, 4, 6] and shard_indices(8, 1, 2) == [1, 3, 5, 7]
    shards = [shard_indices(7, r, 3) for r in range(3)]
    assert all(len(s) == 3 for s in shards)  # padded to equal shares
    assert sorted({i for s in shards for i in s}) == list(range(7))


def test_world_size_follows_the_task_gang_and_gpu_mode():
    """The worker reads the task's gang (set by the planner), never the config key."""
    from types import SimpleNamespace

    from pita.core.parallel import Gang, Strategy
    from pita.runtime.gang import gang_world_size

    def ctx(gang, gpu_mode="auto"):  # the typed settings a StageContext holds
        return SimpleNamespace(
            system=SimpleNamespace(gpu_mode=gpu_mode), device="cpu", task=SimpleNamespace(gang=gang)
        )

    assert gang_world_size(ctx(Gang())) == 1
    assert gang_world_size(ctx(Gang(Strategy.DDP, 2))) == 2  # a fake / CPU gang: 2 gloo ranks
    assert gang_world_size(ctx(Gang(Strategy.FSDP, 2))) == 2
    assert gang_world_size(ctx(Gang(Strategy.DDP, 1))) == 1
    assert gang_world_size(ctx(Gang(Strategy.DDP, 2), "single_gpu")) == 1
    assert gang_world_size(ctx(Gang(Strategy.DDP, 2), "cpu")) == 1


def test_ddp_on_two_gloo_processes_matches_one_process_on_the_full_batch():
    single = _train(None, micro=BATCH)
    messages: list[tuple[str, int, object]] = []
    # Each rank: half the batch, in 2 accumulated micro-batches of 2 (no_sync until the last).
    ranks = launch_ranks(
        _train,
        2,
        args=(2,),
        backend="gloo",
        device_type="cpu",
        on_message=lambda kind, rank, payload: messages.append((kind, rank, payload)),
    )
    assert len(ranks) == 2
    moved = max((single[k] - _model().state_dict()[k]).abs().max().item() for k in single)
    assert moved > 1e-3  # training changed the weights
    for k in single:
        torch.testing.assert_close(ranks[0][k], ranks[1][k], atol=0, rtol=0)  # ranks stay in sync
        torch.testing.assert_close(ranks[0][k], single[k], atol=1e-6, rtol=1e-5)
    assert {(rank, payload[1]) for kind, rank, payload in messages if kind == "log"} == {
        (r, f"step {s} on 4 examples") for r in range(2) for s in range(STEPS)
    }


def test_a_failing_rank_raises_with_its_error():
    with pytest.raises(DataParallelError, match=r"rank 1 of 2 failed: .*rank one is broken") as e:
        launch_ranks(_fail_on_rank_one, 2, backend="gloo", device_type="cpu", timeout_s=60)
    assert not e.value.startup  # the gang had formed: the stage's failure, not retried


def test_a_gang_that_fails_to_form_is_started_once_more(tmp_path):
    """Rank 1 dies inside its first init_process_group: the rendezvous fails before any step,
    a start-up fault; the launcher starts the gang once more (noted in the task log) and the
    task goes on."""
    proc = _gang_process("startup_fault", tmp_path)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0
    report = json.loads(out.strip().splitlines()[-1])
    assert (tmp_path / "rank1-died").exists()  # the first gang really lost a rank
    assert [r["sum"] for r in report["ranks"]] == [3.0, 3.0]  # the second gang formed
    assert len(report["notes"]) == 1
    assert report["notes"][0].startswith("gang start-up fault (rank 1 of 2 failed")


@pytest.mark.slow
def test_pretrain_data_parallel_on_a_two_device_gang_matches_one_process(tmp_path):
    """The production path: run_stage rebuilds a StageContext per rank, forwards its log."""
    import logging

    from safetensors.torch import load_file

    from pita.stages.pretrain import pretrain
    from tests.test_training_stack import pretrain_context

    single = pretrain_context(tmp_path / "single")
    pretrain(single)
    gang = pretrain_context(tmp_path / "gang", gpus=2, parallel_strategy="data_parallel")
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    gang.logger.addHandler(handler)
    gang.logger.setLevel(logging.INFO)
    result = pretrain(gang)

    assert result["effective_batch"] == 16
    assert any("DDP over 2 ranks" in ln for ln in lines) and any(
        ln.startswith("step 4/4 loss") for ln in lines
    )
    assert (
        "x 2 rank(s) = effective batch 16" in (gang.out_dir / "performance_summary.txt").read_text()
    )
    a = load_file(single.out_dir / "model" / "model.safetensors")
    b = load_file(gang.out_dir / "model" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=2e-5, rtol=1e-4)


# --- the launcher (torch's elastic_launch): failures, collisions, orphans --------------------


def _oom_on_rank_one(dist) -> None:
    if dist.rank == 1:
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    dist.barrier()


def test_an_out_of_memory_rank_is_named_and_classified_oom():
    from pita.runtime.oom import classify_exception

    with pytest.raises(DataParallelError, match=r"rank 1 of 2 failed: RuntimeError: CUDA out") as e:
        launch_ranks(_oom_on_rank_one, 2, backend="gloo", device_type="cpu", timeout_s=60)
    assert classify_exception(e.value) == "oom"


def _gang_process(mode: str, folder) -> subprocess.Popen:
    from tests.conftest import ROOT

    return subprocess.Popen(
        [sys.executable, "-m", "tests.gang_processes", mode, str(folder)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def test_two_gangs_starting_at_once_rendezvous_on_distinct_ports(tmp_path):
    procs = [_gang_process("ports", tmp_path) for _ in range(2)]
    outs = [json.loads(p.communicate(timeout=300)[0].strip().splitlines()[-1]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert all(r["sum"] == 3.0 for out in outs for r in out)  # each gang reduced its own ranks
    ports = [out[0]["port"] for out in outs]
    assert all(out[0]["port"] == out[1]["port"] for out in outs) and ports[0] != ports[1]


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie (/proc/<pid>/stat's state)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.parametrize("killed", ["worker", "orchestrator"])
def test_no_rank_outlives_a_sigkilled_worker_or_orchestrator(tmp_path, killed):
    """The ranks (PR_SET_PDEATHSIG SIGKILL, parent: the worker's forkserver) die with the
    worker; the worker dies with the orchestrator (SIGTERM), and its ranks with it."""
    proc = _gang_process("hang" if killed == "worker" else "orchestrator", tmp_path)
    deadline = time.time() + 240
    while len(list(tmp_path.glob("rank*.pid"))) < 2 and time.time() < deadline:
        assert proc.poll() is None, "the launcher exited before its ranks started"
        time.sleep(0.1)
    ranks = [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]
    assert len(ranks) == 2 and all(_alive(pid) for pid in ranks)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    if killed == "orchestrator":  # the worker stops its ranks on SIGTERM, then exits
        ranks.append(int((tmp_path / "worker.pid").read_text()))
    deadline = time.time() + 60
    while any(_alive(pid) for pid in ranks) and time.time() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in ranks if _alive(pid)], "a rank (or the worker) outlived its launcher"
