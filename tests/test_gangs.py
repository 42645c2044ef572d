"""Issue 31 item 3: training estimates per strategy, the smallest FSDP gang a too-large
training task gets, and the one-line refusal when no gang fits (a TRL stage on CPU included).

The models here are the tiny family's, sized by `model.*_arch` (no file is read); the
end-to-end run with a saved local family is in tests/test_gang_e2e.py.
"""

from __future__ import annotations

import pytest

from pita.core.errors import ConfigError
from pita.experiment import cli
from pita.experiment.estimates import MB, WORKER_OVERHEAD_MB, ModelSizes, TrainingMemory
from pita.experiment.run import build_plan, make_gpu_manager
from tests.conftest import only

BIG = ["model.guide_arch.d_model=512", "model.guide_arch.n_layer=4"]
BIG_REFERENCE = ["model.reference_arch.d_model=512", "model.reference_arch.n_layer=4"]


def test_ddp_replicates_and_fsdp_divides_parameters_gradients_and_optimizer_state():
    mem = TrainingMemory(
        params=400 * MB,
        grads=400 * MB,
        optimizer=800 * MB,
        activations=100 * MB,
        frozen=50 * MB,
        block=10 * MB,
        batch_split=True,
        what="test",
    )
    assert mem.per_rank_mb("none", 1) == 1750 + WORKER_OVERHEAD_MB
    # DDP: every rank holds the whole state; the batch is split over the ranks
    assert mem.per_rank_mb("ddp", 2) == 1600 + 50 + 50 + WORKER_OVERHEAD_MB
    # FSDP: the state over k, plus one block gathered unsharded; frozen models replicated
    assert mem.per_rank_mb("fsdp", 4) == 400 + 10 + 25 + 50 + WORKER_OVERHEAD_MB
    micro = TrainingMemory(400 * MB, 400 * MB, 800 * MB, 100 * MB, 0.0, 0.0, False, "hub")
    assert micro.per_rank_mb("fsdp", 2) == 800 + 100 + WORKER_OVERHEAD_MB  # micro-batch kept


def _train_memory(overrides: list[str], algo: str) -> TrainingMemory:
    """The analytic split of `algo`'s round-0 train task, as the planner computes it."""
    from pita.experiment.estimates import _plain, training_memory

    cfg = cli.compose_config(["system.devices=fake:1", *only(algo), *overrides])
    plan = build_plan(cfg, make_gpu_manager(cfg))
    task = plan.tasks[f"{algo}.goal_walk.tiny.r0.train"]
    mem = training_memory(task, _plain(cfg), ModelSizes())
    assert mem is not None
    return mem


def _devices(mb: int, n: int) -> str:
    return 'system.devices="fake:[' + ",".join([f"{mb}MB"] * n) + ']"'


def test_a_training_task_too_large_for_one_device_gets_the_smallest_fsdp_gang():
    mem = _train_memory(BIG, "QSharp")
    one, two, three = (mem.per_rank_mb("fsdp", k) for k in (1, 2, 3))
    assert three < two < one
    device = (two + one) // 2  # FSDP over 2 fits, one device does not
    cfg = cli.compose_config([_devices(device, 4), *only("reference", "QSharp", "PITA"), *BIG])
    plan = build_plan(cfg, make_gpu_manager(cfg))
    for algo in ("QSharp", "PITA"):
        train = plan.tasks[f"{algo}.goal_walk.tiny.r0.train"]
        assert (train.gpus, train.strategy) == (2, "fsdp")
        assert train.mem_mb == 2 * two and "FSDP over 2" in train.mem_source
    others = [t for t in plan.tasks.values() if t.stage != "train"]
    assert {(t.gpus, t.strategy) for t in others} == {(1, "none")}


