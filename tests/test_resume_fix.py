"""Resume with a fix (issue 34 item 1): a resume may change any key; the tasks the change
touches (the keys each stage reads, or the task's own config identity) and everything
downstream run again, the rest is kept; `dry_run` with `resume_from` lists which and why.
The advice pita prints after a failure is followed by a test, as a user would."""

from __future__ import annotations

import json
import re

import pytest
from omegaconf import OmegaConf

from pita.core.paths import atomic_write_json
from pita.core.schema import resume_safe
from pita.experiment import cli
from pita.experiment.resume_fix import changed_keys, touched_tasks
from pita.experiment.run import build_plan, make_gpu_manager
from tests.conftest import journal, only, run_cli, run_dirs

BASE = ["experiment=smoke", "system.devices=fake:1", *only("QSharp", "GRPO")]


def _plan(overrides: list[str]):
    cfg = cli.compose_config([*BASE, *overrides])
    return cfg, build_plan(cfg, make_gpu_manager(cfg))


def _touched(change: list[str]) -> dict[str, str]:
    old_cfg, old = _plan([])
    new_cfg, new = _plan(change)
    keys = changed_keys(
        OmegaConf.to_container(old_cfg, resolve=True),
        OmegaConf.to_container(new_cfg, resolve=True),
        resume_safe,
    )
    return touched_tasks(old, new, keys)


def test_a_trl_value_touches_only_that_algorithms_train_tasks():
    touched = _touched(["algos.GRPO.trl.loss_type=dr_grpo"])
    assert touched == {
        "GRPO.goal_walk.tiny.r0.train": "reads algos.GRPO.trl.loss_type, changed",
    }


def test_keys_reach_the_stages_that_read_them():
    evaluate = _touched(["evaluation.num_samples=3"])
    assert evaluate and all(".evaluate" in t for t in evaluate), evaluate
    pretrain = _touched(["pretrain.steps=61"])
    assert list(pretrain) == ["pretrain.goal_walk.tiny"]
    assert _touched(["system.devices=fake:1", "executor.max_retries=3", "logger.backend=csv"]) == {}


def test_a_dataset_key_changes_each_tasks_own_identity_and_rounds_add_tasks():
    touched = _touched(["dataset.test_size=30"])
    assert touched["pretrain.goal_walk.tiny"] == "its own dataset_cfg changed"
    assert len(touched) == len(_plan([])[1].tasks)  # every task carries the dataset mapping
    more = _touched(["rounds_of_training=2"])
    assert more["GRPO.goal_walk.tiny.r1.train"] == "new task (the change adds it)"
    assert not any(".r0." in t or t.startswith("pretrain") for t in more)


def _saved_run(tmp_path, overrides: list[str]):
    cfg = cli.compose_config([*BASE, *overrides])
    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    atomic_write_json(run_dir / "plan.json", build_plan(cfg, make_gpu_manager(cfg)).to_json())
    return run_dir


