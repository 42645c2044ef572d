"""Bad input: every bad config, override or resume path is one line naming the key, exit 2,
no traceback, and nothing is created (no run folder, no worker)."""

from __future__ import annotations

import os
import shutil

import pytest

from pita.experiment import cli
from tests.conftest import ROOT, only, run_cli

BAD = [
    (["foo=1"], "foo: unknown key"),
    (
        ["experiment.name=ok", "system.devices=fake:[80GB,40GB]"],
        "system.devices=fake:[80GB,40GB]: not a valid override",
    ),
    (["algos.PITA.lrr=0.1"], "algos.PITA.lrr: unknown key"),
    (["dataset.num_nodes=abc"], "dataset.num_nodes=abc"),
    (["experiment=nope"], "experiment=nope: no such experiment config"),
    (["dataset=nope"], "dataset=nope: no such dataset config"),
    (["experiment.name=../escape"], "experiment.name="),
    (["experiment.name=a/b"], "experiment.name="),
    (["experiment.name=.."], "experiment.name="),
    (["system.devices=gpu"], "system.devices="),
    (["system.devices=fake:0"], "system.devices="),
    (["system.devices=fake:[80XB]"], "system.devices="),
    (["system.devices=[-1]"], "system.devices="),
    (["system.devices=[0,0]"], "system.devices="),
    (["system.devices=[0]"], "system.devices=[0]: no NVIDIA GPU found"),
    (["system.gpu_mode=turbo"], "system.gpu_mode="),
    (["system.attn_impl=fast"], "system.attn_impl="),
    (["executor.backend=slurm"], "executor.backend="),
    (["executor.max_retries=-1"], "executor.max_retries="),
    (["executor.cpu_workers=0"], "executor.cpu_workers="),
    (["executor.heartbeat_timeout_s=1", "executor.heartbeat_s=2"], "executor.heartbeat_timeout_s="),
    (["generation.batch_size=0"], "generation.batch_size="),
    (["generation.batch_size=huge"], "generation.batch_size="),
    (["generation.temperature=0"], "generation.temperature="),
    (["generation.top_p=1.5"], "generation.top_p="),
    (["data_collection.reward_batch_size=-4"], "data_collection.reward_batch_size="),
    (["evaluation.etas=[]"], "evaluation.etas="),
    (["evaluation.num_samples=0"], "evaluation.num_samples="),
    (["batch_size_safety_margin=1.5"], "batch_size_safety_margin="),
    (["rounds_of_training=0"], "rounds_of_training="),
    (["training.precision_type=fp8"], "training.precision_type="),
    (["training.parallel_strategy=tensor_parallel"], "training.parallel_strategy="),
    (["model.dtype=int3"], "model.dtype="),
    (only(), "algos: no algorithm enabled"),
    (
        ["algos.QSharp.enabled=true", "algos.QSharp.guidance.mode=greedy"],
        "algos.QSharp.guidance.mode=",
    ),
    (["algos.QSharp.enabled=true", "algos.QSharp.V_min=2"], "algos.QSharp.V_min="),
    (["algos.QSharp.enabled=true", "algos.QSharp.loss_type=hinge"], "algos.QSharp.loss_type="),
    (["+algos.FOO.enabled=true"], "algos.FOO"),
    (["algos.QSharp.enabled=true", "algos.QSharp.value_head=w"], "algos.QSharp.value_head="),
    (
        [
            "algos.PITA.enabled=true",
            "algos.PITA.value_head=v",
            "algos.PITA.loss_type=bradley_terry",
        ],
        "algos.PITA.value_head=",
    ),
    (["algos.QSharp.enabled=true", "algos.QSharp.lr_schedule=linear"], "algos.QSharp.lr_schedule="),
    (
        ["algos.QSharp.enabled=true", "algos.QSharp.warm_start_layers=-2"],
        "algos.QSharp.warm_start_layers=",
    ),
    (
        ["algos.QSharp.enabled=true", "algos.QSharp.holdout_fraction=1"],
        "algos.QSharp.holdout_fraction=",
    ),
    (["data_collection.recipe=best_of_n"], "data_collection.recipe="),
    (["data_collection.max_tries=0"], "data_collection.max_tries="),
    (["dataset.out_degree=16"], "dataset.out_degree="),
    (["dataset.degree=3"], "dataset.degree"),
    (
        ["resume_from=/definitely/not/here"],
        "resume_from='/definitely/not/here': no such run folder",
    ),
    (["+executor.stage_overrides.any.train=nocolon"], "executor.stage_overrides.any.train="),
    # issue 20: the schema declares each key's range and each algorithm's keys
    (["+training.lr=0.1"], "training.lr: unknown key"),
    (["+algos.GRPO.betta=0.1"], "algos.GRPO.betta: unknown key"),
    (["algos.DPO.num_atoms=5"], "algos.DPO.num_atoms: unknown key"),
    (["training.weight_decay=-1"], "training.weight_decay=-1.0: must be >= 0"),
    (["algos.QSharp.guidance.mode=greedy"], "expectation | expectation_clamped"),
    # issue 34: a "did you mean" for every misspelt key, and what TRL checks only in the task
    (
        ["algos.PITA.lrr=0.1"],
        "algos.PITA.lrr: unknown key (not in pita's config schema, see conf/ "
        "and pita/core/schema.py); did you mean algos.PITA.lr?",
    ),
    (
        ["+trainig.compile=true"],
        "trainig: unknown key (not in pita's config schema, see conf/ and pita/core/schema.py); did you mean training?",
    ),
    (["+algos.GRPO.betta=0.1"], "did you mean algos.GRPO.beta?"),
    (
        ["algos.GRPO.trl.loss_type=dr_grpoo"],
        "algos.GRPO.trl.loss_type='dr_grpoo': not a value TRL's GRPOConfig accepts",
    ),
    (["algos.DPO.trl.optim=adamw_bnb_8bit"], "needs the bitsandbytes package"),
    (
        ["algos.DPO.trl.deepspeed=/tmp/ds.json"],
        "algos.DPO.trl.deepspeed: needs the deepspeed package",
    ),
    (["algos.DPO.trl.trust_remote_code=true"], "set model.trust_remote_code=true instead"),
    (["dataset=gsm8kk"], "dataset=gsm8kk: no such dataset config; available: "),
    (["dataset=gsm8kk"], "; did you mean dataset=gsm8k?"),
]


