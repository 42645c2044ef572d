"""pita.training: precision choice, exact gradient accumulation, TrainStep, compile
fallback, report files, and the pretrain stage on top of them (CPU, tiny models)."""

from __future__ import annotations

import logging
import random

import pytest
import torch
from omegaconf import OmegaConf

from pita.training.loop import (
    TrainStep,
    accumulation_plan,
    compile_model,
    dataloader_kwargs,
    enable_gradient_checkpointing,
    split_batch,
    token_weights,
)
from pita.training.precision import choose_precision, training_device, trl_precision_kwargs
from pita.training.report import (
    PLOT_NAME,
    SUMMARY_NAME,
    trainer_metrics_callback,
    write_training_report,
)
from tests.conftest import task_spec

# --- precision -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cc, name, scaler",
    [
        ((7, 0), "fp16", True),
        ((7, 5), "fp16", True),
        ((8, 0), "bf16", False),
        ((9, 0), "bf16", False),
    ],
)
def test_auto_precision_follows_compute_capability(cc, name, scaler):
    p = choose_precision("auto", True, "cuda", compute_capability=cc)
    assert (p.name, p.use_grad_scaler) == (name, scaler)
    assert p.autocast_dtype == {"fp16": torch.float16, "bf16": torch.bfloat16}[name]
    assert p.trl_kwargs() == {"bf16": name == "bf16", "fp16": name == "fp16"}


def test_auto_precision_on_cpu_is_fp32():
    p = choose_precision("auto", True, "cpu")
    assert (p.name, p.dtype, p.autocast_dtype, p.use_grad_scaler) == (
        "fp32",
        torch.float32,
        None,
        False,
    )
    with p.autocast():  # a no-op context on fp32
        assert not torch.is_autocast_enabled()


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_explicit_precision_is_honoured_on_gpu(kind):
    p = choose_precision(kind, True, "cuda:1", compute_capability=8.0)
    assert p.name == kind and p.use_grad_scaler == (kind == "fp16") and p.device_type == "cuda"


def test_bf16_below_ampere_becomes_fp16_with_a_reason(caplog):
    with caplog.at_level(logging.WARNING):
        p = choose_precision("bf16", True, "cuda", compute_capability="7.0")
    assert (p.name, p.use_grad_scaler) == ("fp16", True)
    assert "compute capability >= 8.0" in caplog.text


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_explicit_half_precision_is_forced_to_fp32_on_cpu_with_a_logged_reason(kind, caplog):
    with caplog.at_level(logging.WARNING):
        p = choose_precision(kind, True, "cpu")
    assert p.name == "fp32" and p.autocast_dtype is None
    assert f"training.precision_type={kind} ignored on cpu" in caplog.text
    assert "ignored on cpu" in p.reason


def test_fp32_when_mixed_precision_is_off_or_fp32_is_asked():
    assert choose_precision("bf16", False, "cuda", compute_capability=9.0).name == "fp32"
    assert choose_precision("fp32", True, "cuda", compute_capability=9.0).name == "fp32"
    with pytest.raises(ValueError, match="training.precision_type='fp8'"):
        choose_precision("fp8", True, "cpu")


def test_trl_flags_are_false_on_cpu_and_follow_the_gpu():
    tr = OmegaConf.create({"precision_type": "auto", "mixed_precision": True})
    assert trl_precision_kwargs(tr, "cpu") == {"bf16": False, "fp16": False}
    assert trl_precision_kwargs(tr, "cuda", compute_capability=(8, 6)) == {
        "bf16": True,
        "fp16": False,
    }
    assert trl_precision_kwargs(tr, "cuda", compute_capability=(7, 0)) == {
        "bf16": False,
        "fp16": True,
    }


def test_gpu_mode_device_choice():
    assert training_device("cpu", "cuda", cuda_count=4)[:2] == ("cpu", 1)
    assert training_device("auto", "cuda", cuda_count=4)[:2] == ("cuda:0", 4)
    assert training_device("multi_gpu", "cuda", cuda_count=2)[:2] == ("cuda:0", 2)
    assert training_device("single_gpu", "cuda", cuda_count=4)[:2] == ("cuda:0", 1)
    assert training_device("auto", "cuda:1", cuda_count=2)[:2] == (
        "cuda:1",
        2,
    )  # a DDP rank keeps its GPU
    choice = training_device("multi_gpu", "cpu")
    assert choice[:2] == ("cpu", 1) and "no CUDA device" in choice.reason
    with pytest.raises(ValueError, match="system.gpu_mode"):
        training_device("tpu")


