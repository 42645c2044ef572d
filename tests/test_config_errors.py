"""Bad input: every bad config, override or resume path is one line naming the key, exit 2,
no traceback, and nothing is created (no run folder, no worker)."""

from __future__ import annotations

import pytest

from pita.experiment import cli
from tests.conftest import only, run_cli

BAD = [
    (["foo=1"], "foo: unknown key"),
    (["experiment.name=ok", "system.devices=fake:[80GB,40GB]"], "system.devices=fake:[80GB,40GB]: not a valid override"),
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
    (["training.parallel_strategy=fsdp"], "training.parallel_strategy="),
    (["model.dtype=int3"], "model.dtype="),
    (only(), "algos: no algorithm enabled"),
    (["algos.QSharp.enabled=true", "algos.QSharp.guidance.mode=greedy"], "algos.QSharp.guidance.mode="),
    (["algos.QSharp.enabled=true", "algos.QSharp.V_min=2"], "algos.QSharp.V_min="),
    (["algos.QSharp.enabled=true", "algos.QSharp.loss_type=hinge"], "algos.QSharp.loss_type="),
    (["+algos.FOO.enabled=true"], "algos.FOO"),
    (["dataset.out_degree=16"], "dataset.out_degree="),
    (["dataset.degree=3"], "dataset.degree"),
    (["resume_from=/definitely/not/here"], "resume_from='/definitely/not/here': no such run folder"),
    (["+executor.stage_overrides.any.train=nocolon"], "executor.stage_overrides.any.train="),
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
    for path, expected in [(tmp_path / "file.txt", "not a folder"), (tmp_path / "empty_dir", "no saved config")]:
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
