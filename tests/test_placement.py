"""pita.models.placement: max_memory, device maps of real architectures over simulated GPUs
(meta device: nothing allocated, nothing downloaded), GPU counts,
and the clear error of a quantized alias without CUDA."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from accelerate.utils import convert_file_size_to_int
from transformers import LlamaConfig

from pita.models.placement import (
    GiB,
    gpus_needed,
    infer_placement,
    layer_distribution,
    layer_distribution_line,
    load_on_gang,
    max_memory_for_gang,
    model_bytes,
)
from tests.archs import llama_1b, llama_8b, llama_70b_judge


def weight_bytes(config: LlamaConfig, dtype: str) -> int:
    """A model's weight bytes: its map over one simulated GPU large enough for anything."""
    return infer_placement(config, {0: 2**50}, dtype).total_bytes


def test_max_memory_keeps_a_reserve_per_device():
    mm = max_memory_for_gang([80 * GiB, 40 * GiB, int(10.5 * GiB)], reserve_fraction=0.1)
    assert mm == {0: "72GiB", 1: "36GiB", 2: "9.45GiB"}
    assert convert_file_size_to_int(mm[2]) <= 10.5 * GiB * 0.9
    assert max_memory_for_gang([GiB], 0.0) == {0: "1GiB"}
    with pytest.raises(ValueError, match="reserve_fraction"):
        max_memory_for_gang([GiB], 1.0)


def test_device_map_of_llama_8b_over_four_simulated_gpus():
    max_memory = {0: "6GiB", 1: "6GiB", 2: "6GiB", 3: "6GiB"}  # 15 GiB of bf16 weights over 24 GiB
    p = infer_placement(llama_8b(), max_memory, "bfloat16")
    assert p.num_layers == 32 and sum(p.layers.values()) == 32
    assert set(p.layers) == {0, 1, 2, 3} and set(p.device_map.values()) <= {0, 1, 2, 3}
    assert sum(p.bytes_per_device.values()) == p.total_bytes
    assert 14.9 * GiB < p.total_bytes < 15.1 * GiB
    busiest = max(p.bytes_per_device, key=p.bytes_per_device.get)
    assert p.bytes_per_device[busiest] <= convert_file_size_to_int(max_memory[busiest])
    assert all(p.bytes_per_device[d] <= 6 * GiB for d in p.bytes_per_device)
    assert p.log_line() == layer_distribution_line(p.layers)
    assert p.log_line().startswith("Layer distribution: GPU 0: ") and "GPU 3:" in p.log_line()
    assert len(p.log_lines()) == 4 and "of 6.00 GiB allowed" in p.log_lines()[0]


def test_device_map_of_llama_1b_over_two_gpus_is_balanced():
    p = infer_placement(llama_1b(), max_memory_for_gang([4 * GiB, 4 * GiB]), "bfloat16")
    assert sum(p.layers.values()) == 16 and set(p.layers) == {0, 1}
    assert abs(p.layers[0] - p.layers[1]) <= 4  # balanced, not GPU 0 first
    assert p.device_map["lm_head"] == p.device_map["model.embed_tokens"]  # tied: one copy
    assert (
        p.log_line()
        == f"Layer distribution: GPU 0: {p.layers[0]} layers, GPU 1: {p.layers[1]} layers"
    )


def test_a_model_that_does_not_fit_is_refused_unless_offload_is_allowed():
    with pytest.raises(
        ValueError, match=r"does not fit in max_memory .*gpus_per_task.*-8bit / -4bit"
    ):
        infer_placement(llama_8b(), {0: "3GiB", 1: "3GiB"}, "bfloat16")
    p = infer_placement(
        llama_8b(), {0: "3GiB", 1: "3GiB", "cpu": "64GiB"}, "bfloat16", allow_offload=True
    )
    assert "cpu" in set(p.device_map.values()) and sum(p.layers.values()) == 32


