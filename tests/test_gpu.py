"""The GPU suite: `pytest -m gpu` on a machine with CUDA (every test skips without it).

What it checks on real devices: the setup diagnostic, `experiment=smoke`, the local family
(BPE tokenizer, save_pretrained Llamas) through every algorithm in bf16 with automatic
batch sizes, `-8bit` / `-4bit` loading with bitsandbytes, `model.device_map=auto` through
the placement code, and a TRL trainer step on CUDA.
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import math
import random
import subprocess
import sys

import pytest

from tests.conftest import ROOT, run_ok


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return False


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _cuda(), reason="needs a CUDA device")]
needs_bnb = pytest.mark.skipif(
    importlib.util.find_spec("bitsandbytes") is None,
    reason="bitsandbytes is not installed (pip install bitsandbytes)",
)


def _summary(run_dir):
    with open(run_dir / "results" / "summary.csv") as f:
        return list(csv.DictReader(f))


def _task_logs(run_dir) -> str:
    return "\n".join(p.read_text(errors="replace") for p in (run_dir / "tasks").glob("*/log.txt"))


def test_setup_diagnostic_passes_on_the_gpus():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "test_parallel_setup.py")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "checks passed" in proc.stdout and "FAIL" not in proc.stdout
    assert "worker on GPU 0" in proc.stdout


def test_smoke_experiment_on_cuda(tmp_path):
    run_dir = run_ok(
        ["experiment=smoke", "executor.progress=false"], tmp_path, "smoke", timeout=1200
    )
    rows = _summary(run_dir)
    assert {r["algo"] for r in rows} == {
        "reference",
        "PITA",
        "QSharp",
        "QSharp-HF",
        "DPO",
        "GRPO",
        "GRPO-HF",
    }
    assert all(math.isfinite(float(r["pass@1"])) for r in rows)
    log = (run_dir / "run.log").read_text()
    assert "GPU" in log
    import torch  # the default strategy: sizing and growth on several GPUs (issue 32)

    n = torch.cuda.device_count()
    resolved = f"data_parallel ({n} CUDA devices)" if n > 1 else "none (one CUDA device)"
    assert f"training.parallel_strategy=auto -> {resolved}" in log


def test_local_family_in_bf16_with_automatic_batch_sizes(local_family, tmp_path):
    from tests.test_local_family import expected_rows, local_run_args

    args = local_run_args(
        local_family,
        "model.dtype=bfloat16",
        "generation.batch_size=auto",
        "evaluation.batch_size=auto",
        "data_collection.reward_batch_size=auto",
        "model.device_map=auto",
    )
    run_dir = run_ok(
        args, tmp_path, "local", timeout=1200, env={"PITA_CACHE_DIR": str(tmp_path / "cache")}
    )
    rows = _summary(run_dir)
    assert {(r["algo"], r["eta"], r["sampling"]) for r in rows} == expected_rows(), rows
    # kl is +inf where a trained policy samples outside π_ref's top-k (docs/ALGORITHMS.md,
    # "KL: the three columns"); kl_full is always finite and no number is NaN
    assert all(math.isfinite(float(r["kl_full"])) and not math.isnan(float(r["kl"])) for r in rows)
    logs = _task_logs(run_dir)
    assert "Target memory usage" in logs, logs[
        -3000:
    ]  # the automatic batch size measured on the GPU
    assert (
        "Layer distribution: GPU 0:" in (run_dir / "run.log").read_text()
    )  # device_map=auto, via placement


@needs_bnb
@pytest.mark.parametrize("quant", ["8bit", "4bit"])
def test_quantized_aliases_load_and_generate(local_family, quant):
    import torch

    from pita.models.generation import generate
    from pita.models.loading import load_tokenizer
    from pita.models.placement import load_stage_lm

    fam = {
        "name": f"local-{quant}",
        "reference": str(local_family.reference),
        "guide": str(local_family.guide),
    }
    model = load_stage_lm(fam["reference"], family=f"local-{quant}", family_cfg=fam, device="cuda")
    assert getattr(model, f"is_loaded_in_{quant}", False)
    linear = type(model.model.layers[0].self_attn.q_proj).__name__
    assert linear == ("Linear8bitLt" if quant == "8bit" else "Linear4bit"), linear
    tok = load_tokenizer(fam["reference"])
    out = generate(
        model,
        [tok("Ann has 3 apples.")["input_ids"]] * 4,
        max_new_tokens=6,
        batch_size=4,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        generator=torch.Generator().manual_seed(0),
    )
    assert all(out.responses) and all(math.isfinite(x) for lp in out.logprobs for x in lp)


def test_device_map_auto_loads_through_the_placement_code(local_family, caplog):
    import logging

    from pita.models.placement import load_stage_lm, placement_lines

    fam = {
        "name": "local",
        "reference": str(local_family.reference),
        "guide": str(local_family.guide),
        "dtype": "bfloat16",
        "device_map": "auto",
    }
    logger = logging.getLogger("test.gpu.placement")
    with caplog.at_level(logging.INFO, logger=logger.name):
        model = load_stage_lm(
            fam["reference"], family="local", family_cfg=fam, device="cuda", logger=logger
        )
    assert next(model.parameters()).is_cuda
    lines = placement_lines(model, "reference")
    assert lines and lines[0].startswith("reference: Layer distribution: GPU 0:"), lines
    assert "Layer distribution" in caplog.text


def test_a_trl_dpo_step_on_cuda_in_bf16(local_family, tmp_path):
    import torch
    from datasets import Dataset
    from trl import DPOConfig

    from pita.algos.dpo import check_token_dataset, pairs_as_ids, token_dpo_trainer
    from pita.models.loading import load_causal_lm, load_tokenizer

    tok = load_tokenizer(str(local_family.reference))
    rng = random.Random(0)
    records = [
        {
            "example": i,
            "prompt": tok("Ann has 3 apples.")["input_ids"],
            "chosen": [rng.randrange(3, len(tok)) for _ in range(6)],
            "rejected": [rng.randrange(3, len(tok)) for _ in range(5)],
        }
        for i in range(8)
    ]
    ids = pairs_as_ids(records, tok.eos_token_id)
    policy, ref = (
        load_causal_lm(str(local_family.reference), dtype="float32", device="cuda")
        for _ in range(2)
    )
    names = {f.name for f in dataclasses.fields(DPOConfig)}
    ckpt = (
        "activation_checkpointing"
        if "activation_checkpointing" in names
        else "gradient_checkpointing"
    )
    args = DPOConfig(
        output_dir=str(tmp_path / "trainer"),
        per_device_train_batch_size=4,
        max_steps=2,
        learning_rate=1e-3,
        bf16=torch.cuda.is_bf16_supported(),
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        beta=0.1,
        max_length=None,
        **{ckpt: False},
    )
    trainer = token_dpo_trainer()(
        model=policy,
        ref_model=ref,
        args=args,
        train_dataset=Dataset.from_dict(ids),
        processing_class=tok,
    )
    check_token_dataset(trainer.train_dataset, ids)
    trainer.train()
    assert trainer.state.global_step == 2
    assert math.isfinite(trainer.state.log_history[-1]["train_loss"])
    assert next(trainer.model.parameters()).is_cuda