def test_no_gang_fits_is_one_line_with_the_task_the_estimate_the_largest_gang_and_strategy():
    mem = _train_memory(BIG, "QSharp")
    device = mem.per_rank_mb("fsdp", 3) - 1  # even FSDP over every device is too much
    cfg = cli.compose_config([_devices(device, 3), *only("QSharp"), *BIG])
    with pytest.raises(ConfigError) as info:
        build_plan(cfg, make_gpu_manager(cfg))
    [line] = info.value.messages
    assert "\n" not in line
    assert "task QSharp.goal_walk.tiny.r0.train needs ~" in line
    assert "the largest gang, 3 fake device(s), under FSDP" in line


def test_a_trl_stage_that_only_fsdp_could_fit_is_refused_on_cpu(tmp_path, capsys, monkeypatch):
    mem = _train_memory([*BIG, *BIG_REFERENCE], "DPO")
    device = (mem.per_rank_mb("fsdp", 2) + mem.per_rank_mb("none", 1)) // 2
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        cli.main([_devices(device, 2), *only("DPO"), *BIG, *BIG_REFERENCE, "dry_run=true"])
    assert exit_info.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "task DPO.goal_walk.tiny.r0.train needs ~" in line
    assert "accelerate has no FSDP on CPU" in line and "2 fake device(s)" in line