def test_dry_run_of_a_resume_with_a_fix_lists_what_runs_and_why(tmp_path, capsys, monkeypatch):
    """Today's code refused this command ("cannot change on resume"); now it lists the
    tasks the change touches and changes no file."""
    monkeypatch.chdir(tmp_path)
    run_dir = _saved_run(tmp_path, [])
    before = {p.name: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    with pytest.raises(SystemExit) as exit_info:
        cli.main([f"resume_from={run_dir}", "algos.GRPO.trl.loss_type=dr_grpo", "dry_run=true"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0, out
    assert "Config changed on resume: algos.GRPO.trl.loss_type: '<absent>' -> 'dr_grpo'" in out
    assert re.search(r"GRPO\.goal_walk\.tiny\.r0\.train\s+reads algos\.GRPO\.trl\.loss_type", out)
    assert re.search(r"GRPO\.goal_walk\.tiny\.r0\.evaluate\S*\s+its input \S+ runs again", out)
    assert re.search(r"pretrain\.goal_walk\.tiny\s+not finished", out)
    assert {p.name: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


def test_a_relative_resume_folder_reaches_the_workers_absolute(tmp_path, monkeypatch):
    """`resume_from=outputs/x/<ts>` as typed from the user's folder: workers run from pita's
    folder, where the relative path named nothing (GRPO's train then took the pretrained
    model's path for a hub id)."""
    monkeypatch.chdir(tmp_path)
    _saved_run(tmp_path, [])
    cfg, run_dir = cli.load_resume_config("run", [])
    assert run_dir == tmp_path / "run" and cfg.resume_from == str(tmp_path / "run")


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("dataset=gsm8k", "dataset=gsm8k: a config group or Hydra setting cannot change on resume"),
        ("algos.GRPO.betta=0.1", "algos.GRPO.betta: unknown key"),
        ("trainig.compile=true", "did you mean training.compile?"),
        ("algos.GRPO.trl.loss_type=dr_grpoo", "did you mean dr_grpo?"),
    ],
)
def test_a_bad_fix_is_still_one_line_exit_2(override, expected, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_dir = _saved_run(tmp_path, [])
    with pytest.raises(SystemExit) as exit_info:
        cli.main([f"resume_from={run_dir}", override])
    assert exit_info.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert expected in line, line


TOKEN = "hf_" + "PlantedSecret0" * 3  # a token-shaped secret, planted where a user keeps it


@pytest.mark.slow
def test_the_printed_advice_after_a_failed_task_finishes_the_run(tmp_path):
    """A value TRL refuses only inside the trainer (generation_batch_size not divisible by
    the group: arithmetic across fields, not a choice) fails GRPO's train task; the run
    prints the resume command; that command with the fixed key finishes the run, keeping
    the pretrained reference. Secrets (issue 34 item 3): HF_TOKEN / WANDB_API_KEY in the
    environment of both runs and a hub_token tried on the command line end up in no file of
    the run folder."""
    env = {"HF_TOKEN": TOKEN, "WANDB_API_KEY": TOKEN[::-1]}
    args = ["experiment=smoke", *only("GRPO"), "experiment.name=fix", "pretrain.steps=20"]
    args += ["executor.cpu_workers=1"]  # one worker importing torch, not one per core
    first = run_cli([*args, "algos.GRPO.trl.generation_batch_size=3"], tmp_path, env, timeout=900)
    assert first.returncode == 1, first.stdout + first.stderr
    advice = re.search(
        r"finish the run with: python run_parallel\.py (resume_from=\S+)", first.stdout
    )
    assert advice, first.stdout
    resume = advice.group(1)
    [run_dir] = run_dirs(tmp_path, "fix")
    assert resume == f"resume_from={run_dir}"
    refused = run_cli([resume, f"algos.GRPO.trl.hub_token={TOKEN}"], tmp_path, env, timeout=300)
    assert refused.returncode == 2 and TOKEN not in refused.stdout + refused.stderr
    fix = "algos.GRPO.trl.generation_batch_size=16"
    dry = run_cli([resume, fix, "dry_run=true"], tmp_path, env, timeout=300)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert re.search(
        r"GRPO\.goal_walk\.tiny\.r0\.train\s+reads algos\.GRPO\.trl\.generation_batch_size",
        dry.stdout,
    )
    assert "pretrain.goal_walk.tiny" not in dry.stdout.split("Resume:")[1]  # kept
    second = run_cli([resume, fix], tmp_path, env, timeout=900)
    assert second.returncode == 0, second.stdout + second.stderr
    events = journal(run_dir)
    changed = next(i for i, e in enumerate(events) if e["event"] == "run_changed")
    assert events[changed]["touched"] == ["GRPO.goal_walk.tiny.r0.train"]
    after = [e.get("task") for e in events[changed:] if e["event"] == "task_running"]
    assert "pretrain.goal_walk.tiny" not in after and "GRPO.goal_walk.tiny.r0.train" in after
    saved = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    assert saved.algos.GRPO.trl.generation_batch_size == 16
    assert json.loads((run_dir / "plan.json").read_text())["tasks"]
    files = [p for p in run_dir.rglob("*") if p.is_file() and not p.is_symlink()]
    assert len(files) > 20
    for secret in (TOKEN, TOKEN[::-1]):
        leaked = [str(p) for p in files if secret.encode() in p.read_bytes()]
        assert leaked == [], leaked