@pytest.mark.parametrize("overrides, expected", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_input_is_one_line_exit_2(overrides, expected, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(overrides)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("error: ") and expected in err[0], err[0]
    assert not (tmp_path / "outputs").exists()


def test_resume_path_errors(tmp_path, capsys):
    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "empty_dir").mkdir()
    for path, expected in [
        (tmp_path / "file.txt", "not a folder"),
        (tmp_path / "empty_dir", "no saved config"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            cli.main([f"resume_from={path}"])
        assert exit_info.value.code == 2
        assert expected in capsys.readouterr().err


def test_real_process_exit_code_and_no_traceback(tmp_path):
    proc = run_cli(["system.devices=fake:0", "experiment.name=x"], tmp_path, timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr + proc.stdout
    assert proc.stderr.strip().startswith("error: system.devices='fake:0'")
    assert not (tmp_path / "outputs").exists()


# ---- issue 13: preflight finishes the job (each case exits 2 before any worker starts) -----

PREFLIGHT_BAD = [
    (
        ["evaluation.etas=[0.0,inf]"],
        "evaluation.etas=[0.0, inf]: item 1 (inf) must be a finite number",
    ),
    (["algos.DPO.beta=nan"], "algos.DPO.beta=nan: must be a finite number"),
    (["pretrain.lr=nan"], "pretrain.lr=nan: must be a finite number"),
    (["model.memory_gb=inf"], "model.memory_gb=inf: must be a finite number"),
    (["generation.temperature=-inf"], "generation.temperature=-inf: must be a finite number"),
    (["experiment.name=${oops}"], "experiment.name='${oops}': interpolation cannot be resolved"),
    (
        ["experiment.name=é"],
        "experiment.name=é: not a valid override: a value with non-ASCII characters must be quoted",
    ),
    (['experiment.name="é"'], "experiment.name='é': letters, digits"),
    (["+algos.Ü.enabled=true"], "+algos.Ü.enabled: keys are ASCII names"),
    (  # on a fake 80 GB device: on cpu slots the memory check (free RAM) could come first
        ["dataset=gsm8k", "system.devices=fake:1"],
        "dataset='gsm8k' with model='tiny': a hub task is tokenized by its model family's tokenizer",
    ),
    (
        ["model.name=mine-4bit", f"model.reference={ROOT}", f"model.guide={ROOT}"],
        "model.name='mine-4bit': -4bit aliases load with bitsandbytes on CUDA GPUs, but this run's devices are cpu",
    ),
    (["hydra.run.dir=/proc/pita-out"], "hydra.run.dir='/proc/pita-out': cannot write in /proc"),
    (["executor.start_timeout_s=0"], "executor.start_timeout_s=0"),
]


@pytest.mark.parametrize(
    "overrides, expected", PREFLIGHT_BAD, ids=[" ".join(o) for o, _ in PREFLIGHT_BAD]
)
def test_preflight_bad_input_is_one_line_exit_2(overrides, expected, tmp_path, capsys, monkeypatch):
    test_bad_input_is_one_line_exit_2(overrides, expected, tmp_path, capsys, monkeypatch)


def _conf_copy(tmp_path, monkeypatch, name: str, text: str) -> None:
    """A copy of conf/ with one extra experiment file (a user's own experiment)."""
    project = tmp_path / "project"
    shutil.copytree(ROOT / "conf", project / "conf")
    (project / "conf" / "experiment" / f"{name}.yaml").write_text(text)
    monkeypatch.setattr(cli, "CONF_DIR", project / "conf")
    monkeypatch.setattr(cli, "PROJECT_ROOT", project)


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            "# @package _global_\nexperiment:\n  name: bad\n  seed: [1, 2\nrounds_of_training: 2\n",
            "conf/experiment/mine.yaml:5:19: YAML syntax error: expected ',' or ']', but got ':'",
        ),
        (
            "# @package _global_\nexperiment:\n  name: ${oops}\n",
            "experiment.name='${oops}': interpolation cannot be resolved (Interpolation key 'oops' not found); "
            "set in conf/experiment/mine.yaml",
        ),
        (
            "# @package _global_\nexperiment:\n  nmae: typo\n",
            "conf/experiment/mine.yaml: experiment.nmae: Key 'nmae'",
        ),
        (
            "# @package _global_\nexperiment:\n  nmae: typo\n",
            "; did you mean experiment.name?",
        ),
    ],
)
def test_errors_in_an_experiment_file_name_file_and_key(
    text, expected, tmp_path, capsys, monkeypatch
):
    _conf_copy(tmp_path, monkeypatch, "mine", text)
    test_bad_input_is_one_line_exit_2(["experiment=mine"], expected, tmp_path, capsys, monkeypatch)


def _hub_family(tmp_path) -> list[str]:
    """A custom family on local folders: no hub, no built-in tokenizer."""
    folder = tmp_path / "my-model"
    folder.mkdir(exist_ok=True)
    return ["model.name=mine", f"model.reference={folder}", f"model.guide={folder}"]


def test_malformed_jsonl_is_caught_from_its_first_lines(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data.jsonl").write_text(
        '{"question": "1+1?", "answer": "2"}\n{"question": "2+2?", answer: 4}\n'
    )
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["dataset=gsm8k", "dataset.path=data.jsonl", *_hub_family(tmp_path)])
    assert exit_info.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(
        f"error: dataset.path='{tmp_path / 'data.jsonl'}': data.jsonl line 2 is not valid JSON"
    )


