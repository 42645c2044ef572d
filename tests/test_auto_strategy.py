"""Issue 32 "Done when": sizing at dispatch and growth at a checkpoint are on by default where
they help. `training.parallel_strategy=auto` (the default) is resolved once per run
(pita/experiment/strategy.py): data_parallel on more than one CUDA GPU, none on CPU slots
and `fake:` devices (their ranks share the CPU cores); the resolved value is what the plan,
the workers, the saved config, run_info.json and a resume see.

CUDA devices are simulated as tests/test_gangs.py does: NVML's device list is replaced, so
the planner and the run's start see a node of H100s without a GPU here.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from pita.core.errors import ConfigError
from pita.core.paths import RunPaths
from pita.experiment import cli
from pita.experiment import run as run_module
from pita.experiment.run import build_plan, make_gpu_manager
from pita.experiment.strategy import resolve_parallel_strategy
from tests.conftest import only

H100_MB = 81559
CHAINS = only("reference", "QSharp")  # pretrain and Q#'s value training: both elastic


@pytest.fixture
def cuda(monkeypatch):
    """`cuda(n, mb)`: NVML lists n CUDA GPUs of mb MB each (CUDA_VISIBLE_DEVICES unset)."""
    from pita.core import gpu_manager
    from pita.core.gpu_manager import Device

    def node(n: int, mb: int = H100_MB) -> None:
        devices = [
            Device(i, "cuda", "H100", f"GPU-{i:04d}", mb, mb, nvml_index=i) for i in range(n)
        ]
        monkeypatch.setattr(gpu_manager, "query_nvml_devices", lambda: devices)

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return node


@pytest.mark.parametrize(
    "key, gpu_mode, kind, n, expected",
    [
        ("auto", "auto", "cuda", 4, "data_parallel"),
        ("auto", "multi_gpu", "cuda", 2, "data_parallel"),
        ("auto", "auto", "cuda", 1, "none"),
        ("auto", "single_gpu", "cuda", 1, "none"),
        ("auto", "auto", "fake", 4, "none"),
        ("auto", "auto", "cpu", 2, "none"),
        ("auto", "cpu", "cpu", 2, "none"),
        ("data_parallel", "auto", "fake", 4, "data_parallel"),
        ("fsdp", "auto", "cpu", 2, "fsdp"),
        ("none", "auto", "cuda", 8, "none"),
    ],
)
def test_auto_resolves_to_data_parallel_only_on_several_cuda_devices(
    key, gpu_mode, kind, n, expected
):
    value, why = resolve_parallel_strategy(key, gpu_mode, kind, n)
    assert value == expected
    if key != "auto":
        assert why == "explicit"


def test_the_default_is_auto_and_an_unknown_value_is_one_line_naming_the_key():
    """The exit-2 path of the command line: tests/test_config_errors.py."""
    from pita.experiment.config import validate

    assert cli.compose_config([]).training.parallel_strategy == "auto"
    with pytest.raises(ConfigError) as info:
        validate(cli.compose_config(["training.parallel_strategy=tensor_parallel"]))
    [line] = info.value.messages
    assert line.startswith("training.parallel_strategy=")
    assert "auto" in line and "data_parallel" in line and "\n" not in line


def _plan(overrides: list[str]):
    cfg = cli.compose_config([*CHAINS, *overrides])
    return build_plan(cfg, make_gpu_manager(cfg))


def _training(plan) -> dict:
    return {tid: t for tid, t in plan.tasks.items() if t.stage in ("pretrain", "train")}


def test_on_several_cuda_devices_auto_plans_elastic_training_tasks(cuda):
    cuda(4)
    plan = _plan([])
    training = _training(plan)
    assert set(training) == {"pretrain.goal_walk.tiny", "QSharp.goal_walk.tiny.r0.train"}
    assert {tuple(t.ranks) for t in training.values()} == {(1, 2, 4)}
    assert not any(t.ranks for tid, t in plan.tasks.items() if tid not in training)
    cuda(1)  # one GPU: no gang
    assert not any(t.ranks for t in _plan([]).tasks.values())
    cuda(4)  # an explicit value is kept
    assert not any(t.ranks for t in _plan(["training.parallel_strategy=none"]).tasks.values())
    assert not any(t.ranks for t in _plan(["system.gpu_mode=single_gpu"]).tasks.values())
    # debugging in this process: no rank processes (a breakpoint stops in the stage)
    for debug in ("executor.backend=inprocess", "system.use_parallel_execution=false"):
        assert not any(t.ranks for t in _plan([debug]).tasks.values())


@pytest.mark.parametrize("devices", ["fake:4", "cpu"])
def test_on_fake_devices_and_cpu_auto_plans_what_none_plans(devices):
    """Not elastic: the same plan, task for task, as the explicit `none`."""
    auto = _plan([f"system.devices={devices}"])
    none = _plan([f"system.devices={devices}", "training.parallel_strategy=none"])
    assert not any(t.ranks for t in auto.tasks.values())
    assert auto.to_json() == none.to_json()
    # the explicit choice is kept (CPU slots and fake devices can run DDP gangs)
    explicit = _plan([f"system.devices={devices}", "training.parallel_strategy=data_parallel"])
    assert any(t.ranks for t in explicit.tasks.values())


def test_a_model_too_large_for_one_cuda_device_keeps_its_smallest_fsdp_gang_under_auto(cuda):
    """On CUDA `auto` is data_parallel: the smallest FSDP gang that fits is the task's least
    k and the Sizer may give it more (tests/test_elastic.py, the same under data_parallel)."""
    from tests.test_gangs import BIG, _train_memory

    mem = _train_memory(BIG, "QSharp")
    cuda(4, (mem.per_rank_mb("fsdp", 2) + mem.per_rank_mb("none", 1)) // 2)
    train = _plan(BIG).tasks["QSharp.goal_walk.tiny.r0.train"]
    assert (train.gpus, train.strategy, train.ranks) == (2, "fsdp", [2, 4])


def test_a_model_too_large_on_fake_devices_is_refused_under_auto_as_under_none():
    """On `fake:` devices `auto` is none: a TRL stage only FSDP could fit is refused in the
    same one line (accelerate has no FSDP on CPU)."""
    from tests.test_gangs import BIG, BIG_REFERENCE, _devices, _train_memory

    mem = _train_memory([*BIG, *BIG_REFERENCE], "DPO")
    device = (mem.per_rank_mb("fsdp", 2) + mem.per_rank_mb("none", 1)) // 2
    base = [_devices(device, 2), *only("DPO"), *BIG, *BIG_REFERENCE]
    lines = []
    for key in ("auto", "none"):
        cfg = cli.compose_config([*base, f"training.parallel_strategy={key}"])
        with pytest.raises(ConfigError) as info:
            build_plan(cfg, make_gpu_manager(cfg))
        lines += info.value.messages
    assert lines[0] == lines[1] and "accelerate has no FSDP on CPU" in lines[0]


class _Started(Exception):
    """Raised where the run would start its workers: what they would get is captured."""


def _start_run(tmp_path, monkeypatch, overrides: list[str]):
    """run() up to its workers: (the config the workers would get, the run folder)."""
    seen = {}

    def start_session(cfg, *args):
        seen["cfg"] = cfg
        raise _Started

    monkeypatch.setattr(run_module, "_start_session", start_session)
    cfg = cli.compose_config(["experiment.name=auto", *CHAINS, *overrides])
    run_dir = tmp_path / "run"
    with pytest.raises(_Started):
        run_module.run(cfg, run_dir)
    return seen["cfg"], run_dir


@pytest.mark.parametrize(
    "n_cuda, devices, value, line",
    [
        (4, "auto", "data_parallel", "-> data_parallel (4 CUDA devices)"),
        (0, "fake:2", "none", "-> none (fake devices share the CPU)"),
    ],
)
def test_the_run_resolves_auto_once_for_workers_saved_config_run_info_and_log(
    tmp_path, monkeypatch, caplog, cuda, n_cuda, devices, value, line
):
    cuda(n_cuda)
    caplog.set_level("INFO", logger="pita")
    cfg, run_dir = _start_run(tmp_path, monkeypatch, [f"system.devices={devices}"])
    assert cfg.training.parallel_strategy == value  # what _start_session sends the workers
    assert [r.getMessage() for r in caplog.records if "parallel_strategy" in r.getMessage()] == [
        f"training.parallel_strategy=auto {line}"
    ]
    saved = OmegaConf.load(RunPaths(run_dir).saved_config)
    assert saved.training.parallel_strategy == value
    assert json.loads(RunPaths(run_dir).run_info.read_text())["parallel_strategy"] == value
    plan = json.loads(RunPaths(run_dir).plan.read_text())
    assert any(t["ranks"] for t in plan["tasks"]) == (value == "data_parallel")


def test_auto_on_a_resume_is_what_the_run_resolved(tmp_path, monkeypatch, cuda):
    """The run on 4 GPUs resolved data_parallel. The same command line again (its default
    `auto`) describes the same run, and a typed `training.parallel_strategy=auto` keeps
    data_parallel even where this machine would resolve none; a real change still counts."""
    cuda(4)
    overrides = ["experiment.name=auto", *CHAINS]
    _, run_dir = _start_run(tmp_path, monkeypatch, [])
    args = SimpleNamespace(config_name=None, config_dir=None)
    assert cli._same_run_overrides(str(run_dir), overrides, args) == []
    with pytest.raises(ConfigError, match="training.parallel_strategy: 'data_parallel' -> 'fsdp'"):
        cli._same_run_overrides(str(run_dir), [*overrides, "training.parallel_strategy=fsdp"], args)
    cuda(1)  # resumed on one GPU: auto would be none here
    cfg, _ = cli.load_resume_config(str(run_dir), ["training.parallel_strategy=auto"])
    assert cfg.training.parallel_strategy == "data_parallel"


def test_a_saved_auto_is_compared_as_what_the_resumed_run_resolved(tmp_path, cuda):
    """A run that stopped before it rewrote its saved config still holds `auto` there: the
    resume compares it as the value it resolves now, so no task runs again for it."""
    from pita.core.schema import resume_safe
    from pita.experiment.resume_fix import plan_change

    cuda(4)
    cfg = cli.compose_config(["experiment.name=auto", *CHAINS])
    paths = RunPaths(tmp_path)
    paths.saved_config.parent.mkdir(parents=True)
    paths.saved_config.write_text(OmegaConf.to_yaml(cfg))
    gpu = make_gpu_manager(cfg)
    plan = build_plan(cfg, gpu)
    resolved, _ = run_module.resolve_strategy(cfg, gpu)
    assert resolved.training.parallel_strategy == "data_parallel"
    assert cfg.training.parallel_strategy == "auto"  # the caller's config is not changed
    assert plan_change(resolved, tmp_path, plan, lambda c: build_plan(c, gpu), resume_safe) is None
    # a run that resolved (saved data_parallel) resumed with an explicit none: a change
    paths.saved_config.write_text(OmegaConf.to_yaml(resolved))
    resolved.training.parallel_strategy = "none"
    change = plan_change(resolved, tmp_path, plan, lambda c: build_plan(c, gpu), resume_safe)
    assert change is not None and "training.parallel_strategy" in change.keys


def test_the_dry_run_plans_with_the_resolved_value(tmp_path, capsys, caplog, cuda):
    """On 4 CUDA GPUs the dry run lists the elastic tasks with their k; on fake:4 none."""
    caplog.set_level("INFO", logger="pita")
    for devices, elastic in (("auto", True), ("fake:4", False)):
        cuda(4)
        cfg = cli.compose_config([*CHAINS, f"system.devices={devices}", "dry_run=true"])
        assert run_module.run(cfg, tmp_path / devices) == 0
        out = capsys.readouterr().out
        assert ("Elastic training tasks" in out) == elastic
        assert any(
            r.getMessage().startswith("training.parallel_strategy=auto -> ") for r in caplog.records
        )
        caplog.clear()
    assert not (tmp_path / "auto").exists()  # a dry run writes nothing