# --- batch arithmetic ------------------------------------------------------------------------


def test_accumulation_plan_keeps_the_effective_batch():
    assert accumulation_plan(8, 2) == (2, 4)
    assert accumulation_plan(256, 4, 0, batch_scale=0.5) == (
        2,
        128,
    )  # an OOM retry halves the micro-batch
    assert accumulation_plan(8, 4, accumulation_steps=4) == (2, 4)  # explicit steps win
    assert accumulation_plan(6, 4) == (3, 2)  # the largest divisor of the batch
    assert accumulation_plan(4, 64) == (4, 1)
    for batch, micro, steps, scale in [(7, 2, 0, 1.0), (100, 8, 3, 1.0), (96, 16, 0, 0.25)]:
        m, n = accumulation_plan(batch, micro, steps, scale)
        assert m * n == batch


def test_split_batch_and_token_weights():
    batch = {"x": torch.arange(8).view(8, 1), "y": torch.arange(8)}
    parts = split_batch(batch, 2)
    assert len(parts) == 4 and parts[1]["y"].tolist() == [2, 3]
    assert split_batch([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]
    assert token_weights([3, 1]) == [0.75, 0.25]
    assert token_weights([3, 1], total=8, world_size=2) == [0.75, 0.25]


def _tiny_lm(seed: int = 0):
    from pita.models.tiny import build_tiny_llama

    return build_tiny_llama(
        12,
        n_layer=1,
        d_model=16,
        n_head=2,
        max_position=16,
        pad_token_id=0,
        eos_token_id=1,
        seed=seed,
    ).train()


def _lm_batch(n: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded sequences with targets of different lengths (a token-mean loss)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 12, (n, 10), generator=g)
    mask = torch.ones_like(ids)
    labels = ids.clone()
    labels[:, :3] = -100  # prompt positions
    for i in range(n):
        cut = 6 + i % 4  # sequences of different lengths
        ids[i, cut:], mask[i, cut:], labels[i, cut:] = 0, 0, -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _sgd_update(micro: int) -> dict[str, torch.Tensor]:
    """One SGD(lr=1) step: the weight change is exactly minus the accumulated gradient."""
    model = _tiny_lm()
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    step = TrainStep(
        model, torch.optim.SGD(model.parameters(), lr=1.0), choose_precision("auto", True, "cpu")
    )
    parts = split_batch(_lm_batch(), micro)
    counts = [int((p["labels"][:, 1:] != -100).sum()) for p in parts]
    step.run(parts, lambda mb: model(**mb).loss, weights=token_weights(counts))
    return {k: before[k] - v.detach() for k, v in model.named_parameters()}


def test_four_micro_batches_of_two_equal_one_batch_of_eight():
    whole, accumulated = _sgd_update(8), _sgd_update(2)
    assert max(whole[k].abs().max().item() for k in whole) > 1e-4  # the step did move the weights
    for k in whole:
        torch.testing.assert_close(accumulated[k], whole[k], atol=1e-6, rtol=0)


def test_train_step_clips_and_records_metrics(monkeypatch):
    monkeypatch.setattr(
        torch.cuda, "empty_cache", lambda: pytest.fail("torch.cuda called on the CPU")
    )
    model = torch.nn.Linear(4, 1)
    step = TrainStep(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        choose_precision("auto", True, "cpu"),
        max_grad_norm=0.01,
        clear_cache_interval=1,
    )
    x, y = torch.randn(8, 4), torch.randn(8, 1) * 100
    for _ in range(3):
        before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
        res = step.run(
            split_batch((x, y), 4),
            lambda mb: torch.nn.functional.mse_loss(model(mb[0]), mb[1]),
            samples=8,
            tokens=32,
        )
        moved = torch.cat([p.detach().flatten() for p in model.parameters()]) - before
        assert res.grad_norm > 1.0  # the norm before clipping
        assert moved.norm().item() == pytest.approx(0.1 * 0.01, rel=1e-4)  # lr x the clipped norm
        assert all(p.grad is None for p in model.parameters())  # zeroed after the step
    assert step.step == 3 and len(step.metrics.rows) == 3
    summary = step.metrics.summary()
    assert (
        summary["samples_per_s"] > 0
        and summary["tokens_per_s"] > 0
        and summary["peak_memory_mb"] > 0
    )
    assert summary["peak_memory_kind"] == "process RSS peak"


def test_grad_scaler_path_skips_inf_steps_and_clips_unscaled_gradients():
    """The fp16 path, with torch's CPU GradScaler standing in for the CUDA one."""
    from pita.training.precision import Precision

    model = torch.nn.Linear(2, 1)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(optim, 1, gamma=0.5)
    step = TrainStep(
        model,
        optim,
        Precision("fp16", torch.float32, None, True, "cpu", "simulated"),
        scheduler=sched,
        max_grad_norm=1.0,
    )
    before = model.weight.detach().clone()
    res = step.run([torch.ones(1, 2)], lambda x: model(x).sum() * float("inf"))
    assert (
        res.skipped and torch.equal(model.weight, before) and step.lr() == 0.1
    )  # no update, no schedule step
    res = step.run([torch.ones(1, 2)], lambda x: model(x).sum())
    assert not res.skipped and res.grad_norm == pytest.approx(3**0.5)  # unscaled before clipping
    torch.testing.assert_close(before - model.weight.detach(), torch.full((1, 2), 0.1 / 3**0.5))
    assert step.lr() == 0.05


def test_importing_the_package_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, pita.training, pita.models.placement; assert 'torch' not in sys.modules, 'torch'"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def test_extras_such_as_accuracy_are_averaged():
    model = torch.nn.Linear(2, 1)
    step = TrainStep(
        model, torch.optim.SGD(model.parameters(), lr=0.0), choose_precision("fp32", False, "cpu")
    )
    accs = iter([1.0, 0.0, 0.5, 0.5])
    res = step.run(
        [torch.ones(1, 2)] * 4, lambda mb: (model(mb).sum() * 0, {"accuracy": next(accs)})
    )
    assert res.extras == {"accuracy": pytest.approx(0.5)}
    assert step.metrics.series("accuracy") == ([1.0], [0.5])


# --- model preparation ----------------------------------------------------------------------


def _failing_backend(gm, example_inputs):
    raise RuntimeError("no C++ compiler in this test")


class MLP(torch.nn.Module):
    """A module whose forward is user code (dynamo skips torch.nn's own containers)."""

    def __init__(self, d_in: int = 4, d_out: int = 1):
        super().__init__()
        self.hidden, self.out = torch.nn.Linear(d_in, 4), torch.nn.Linear(4, d_out)

    def forward(self, x):
        return self.out(torch.relu(self.hidden(x)))


def test_compile_failure_falls_back_to_eager_with_the_reason(caplog):
    model = MLP()
    x = torch.randn(3, 4)
    expected = model(x)
    with caplog.at_level(logging.WARNING):
        status = compile_model(model, True, example=(x,), backend=_failing_backend)
    assert status.requested and not status.compiled
    assert "no C++ compiler in this test" in status.reason and "eager fallback" in str(status)
    assert "torch.compile failed" in caplog.text
    torch.testing.assert_close(model(x), expected)  # eager again
    assert all(p.grad is None for p in model.parameters())  # the probe left no gradients


def test_compile_failure_on_the_first_step_is_redone_eagerly():
    model = MLP()
    status = compile_model(model, True, backend=_failing_backend)  # no example: verified on step 1
    assert status.compiled and not status.verified
    step = TrainStep(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        choose_precision("auto", True, "cpu"),
        compile_status=status,
    )
    res = step.run([torch.randn(2, 4)], lambda mb: model(mb).pow(2).mean())
    assert res.step == 1 and not status.compiled and "no C++ compiler" in status.reason


def test_compile_success_and_off():
    assert str(compile_model(torch.nn.Linear(2, 2), False)) == "off (eager)"
    model = MLP(2, 2)
    status = compile_model(model, True, example=(torch.randn(1, 2),), backend="eager")
    assert status.compiled and status.verified and str(status).startswith("compiled")
    assert list(model.state_dict())[0] == "hidden.weight"  # in place: no _orig_mod. prefix


def test_gradient_checkpointing_enable(caplog):
    model = _tiny_lm()
    assert enable_gradient_checkpointing(model, True)
    assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
    assert model.config.use_cache is False
    assert not enable_gradient_checkpointing(_tiny_lm(), False)
    with caplog.at_level(logging.WARNING):
        assert not enable_gradient_checkpointing(torch.nn.Linear(2, 2), True)
    assert "does not support it" in caplog.text


def test_dataloader_kwargs(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert dataloader_kwargs(-1, True, "cpu") == {
        "num_workers": 4,
        "pin_memory": False,
        "persistent_workers": True,
    }
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert dataloader_kwargs(-1, True, "cuda")["num_workers"] == 1
    assert dataloader_kwargs(0, True, "cuda") == {"num_workers": 0, "pin_memory": True}


# --- report files -----------------------------------------------------------------------------


def test_report_files_are_written(tmp_path):
    model = torch.nn.Linear(4, 1)
    step = TrainStep(
        model, torch.optim.SGD(model.parameters(), lr=0.1), choose_precision("bf16", True, "cpu")
    )
    for _ in range(4):
        step.run(
            split_batch(torch.randn(8, 4), 2),
            lambda mb: (model(mb).pow(2).mean(), {"accuracy": 0.5}),
            samples=8,
            tokens=80,
        )
    summary = write_training_report(
        tmp_path, step, micro_batch=2, accumulation_steps=4, title="unit"
    )
    png = (tmp_path / PLOT_NAME).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    text = (tmp_path / SUMMARY_NAME).read_text()
    for needle in (
        "precision: fp32 (training.precision_type=bf16 ignored on cpu",
        "compile: off (eager)",
        "= effective batch 8",
        "samples/s",
        "tokens/s",
        "peak memory:",
        "process RSS peak",
    ):
        assert needle in text, (needle, text)
    assert summary["effective_batch"] == 8 and summary["samples_per_s"] > 0


def test_trainer_callback_feeds_the_same_report(tmp_path):
    """The TRL path: a transformers Trainer with the callback and the precision flags."""
    from transformers import Trainer, TrainingArguments

    from pita.training.loop import TrainingMetrics

    tr = OmegaConf.create({"precision_type": "auto", "mixed_precision": True})
    args = TrainingArguments(
        output_dir=str(tmp_path / "trainer"),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        **trl_precision_kwargs(tr, "cpu"),
    )
    metrics = TrainingMetrics("cpu")
    rows = [{k: v[i] for k, v in _lm_batch(8).items()} for i in range(8)]
    trainer = Trainer(
        model=_tiny_lm(),
        args=args,
        train_dataset=rows,
        callbacks=[trainer_metrics_callback(metrics, samples_per_step=8)],
    )
    trainer.train()
    assert [r["step"] for r in metrics.rows] == [1, 2, 3]
    assert all("loss" in r for r in metrics.rows)
    summary = write_training_report(
        tmp_path,
        metrics,
        micro_batch=4,
        accumulation_steps=2,
        precision=choose_precision("auto", True, "cpu"),
        compile_status="off (eager)",
    )
    assert summary["effective_batch"] == 8 and summary["samples_per_s"] > 0
    assert (tmp_path / PLOT_NAME).is_file() and "precision: fp32" in (
        tmp_path / SUMMARY_NAME
    ).read_text()


# --- the pretrain stage on the stack ----------------------------------------------------------


def pretrain_context(tmp_path, gpus=1, **training):
    from pita.experiment.config import PitaConfig
    from pita.runtime.context import StageContext

    cfg = OmegaConf.structured(PitaConfig)
    cfg.pretrain.steps, cfg.pretrain.batch_size, cfg.pretrain.warmup_steps = 4, 16, 1
    for key, value in training.items():
        cfg.training[key] = value
    task = task_spec(
        id="pretrain.goal_walk.tiny",
        algo="*",
        stage="pretrain",
        fn="pita.stages.pretrain:pretrain",
        gpus=gpus,
        dataset_cfg={"name": "goal_walk", "num_nodes": 8},
        family_cfg={"reference_arch": {"n_layer": 1, "d_model": 32, "n_head": 2}},
    )
    if "parallel_strategy" in training:  # the gang the planner gives a training stage
        task.strategy = training["parallel_strategy"]
    out = tmp_path / "out"
    out.mkdir(parents=True, exist_ok=True)
    logger = logging.getLogger(f"test.pretrain.{random.random()}")
    return StageContext(task=task, cfg=cfg, run_dir=tmp_path, out_dir=out, logger=logger)


def test_pretrain_uses_the_stack_and_writes_the_report(tmp_path):
    ctx = pretrain_context(tmp_path, accumulation_steps=2)
    result = pretrain(ctx)
    assert result["precision"] == "fp32" and result["effective_batch"] == 16
    assert result["samples_per_s"] > 0 and result["compile"] == "off (eager)"
    for name in (PLOT_NAME, SUMMARY_NAME, "model/config.json"):
        assert (ctx.out_dir / name).is_file(), name
    assert (
        "micro-batch 8 x 2 accumulation step(s) x 1 rank(s)"
        in (ctx.out_dir / SUMMARY_NAME).read_text()
    )


def pretrain(ctx):
    from pita.stages.pretrain import pretrain as stage

    return stage(ctx)