def test_quantized_sizes_shrink_the_map():
    assert (
        weight_bytes(llama_1b(), "4bit")
        < weight_bytes(llama_1b(), "8bit")
        < weight_bytes(llama_1b(), "bfloat16")
    )
    p = infer_placement(
        llama_8b(), {0: "6GiB", 1: "6GiB"}, "8bit"
    )  # 8 GB in int8 fits on 2 x 6 GiB
    assert sum(p.layers.values()) == 32


def test_layer_distribution_resolves_parents_and_counts_blocks():
    assert layer_distribution({"": 0}, 16, "model.layers") == {0: 16}
    dm = {
        "model.embed_tokens": 0,
        "model.layers.0": 0,
        "model.layers.1": 1,
        "model.layers.2": 1,
        "lm_head": 1,
    }
    assert layer_distribution(dm) == {0: 1, 1: 2}
    assert layer_distribution(
        {"model.embed_tokens": 1, "model.layers": 0, "lm_head": 1}, 4, "model.layers"
    ) == {0: 4}
    assert (
        layer_distribution_line({0: 1, "cpu": 2})
        == "Layer distribution: GPU 0: 1 layer, CPU: 2 layers"
    )


def test_gpus_needed_for_large_models():
    bf16_70b = model_bytes(70e9, "bfloat16")
    assert gpus_needed(bf16_70b, 40 * GiB) == 4  # 168 GB with overhead over 40 GB GPUs
    assert gpus_needed(bf16_70b, 80 * GiB) == 2
    assert gpus_needed(model_bytes(70e9, "4bit"), 40 * GiB) == 1
    assert gpus_needed(model_bytes(8e9, "bf16"), [10 * GiB, 40 * GiB, 24 * GiB]) == 1
    assert gpus_needed(bf16_70b, [24 * GiB] * 8) == 7
    with pytest.raises(ValueError, match="does not fit on all 2 GPUs"):
        gpus_needed(bf16_70b, [40 * GiB, 40 * GiB])


@pytest.mark.parametrize("alias", ["llama3.2-1b-4bit", "llama3.2-1b-8bit"])
def test_a_quantized_alias_on_cpu_fails_with_one_clear_line(alias):
    from pita.models.catalog import resolve_family
    from pita.models.loading import load_causal_lm

    family = resolve_family(alias)
    quant = alias.rsplit("-", 1)[1]
    assert family.quantization == quant
    for load in (
        lambda: load_causal_lm(family.guide, device="cpu", quantization=family.quantization),
        lambda: load_on_gang(family.guide, quantization=family.quantization),
    ):
        with pytest.raises(RuntimeError) as err:
            load()
        message = str(err.value)
        assert "\n" not in message
        assert (
            f"-{quant} needs CUDA + bitsandbytes" in message
            and f"drop the -{quant} suffix" in message
        )