def test_dry_run_shows_each_gang_its_strategy_and_per_rank_memory(tmp_path, capsys, monkeypatch):
    """Under fsdp on fake devices: pita's own loops shard (fsdp), a TRL stage runs DDP and
    the dry run says so in one line; nothing calls the TRL task FSDP."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(
            [
                "system.devices=fake:2",
                *only("QSharp", "DPO"),
                "training.parallel_strategy=fsdp",
                "dry_run=true",
            ]
        )
    assert exit_info.value.code == 0
    out = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split() for line in out if line.startswith(("QSharp", "DPO"))}
    assert rows["QSharp.goal_walk.tiny.r0.train"][2] == "fsdpx2"
    assert rows["DPO.goal_walk.tiny.r0.train"][2] == "ddpx2"
    assert rows["QSharp.goal_walk.tiny.r0.collect.s00"][2] == "1"
    mem, per_rank = (float(x) for x in rows["QSharp.goal_walk.tiny.r0.train"][3:5])
    assert per_rank == pytest.approx(mem / 2, abs=0.01)
    notes = [line for line in out if "runs DDP here" in line]
    assert notes == [
        "DPO.goal_walk.tiny.r0.train: training.parallel_strategy=fsdp runs DDP here "
        "(replicated ranks): accelerate has no FSDP on CPU, a TRL stage shards only on CUDA"
    ]
    assert not [line for line in out if "DPO" in line and "fsdp" in line.split()]


def test_under_slurm_auto_uses_the_jobs_gpus(monkeypatch):
    """NVML sees every GPU of the node; a SLURM job's are those CUDA_VISIBLE_DEVICES names
    (by index or UUID). A job whose cgroup hides the others sees exactly its own."""
    from pita.core import gpu_manager
    from pita.core.gpu_manager import Device, GPUManager

    def node(n: int) -> list[Device]:
        return [
            Device(i, "cuda", "H100", f"GPU-{i:04d}", 81559, 81000, nvml_index=i) for i in range(n)
        ]

    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setattr(gpu_manager, "query_nvml_devices", lambda: node(8))
    for visible in ("2,5", "GPU-0002,GPU-0005"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        gpu = GPUManager("auto")
        assert [(d.index, d.uuid) for d in gpu.devices] == [(0, "GPU-0002"), (1, "GPU-0005")]
        assert gpu.largest_gang == 2
    monkeypatch.setattr(gpu_manager, "query_nvml_devices", lambda: node(2))  # cgroup-limited
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,7")
    assert [d.uuid for d in GPUManager("auto").devices] == ["GPU-0000", "GPU-0001"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert GPUManager("auto").kind == "cpu"
    monkeypatch.setattr(gpu_manager, "query_nvml_devices", lambda: node(8))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "9")
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES='9'"):
        GPUManager("auto")


def test_a_lora_adapter_counts_only_its_own_gradients_and_optimizer_state():
    """The refusal's advice holds: with algos.<NAME>.peft the trained state is the adapter's."""
    full = _train_memory([*BIG, *BIG_REFERENCE], "DPO")
    lora = _train_memory([*BIG, *BIG_REFERENCE, "+algos.DPO.peft.r=8"], "DPO")
    assert lora.params == full.params and lora.activations == full.activations
    # hidden 512, MLP 2048, 4 blocks: 4 x (4 x 8 x 1024 + 3 x 8 x 2560) adapter parameters
    assert lora.grads == 4.0 * 4 * (4 * 8 * 1024 + 3 * 8 * 2560)
    assert lora.optimizer == 2 * lora.grads < full.optimizer / 10


def _llama():
    """A Llama of ~17M parameters (68 MB in fp32): large enough that MB rounding is < 1 %."""
    import torch
    from transformers import LlamaForCausalLM

    from tests.archs import llama

    torch.manual_seed(0)
    config = llama(4096, 512, 1376, 4, 8, 8, max_position_embeddings=64)
    return LlamaForCausalLM(config)


def _state_bytes_on_rank(dist) -> dict[str, int]:
    """Bytes this rank holds of parameters, gradients and AdamW state after one step, under
    DDP and then FSDP2 (pita's own `apply_gang`; a DTensor counts its local shard)."""
    import torch

    from pita.core.parallel import Gang, Strategy
    from pita.training.ddp import apply_gang

    def local(t) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    out = {}
    for strategy in (Strategy.DDP, Strategy.FSDP):
        dist.gang = Gang(strategy, dist.world_size)
        model = _llama()
        net = apply_gang(model, dist)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(0, 4096, (2, 16), generator=torch.Generator().manual_seed(dist.rank))
        net(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        params = sum(local(p) for p in model.parameters())
        grads = sum(local(p.grad) for p in model.parameters() if p.grad is not None)
        states = sum(local(v) for s in opt.state.values() for v in s.values() if v.dim() > 0)
        out[strategy.value] = params + grads + states
    return out


@pytest.mark.slow  # one 2-rank launch (DDP, then FSDP2), ~17M parameters on CPU
def test_the_estimate_divides_what_fsdp_really_divides_and_ddp_really_replicates():
    """issue 45: the estimate (`TrainingMemory.per_rank_mb`) against what 2 gloo ranks really
    hold after an AdamW step of a 17M-parameter Llama under pita's `apply_gang`: DDP every
    byte of parameters, gradients and optimizer state on each rank; FSDP2 half of them (plus
    dim-0 padding), the estimate adding one block gathered unsharded. An estimate that did
    not divide the optimizer state (or replicated FSDP's parameters) fails by ~P."""
    from pita.training.ddp import launch_ranks, transformer_blocks

    model = _llama()
    p = sum(t.numel() * t.element_size() for t in model.parameters())
    block = max(
        sum(t.numel() * t.element_size() for t in b.parameters()) for b in transformer_blocks(model)
    )
    mem = TrainingMemory(p, p, 2 * p, 0.0, 0.0, block, True, "measured")
    ranks = launch_ranks(_state_bytes_on_rank, 2, device_type="cpu")
    for measured in ranks:
        ddp = (mem.per_rank_mb("ddp", 2) - WORKER_OVERHEAD_MB) * MB
        assert abs(ddp - measured["ddp"]) <= MB, (ddp / MB, measured["ddp"] / MB)
        fsdp = (mem.per_rank_mb("fsdp", 2) - WORKER_OVERHEAD_MB) * MB
        held = measured["fsdp"]
        assert held < 0.6 * measured["ddp"], held / measured["ddp"]  # really divided
        # the estimate: the rank's half, plus the block it gathers (not held after the step)
        assert held - MB <= fsdp <= held * 1.02 + block + MB, (fsdp / MB, held / MB, block / MB)
