"""Resume with a fix (issue 34 item 1): a resume may change any key; the tasks the change
touches (the keys each task recorded it read, or the task's own config identity) and
everything downstream run again, the rest is kept; `dry_run` with `resume_from` lists which
and why. Which task read which key is derived (issue 43 item 1): each task's manifest
records the keys its stage read with their values, and a saved config edited by hand is
named and what it changed runs again. The advice pita prints after a failure is followed by
a test, as a user would."""

from __future__ import annotations

import csv
import json
import re
import shutil

import pytest
from omegaconf import OmegaConf

from pita.core.paths import atomic_write_json
from pita.core.schema import resume_safe
from pita.experiment import cli
from pita.experiment.resume_fix import recorded_reads, touched_tasks
from pita.experiment.run import build_plan, make_gpu_manager
from tests.conftest import journal, only, run_cli, run_dirs

BASE = ["experiment=smoke", "system.devices=fake:1", *only("QSharp", "GRPO")]


def _plan(overrides: list[str]):
    cfg = cli.compose_config([*BASE, *overrides])
    return cfg, build_plan(cfg, make_gpu_manager(cfg))


def test_a_dataset_key_changes_each_tasks_own_identity_and_rounds_add_tasks(tmp_path):
    _, old = _plan([])

    def touched(change: list[str]) -> dict[str, str]:
        cfg, new = _plan(change)
        return touched_tasks(old, new, tmp_path, OmegaConf.to_container(cfg), resume_safe)

    by_dataset = touched(["dataset.test_size=30"])
    assert by_dataset["pretrain.goal_walk.tiny"] == "its own dataset_cfg changed"
    assert len(by_dataset) == len(old.tasks)  # every task carries the dataset mapping
    more = touched(["rounds_of_training=2"])
    assert more["GRPO.goal_walk.tiny.r1.train"] == "new task (the change adds it)"
    assert not any(".r0." in t or t.startswith("pretrain") for t in more)


# --- which task read which key: recorded by the tasks of a real run -------------------------


@pytest.fixture
def smoke_copy(smoke_run, tmp_path, monkeypatch):
    """A copy of the session's smoke run (every algorithm trained for real), to resume."""
    copy = tmp_path / "outputs" / "smoke" / smoke_run.run_dir.name
    shutil.copytree(smoke_run.run_dir, copy, symlinks=True)
    monkeypatch.chdir(tmp_path)
    for key, value in smoke_run.env.items():
        monkeypatch.setenv(key, value)
    return copy


def _dry_resume(run_dir, overrides: list[str], capsys) -> dict[str, str]:
    """task id -> why, as the dry run of `resume_from=run_dir *overrides` prints it."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main([f"resume_from={run_dir}", *overrides, "dry_run=true"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0, out
    rows = re.findall(r"^  (\S+)\s+(.+)$", out.split("Resume:", 1)[1], re.M)
    return {tid: why for tid, why in rows}


def test_each_finished_task_records_the_keys_it_read(smoke_copy):
    """The manifest lists what the stage read through its typed settings, with the value:
    the reference's evaluate read every enabled guided algorithm's rule; a TRL train its
    `trl` mapping; a gang-free pretrain its own keys, not another stage's."""
    reference = recorded_reads(smoke_copy, "reference.goal_walk.tiny.r0.evaluate.s00")
    assert reference is not None
    assert reference["algos.PITA.guidance.top_k"] == 2 and reference["algos.PITA.enabled"]
    assert "algos.QSharp.guidance.top_k" in reference and "evaluation.num_samples" in reference
    grpo = recorded_reads(smoke_copy, "GRPO.goal_walk.tiny.r0.train")
    assert grpo is not None and "algos.GRPO.trl" in grpo and "algos.DPO.beta" not in grpo
    pretrain = recorded_reads(smoke_copy, "pretrain.goal_walk.tiny")
    assert pretrain is not None and pretrain["pretrain.steps"] == 60
    assert not any(k.startswith(("evaluation.", "algos.")) for k in pretrain), pretrain


def test_a_guided_rule_change_reruns_the_references_evaluate(smoke_copy, capsys):
    """The High case of issue 43: `algos.PITA.guidance.top_k` is read by PITA's evaluate and
    by the reference's (it samples under every enabled guided rule): both run again, with
    what depends on them; nothing else does."""
    why = _dry_resume(smoke_copy, ["algos.PITA.guidance.top_k=3"], capsys)
    reads = "read algos.PITA.guidance.top_k=2, now 3"
    assert why["reference.goal_walk.tiny.r0.evaluate.s00"] == reads
    assert why["PITA.goal_walk.tiny.r0.evaluate.s00"] == reads
    assert why["reference.goal_walk.tiny.r0.evaluate"].startswith("its input")
    assert not [t for t in why if t.split(".")[0] not in ("reference", "PITA")], why
    assert not [t for t in why if ".train" in t or t.startswith("pretrain")], why