def test_relative_dataset_path_is_made_absolute_against_the_users_folder(tmp_path, monkeypatch):
    from pita.experiment.preflight import absolutize_paths

    (tmp_path / "data.jsonl").write_text('{"question": "1+1?", "answer": "2"}\n')
    monkeypatch.chdir(tmp_path)
    cfg = cli.compose_config(["dataset=gsm8k", "dataset.path=data.jsonl", *_hub_family(tmp_path)])
    cli.preflight(cfg, [])  # no error: checked where the user is ...
    assert cfg.dataset.path == str(
        tmp_path / "data.jsonl"
    )  # ... and workers (cwd = project root) read that
    assert absolutize_paths(cfg) == []  # idempotent


def test_offline_hub_model_not_in_cache_fails_fast(tmp_path):
    proc = run_cli(
        # a fake 80 GB device: on cpu slots (a share of the free RAM) the memory check could
        # refuse the run before the cache is looked at
        ["model=gpt2", "experiment.name=x", "system.devices=fake:1"],
        tmp_path,
        {
            "HF_HUB_OFFLINE": "1",
            "HF_HOME": str(tmp_path / "hf"),
            "HF_HUB_CACHE": str(tmp_path / "hf"),
        },
        timeout=60,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith("error: model.reference='gpt2': not in the local Hugging Face cache")
    assert "HF_HUB_OFFLINE is set" in lines[0] and "hf download gpt2" in lines[0]
    assert all(ln.startswith("error: model.") for ln in lines) and "Traceback" not in proc.stderr
    assert not (tmp_path / "outputs").exists()


def test_output_folder_that_is_a_file(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs").write_text("not a folder")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["experiment.name=x"])
    assert exit_info.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert (
        line.startswith("error: hydra.run.dir='outputs/x':") and "is a file, not a folder" in line
    )


def _saved_run(tmp_path, overrides: list[str]):
    """A real run folder as a fresh run leaves it before its first task: config + plan."""
    from omegaconf import OmegaConf

    from pita.core.paths import atomic_write_json
    from pita.experiment.run import build_plan, make_gpu_manager

    cfg = cli.compose_config(overrides)
    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    atomic_write_json(run_dir / "plan.json", build_plan(cfg, make_gpu_manager(cfg)).to_json())
    return run_dir


def test_resume_onto_fewer_devices_than_the_plan_needs(tmp_path, capsys):
    run_dir = _saved_run(
        tmp_path, ["system.devices=fake:2", "model.gpus_per_task=2", *only("reference")]
    )
    with pytest.raises(SystemExit) as exit_info:
        cli.main([f"resume_from={run_dir}", "system.devices=fake:1"])
    assert exit_info.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(
        "error: system.devices='fake:1' on resume (1 device(s)): model.gpus_per_task=2: task"
    )
    assert not (run_dir / "journal.jsonl").exists()


def test_stage_override_is_logged_and_not_imported_on_dry_run(tmp_path):
    """Config is code: an override's package is located, never imported, by the
    orchestrator; a WARNING names it."""
    pkg = tmp_path / "evilpkg"
    pkg.mkdir()
    marker = tmp_path / "imported"
    (pkg / "__init__.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    (pkg / "stages.py").write_text("def train(ctx):\n    return {}\n")
    proc = run_cli(
        [
            "dry_run=true",
            "system.devices=fake:1",
            "+executor.stage_overrides.any.train=evilpkg.stages:train",
        ],
        tmp_path,
        {"PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not marker.exists(), "the orchestrator ran the override's package code"
    assert (
        "executor.stage_overrides.any.train=evilpkg.stages:train: config is code"
        in proc.stdout + proc.stderr
    )


def test_a_quantized_family_with_a_trained_policy_is_refused_before_the_run():
    """On CUDA a -8bit / -4bit alias loads, but DPO / GRPO train the policy in fp32: the
    task would refuse it (placement.trained_policy_refusal), so preflight says it first;
    with only guided algorithms (π_ref frozen) the alias is fine."""
    from pita.experiment.preflight import _families, _family_errors

    family = ["model.name=mine-4bit", f"model.reference={ROOT}", f"model.guide={ROOT}"]
    cfg = cli.compose_config([*family, "dataset=gsm8k"])
    [line] = _family_errors(cfg, _families(cfg), "cuda")
    assert line.startswith("model.name='mine-4bit': algos.DPO trains the family's policy"), line
    assert "drop the suffix or disable algos.DPO" in line
    guided = cli.compose_config([*family, "dataset=gsm8k", *only("reference", "QSharp")])
    assert _family_errors(guided, _families(guided), "cuda") == []