def test_a_70b_judge_gets_a_gang_of_fake_gpus_and_a_device_map_over_it(local_family):
    """From a model's size (meta device, accelerate's init_empty_weights) to the planner's
    gang (model.device_map=auto over simulated 48 GB GPUs) to the device map load_on_gang
    uses on that gang (per-GPU max_memory from free memory): every block on the gang's GPUs,
    nothing offloaded, each GPU within its budget, and the run.log line."""
    from pita.experiment.cli import compose_config
    from pita.experiment.plan import plan_experiment
    from pita.models.placement import gang_placement
    from tests.conftest import only

    weights = weight_bytes(llama_70b_judge(), "bfloat16")
    assert 128 * GiB < weights < 131 * GiB  # 69.5B parameters in bf16 (a score head, no LM head)
    device = 48 * GiB
    gang = gpus_needed(weights, device)  # 1.2 x weights for activations and the CUDA context
    assert gang == 4

    cfg = compose_config(
        [
            *only("reference"),
            *local_family.overrides(),
            "model.device_map=auto",
            f"model.memory_gb={weights * 1.2 / 2**30:.1f}",
        ]
    )
    plan = plan_experiment(cfg, 8, device_mb=[device // 2**20] * 8)
    evaluate = [t for t in plan.tasks.values() if t.stage == "evaluate"]
    assert evaluate and all(t.gpus == gang for t in evaluate)  # the planner sizes the same gang

    placement = gang_placement(llama_70b_judge(), [device] * gang, dtype="bfloat16")
    assert set(placement.layers) == {0, 1, 2, 3} and sum(placement.layers.values()) == 80
    assert set(placement.device_map.values()) <= {0, 1, 2, 3}  # no cpu / disk
    assert max(placement.layers.values()) - min(placement.layers.values()) <= 3  # balanced
    assert all(
        b <= 0.9 * device for b in placement.bytes_per_device.values()
    )  # 10 % kept back per GPU
    assert placement.device_map["score"] in range(4)  # the judge's head is placed too
    line = placement.log_line()
    assert line.startswith("Layer distribution: GPU 0: ") and line.count("layers") == 4
    with pytest.raises(ValueError, match="does not fit in max_memory"):
        gang_placement(llama_70b_judge(), [device] * (gang - 1), dtype="bfloat16")
    assert set(gang_placement(llama_70b_judge(), [device] * 2, dtype="4bit").layers) <= {
        0,
        1,
    }  # -4bit: fewer GPUs


def test_stage_models_load_through_the_placement_code(local_family, caplog):
    """No stage, algorithm or runtime module loads a causal LM but through
    `load_stage_lm`; it loads π_ref as the family says (its dtype, device_map=auto through
    load_on_gang, the CPU without CUDA; a -8bit alias refused off CUDA in one line) and
    refuses, in one line, to train a policy the family wants sharded or quantized."""
    import ast

    import torch

    from pita.algos.trl_common import load_trainable_lm
    from tests.conftest import ROOT

    direct = []
    for package in ("algos", "stages", "runtime"):
        for path in sorted((ROOT / "pita" / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                called = node.func if isinstance(node, ast.Call) else None
                name = getattr(called, "attr", None) or getattr(called, "id", None)
                owner = getattr(getattr(called, "value", None), "id", "")
                if name == "load_causal_lm" or (
                    name == "from_pretrained" and owner == "AutoModelForCausalLM"
                ):
                    direct.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not direct, f"load causal LMs through placement.load_stage_lm: {direct}"

    from pita.models.placement import load_stage_lm, placement_lines

    fam = {
        "name": "local",
        "reference": str(local_family.reference),
        "guide": str(local_family.guide),
        "dtype": "float32",
        "device_map": "auto",
    }
    model = load_stage_lm(fam["reference"], family="local", family_cfg=fam, device="cpu")
    assert (
        next(model.parameters()).device.type == "cpu"
        and next(model.parameters()).dtype == torch.float32
    )
    assert placement_lines(model, "reference") == []  # nothing sharded on a CPU
    with pytest.raises(RuntimeError, match=r"-8bit needs CUDA \+ bitsandbytes"):
        load_stage_lm(
            fam["reference"],
            family="local-8bit",
            family_cfg={**fam, "device_map": None},
            device="cpu",
        )
    ctx = SimpleNamespace(
        task=SimpleNamespace(family="local-8bit"),
        cfg=SimpleNamespace(model={**fam, "device_map": None}),
        device="cpu",
        system=SimpleNamespace(attn_impl="eager"),
    )
    with pytest.raises(ValueError, match=r"^model.name=local-8bit: a policy this stage trains"):
        load_trainable_lm(ctx, fam["reference"])  # type: ignore[arg-type]
    for device_map in (None, "auto"):  # device_map places run-only models, never the trained one
        trained = load_trainable_lm(
            SimpleNamespace(  # type: ignore[arg-type]
                task=SimpleNamespace(family="local"),
                cfg=SimpleNamespace(model={**fam, "device_map": device_map, "dtype": "bfloat16"}),
                device="cpu",
                system=SimpleNamespace(attn_impl="eager"),
            ),
            fam["reference"],
        )
        assert next(trained.parameters()).dtype == torch.float32  # fp32 whatever dtype
        assert next(trained.parameters()).device.type == "cpu"  # the task's device
