"""One parallel plan (issue 46): the strategy decided once into a `Gang` the task carries
(pita/core/parallel.py), read by workers and stages from the task, never from the config
key; the algorithm table's rows say which stages run TRL and which grow; one function
applies a gang to a model (`pita.training.ddp.apply_gang`). Cheap: no rank is started."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

from pita.core.parallel import Gang, Strategy
from pita.core.tasks import TaskSpec
from tests.conftest import ROOT

STRATEGY_NAMES = {"data_parallel", "ddp", "fsdp"}
# the worker side: what runs a task (a rank included) reads the task's gang
WORKER_SIDE = ("runtime", "stages", "algos", "training", "models", "datasets", "eval")


def _code_strings(path: Path) -> list[tuple[int, str]]:
    """String constants of a module that are not docstrings: (line, value)."""
    tree = ast.parse(path.read_text())
    docs = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        (n.lineno, n.value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
    ]


def test_the_strategy_names_are_spelled_in_at_most_three_modules():
    """pita/core/parallel.py names them; the only other literals are TRL's own
    `TrainingArguments.fsdp` field (trl_common's FSDP2 arguments, trl_values' refusal)."""
    spelled = {
        str(p.relative_to(ROOT))
        for p in (ROOT / "pita").rglob("*.py")
        if any(value in STRATEGY_NAMES for _, value in _code_strings(p))
    }
    assert "pita/core/parallel.py" in spelled
    assert len(spelled) <= 3, sorted(spelled)


def test_no_worker_or_stage_reads_the_strategy_key():
    readers = []
    for folder in WORKER_SIDE:
        for p in (ROOT / "pita" / folder).rglob("*.py"):
            tree = ast.parse(p.read_text())
            for n in ast.walk(tree):
                reads = (isinstance(n, ast.Attribute) and n.attr == "parallel_strategy") or (
                    isinstance(n, ast.Constant) and n.value == "parallel_strategy"
                )
                if reads:
                    readers.append(f"{p.relative_to(ROOT)}:{n.lineno}")
    assert not readers


def test_registry_rows_say_which_stages_run_trl_and_which_grow():
    from pita.algos.registry import ALGORITHMS, can_grow, runs_trl

    for row in ALGORITHMS.values():
        assert set(row.trl_stages) <= set(row.gang_stages), row.name
        assert set(row.growable_stages) <= set(row.gang_stages), row.name
    assert runs_trl("DPO", "train", "pita.algos.dpo:train")
    assert not runs_trl("QSharp", "train", "pita.algos.qsharp:train")
    assert can_grow("GRPO", "train", "pita.algos.grpo:train")  # seeded per row (issue 45)
    assert not can_grow("DPO", "collect", "pita.algos.dpo:collect")  # not a gang stage
    assert can_grow("any", "pretrain", "pita.stages.pretrain:pretrain")


def test_a_resize_changes_only_the_gang_world():
    from pita.core.elastic import resized

    task = TaskSpec("t", "QSharp", "d", "tiny", 0, "train", "x:y", ranks=[1, 2, 4])
    task.set_gang(Gang(Strategy.DDP, 1, nodes=("n0",)))
    assert task.strategy is Strategy.NONE  # DDP over one rank is one process
    four = resized(task, 4)
    assert four.gang == Gang(Strategy.DDP, 4, nodes=("n0",)) and four.gpus == 4
    assert four.strategy is Strategy.DDP
    assert (four.mem_mb, task.gang.world) == (4 * task.mem_mb, 1)  # a copy


def test_a_task_carries_its_gang_through_a_dict_and_reads_an_old_plan():
    task = TaskSpec("t", "QSharp", "d", "tiny", 0, "train", "x:y", gpus=2)
    task.set_gang(Gang(Strategy.FSDP, 2, asked=Strategy.NONE))
    again = TaskSpec.from_dict(task.to_dict())
    assert again.gang == task.gang and again.gpus == 2
    old = {k: v for k, v in task.to_dict().items() if k != "gang"}
    assert TaskSpec.from_dict({**old, "strategy": "ddp"}).gang == Gang(Strategy.DDP, 2)
    assert Strategy.of("data_parallel") is Strategy.DDP and Strategy.DDP.key == "data_parallel"
    with pytest.raises(ValueError, match="expected one of none | data_parallel | fsdp"):
        Strategy.of("tensor_parallel")


def test_distributed_sampler_splits_the_batch():
    """The ranks' shares are torch's DistributedSampler's (padded: pretrain), or its real
    items only (the value trainer weighs each item once)."""
    from pita.training.ddp import shard_indices

    assert shard_indices(7, 2, 3) == [2, 5, 1]  # the padding repeats the first items
    assert shard_indices(7, 2, 3, pad=False) == [2, 5]
    assert sorted(i for r in range(3) for i in shard_indices(7, r, 3, pad=False)) == list(range(7))


def test_apply_gang_shards_the_blocks_the_model_names_with_the_runs_precision(monkeypatch):
    """FSDP2: one `fully_shard` per block in the model's `_no_split_modules`, then the
    root, with the run's precision as its MixedPrecisionPolicy (none in fp32)."""
    import torch
    import torch.distributed.fsdp as fsdp

    from pita.models.tiny import build_tiny_llama
    from pita.training.ddp import apply_gang, transformer_blocks
    from pita.training.precision import choose_precision

    model = build_tiny_llama(
        12, n_layer=2, d_model=16, n_head=2, max_position=32, pad_token_id=0, eos_token_id=1
    )
    blocks = transformer_blocks(model)
    assert [type(b).__name__ for b in blocks] == ["LlamaDecoderLayer"] * 2
    sharded: list[tuple[object, object]] = []
    monkeypatch.setattr(fsdp, "fully_shard", lambda m, **kw: sharded.append((m, kw)))
    dist = SimpleNamespace(world_size=2, device="cuda:0", gang=Gang(Strategy.FSDP, 2))
    fp16 = choose_precision("fp16", True, "cuda", compute_capability=(7, 5))
    assert apply_gang(model, dist, fp16) is model
    assert [m for m, _ in sharded] == [*blocks, model]
    policy = sharded[0][1]["mp_policy"]
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.float16, torch.float32)
    sharded.clear()
    apply_gang(model, dist, choose_precision("auto", True, "cpu"))
    assert all(kw == {} for _, kw in sharded)  # fp32: no policy
    assert apply_gang(model, None) is model