def test_disabling_the_guided_algorithms_reruns_the_references_evaluate(smoke_copy, capsys):
    off = [f"algos.{a}.enabled=false" for a in ("PITA", "QSharp", "QSharp-HF")]
    why = _dry_resume(smoke_copy, off, capsys)
    assert why["reference.goal_walk.tiny.r0.evaluate.s00"].startswith("read algos."), why
    assert not [t for t in why if t.startswith(("DPO", "GRPO", "pretrain"))], why


def test_a_trl_value_touches_only_that_algorithms_train_tasks(smoke_copy, capsys):
    why = _dry_resume(smoke_copy, ["algos.GRPO.trl.loss_type=dr_grpo"], capsys)
    direct = {t: w for t, w in why.items() if not w.startswith("its input")}
    assert list(direct) == ["GRPO.goal_walk.tiny.r0.train"], why
    assert direct["GRPO.goal_walk.tiny.r0.train"].startswith("read algos.GRPO.trl={")
    assert _dry_resume(smoke_copy, ["system.devices=fake:1", "logger.backend=csv"], capsys) == {}


def test_a_hand_edited_saved_config_is_named_and_what_it_changed_runs_again(smoke_copy, capsys):
    """The saved config is the run's own (its sha256 is in the journal): edited by hand, the
    resume names it in one line and re-runs what the edit changed, as a fix would."""
    saved = smoke_copy / ".hydra" / "config.yaml"
    cfg = OmegaConf.load(saved)
    cfg.evaluation.num_samples = 3
    saved.write_text(OmegaConf.to_yaml(cfg))
    with pytest.raises(SystemExit) as exit_info:
        cli.main([f"resume_from={smoke_copy}", "dry_run=true"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0, out
    [line] = [ln for ln in out.splitlines() if "edited since the run wrote it" in ln]
    assert line.startswith(f"{saved} was edited since the run wrote it (sha256 ")
    assert re.search(
        r"reference\.goal_walk\.tiny\.r0\.evaluate\.s00\s+read evaluation\.num_samples=2, now 3",
        out,
    )
    assert "pretrain.goal_walk.tiny " not in out.split("Resume:", 1)[1]


def test_a_manifest_without_recorded_reads_is_taken_to_read_every_key(smoke_copy, capsys):
    """A folder written before tasks recorded their reads: any changed key reaches it."""
    manifest = smoke_copy / "tasks" / "pretrain.goal_walk.tiny" / "manifest.json"
    data = json.loads(manifest.read_text())
    del data["reads"]
    manifest.write_text(json.dumps(data))
    why = _dry_resume(smoke_copy, ["evaluation.num_samples=3"], capsys)
    assert why["pretrain.goal_walk.tiny"] == (
        "its manifest records no reads (older pita); evaluation.num_samples changed"
    )
    assert why["DPO.goal_walk.tiny.r0.train"].startswith("its input")  # what it feeds


def _saved_run(tmp_path, overrides: list[str]):
    cfg = cli.compose_config([*BASE, *overrides])
    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    atomic_write_json(run_dir / "plan.json", build_plan(cfg, make_gpu_manager(cfg)).to_json())
    return run_dir


def test_dry_run_of_a_resume_with_a_fix_lists_what_runs_and_why(smoke_copy, capsys):
    """Today's code refused this command ("cannot change on resume"); now it lists the
    tasks the change touches and changes no file."""
    before = {p: p.read_bytes() for p in smoke_copy.rglob("*") if p.is_file()}
    fix = "algos.GRPO.trl.loss_type=dr_grpo"
    with pytest.raises(SystemExit) as exit_info:
        cli.main([f"resume_from={smoke_copy}", fix, "dry_run=true"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0, out
    assert "Config changed on resume: algos.GRPO.trl.loss_type: '<absent>' -> 'dr_grpo'" in out
    assert re.search(r"GRPO\.goal_walk\.tiny\.r0\.train\s+read algos\.GRPO\.trl=\{", out)
    assert re.search(r"GRPO\.goal_walk\.tiny\.r0\.evaluate\S*\s+its input \S+ runs again", out)
    assert {p: p.read_bytes() for p in smoke_copy.rglob("*") if p.is_file()} == before


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
    assert re.search(r"GRPO\.goal_walk\.tiny\.r0\.train\s+failed", dry.stdout)
    assert "pretrain.goal_walk.tiny" not in dry.stdout.split("Resume:")[1]  # kept
    second = run_cli([resume, fix], tmp_path, env, timeout=900)
    assert second.returncode == 0, second.stdout + second.stderr
    events = journal(run_dir)
    changed = next(i for i, e in enumerate(events) if e["event"] == "run_changed")
    assert (
        events[changed]["touched"] == []
    )  # the failed train runs anyway; no finished task read it
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


def _rows(run_dir) -> list[dict[str, str]]:
    """The results table without its timing column (the one thing two runs differ in)."""
    with open(run_dir / "results" / "summary.csv") as f:
        return [{k: v for k, v in row.items() if k != "wall_s"} for row in csv.DictReader(f)]


@pytest.mark.long
@pytest.mark.slow
def test_a_resume_with_a_fix_gives_a_fresh_runs_rows_and_so_does_an_edited_config(tmp_path):
    """Planted for real: a run at `guidance.top_k=2`, resumed with `top_k=3`, has the rows of
    a fresh run at 3 (the reference's `top-3` row included: no stale `top-2` row beside the
    guided rows). Its saved config then edited back to 2 by hand: the resume names the file
    and ends with the first run's rows again."""
    args = ["experiment=smoke", *only("reference", "PITA"), "pretrain.steps=20"]
    args += ["executor.cpu_workers=1", "executor.progress=false"]
    first = run_cli([*args, "experiment.name=a"], tmp_path, timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr
    [run_a] = run_dirs(tmp_path, "a")
    rows_at_2 = _rows(run_a)
    fresh = run_cli([*args, "experiment.name=b", "algos.PITA.guidance.top_k=3"], tmp_path)
    assert fresh.returncode == 0, fresh.stdout + fresh.stderr
    [run_b] = run_dirs(tmp_path, "b")
    assert _rows(run_b) != rows_at_2  # the change shows in the table
    fixed = run_cli([f"resume_from={run_a}", "algos.PITA.guidance.top_k=3"], tmp_path)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert _rows(run_a) == _rows(run_b)
    events = journal(run_a)
    [changed] = [e for e in events if e["event"] == "run_changed"]
    assert "reference.goal_walk.tiny.r0.evaluate.s00" in changed["touched"]
    rerun = {e["task"] for e in events[events.index(changed) :] if e["event"] == "task_running"}
    assert "pretrain.goal_walk.tiny" not in rerun and "PITA.goal_walk.tiny.r0.train" not in rerun

    saved = run_a / ".hydra" / "config.yaml"
    cfg = OmegaConf.load(saved)
    cfg.algos.PITA.guidance.top_k = 2
    saved.write_text(OmegaConf.to_yaml(cfg))
    edited = run_cli([f"resume_from={run_a}"], tmp_path)
    assert edited.returncode == 0, edited.stdout + edited.stderr
    assert f"{saved} was edited since the run wrote it" in edited.stdout + edited.stderr
    assert _rows(run_a) == rows_at_2
    again = run_cli([f"resume_from={run_a}", "dry_run=true"], tmp_path)  # the edit is the run's
    assert "edited since" not in again.stdout + again.stderr
    assert "Resume: 0 task(s) will run" in again.stdout


def test_stages_read_config_keys_only_where_the_reads_are_recorded():
    """A stage's reads are recorded through its typed settings (and `ctx.algo_settings`,
    `ctx.batch_size_safety_margin`); a raw `ctx.cfg.<key>` would escape the record, and a
    resume that changes that key would keep a stale folder. The chain's own `model` and
    `dataset` groups are the task's identity (compared task by task), `executor` affects no
    result."""
    import ast

    from tests.conftest import ROOT

    allowed = {"model", "dataset", "get"}
    bad = []
    for path in sorted((ROOT / "pita").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            inner = getattr(node, "value", None)
            raw = (
                isinstance(inner, ast.Attribute)
                and inner.attr == "cfg"
                and isinstance(inner.value, ast.Name)
                and inner.value.id == "ctx"
            )
            if raw and isinstance(node, ast.Subscript):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: ctx.cfg[...]")
            elif raw and isinstance(node, ast.Attribute) and node.attr not in allowed:
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: ctx.cfg.{node.attr}")
    assert bad == [], bad
