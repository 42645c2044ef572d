"""What a key affects is declared once, on its field (`spec(affects=..., memory=...)` in
pita/core/schema.py), and four lists are derived from it (issue 33.2): the keys a resume may
change (and the CLI's refusal), what a checkpoint's identity leaves out, the duration cache's
key and the peak cache's key. Each test changes every key of a kind and checks the list
follows; the docs sentence naming the resume-safe keys is checked against the schema."""

from __future__ import annotations

import copy
import logging
import re
from typing import Any

import pytest
from omegaconf import OmegaConf

from pita.algos.registry import ALGORITHMS
from pita.core import schema as S
from pita.core.paths import RunPaths
from pita.experiment import cli
from pita.experiment.durations import duration_key
from pita.experiment.estimates import peak_key
from pita.experiment.plan import plan_experiment
from pita.runtime.context import StageContext
from pita.runtime.kit import checkpoint_identity
from tests.conftest import ROOT

# the keys a resume changes without running a task again, as docs/operations.md lists them
RESUME_SAFE_TEXT = S.describe_keys(S.resume_safe_keys())


@pytest.fixture(scope="module")
def composed() -> dict:
    return OmegaConf.to_container(cli.compose_config(["algos.GRPO.enabled=true"]), resolve=True)


def _changed(value: Any) -> Any:
    """Another valid-looking value of the same kind (the lists compare configs, not rules)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, list):
        return [*value, value[0] if value else 1]
    if isinstance(value, dict):
        return {**value, "extra": 1}
    return "set"  # None


def _with(cfg: dict, key: str, value: Any) -> dict:
    out = copy.deepcopy(cfg)
    node = out
    *parents, last = key.split(".")
    for part in parents:
        node = node[part]
    node[last] = value
    return out


def _leaves(kinds: tuple[str, ...]) -> list[str]:
    return [
        k for k in S.keys_affecting("result") + S.resume_safe_keys() if S.affects_of(k) in kinds
    ]


def _get(cfg: dict, key: str) -> Any:
    for part in key.split("."):
        cfg = cfg[part]
    return cfg


def test_each_field_declares_what_it_affects():
    for key, f in S.leaf_fields(S.PitaConfig):
        assert f.metadata.get("affects") in S.AFFECTS or key == "algos", key
    assert S.affects_of("system.devices") == "place"
    assert S.affects_of("logger.backend") == "record"
    assert S.affects_of("executor.stage_overrides.QSharp.train") == "result"  # inside a dict
    assert S.affects_of("algos.DPO.beta") == "result"
    assert S.affects_of("hydra.run.dir") is None


def _task(composed: dict, algo: str = "GRPO", stage: str = "train"):
    plan = plan_experiment(OmegaConf.create(composed), 1)
    return next(t for t in plan.tasks.values() if t.algo == algo and t.stage == stage)


def _identity(cfg: dict, task, tmp_path) -> str:
    ctx = StageContext(
        task=task, cfg=cfg, run_dir=tmp_path, out_dir=tmp_path, logger=logging.getLogger("t")
    )
    return checkpoint_identity(ctx)["config_sha256"]


def test_checkpoint_identity_leaves_out_exactly_the_keys_that_do_not_change_a_result(
    composed, tmp_path
):
    task = _task(composed)
    base = _identity(composed, task, tmp_path)
    for key in _leaves(("place", "record")):
        assert _identity(_with(composed, key, _changed(_get(composed, key))), task, tmp_path) == (
            base
        ), key
    for key in _leaves(("result",)):
        if key.startswith(("model.", "dataset.")):  # the chain's own groups ride on the task
            continue
        changed = _identity(_with(composed, key, _changed(_get(composed, key))), task, tmp_path)
        assert changed != base, f"{key} changes a result but not the checkpoint's identity"


def test_duration_key_follows_what_a_key_affects(composed):
    task = _task(composed)
    base = duration_key(OmegaConf.create(composed), "cpu")(task)
    for key in _leaves(("place", "record")):
        cfg = OmegaConf.create(_with(composed, key, _changed(_get(composed, key))))
        assert duration_key(cfg, "cpu")(task) == base, key
    for key in _leaves(("result",)):
        if key == "experiment.seed":  # seeds of a sweep take as long as each other
            continue
        cfg = OmegaConf.create(_with(composed, key, _changed(_get(composed, key))))
        assert duration_key(cfg, "cpu")(task) != base, key


def test_peak_key_changes_with_every_memory_key_and_no_other(composed):
    """A key that says `memory=True` is in the peak cache's key: none shares a stale peak."""
    task = _task(composed)
    base = peak_key(task, composed)
    assert "training.micro_batch_size" in S.memory_keys()
    for key, f in S.leaf_fields(S.PitaConfig):
        if key.startswith(("model.", "dataset.")):  # the chain's groups ride on the task
            continue
        cfg = _with(composed, key, _changed(_get(composed, key)))
        assert (peak_key(task, cfg) != base) == bool(f.metadata.get("memory")), key
    own = S.memory_keys(ALGORITHMS["GRPO"].schema)
    assert {"batch_size", "num_generations", "max_completion_length"} <= set(own)
    for key in own:
        cfg = _with(composed, f"algos.GRPO.{key}", _changed(composed["algos"]["GRPO"][key]))
        assert peak_key(task, cfg) != base, key


def _saved_run(tmp_path, composed: dict):
    run_dir = tmp_path / "run"
    saved = RunPaths(run_dir).saved_config
    saved.parent.mkdir(parents=True)
    saved.write_text(OmegaConf.to_yaml(OmegaConf.create(composed)))
    RunPaths(run_dir).plan.write_text("{}")  # a run that started (what the check reads)
    return run_dir


def test_resume_takes_any_key_and_only_result_keys_run_tasks_again(tmp_path, composed):
    """Place and record keys change on resume and touch no task; a key that affects a
    result is taken too (a resume with a fix), and is what makes its readers run again
    (tests/test_resume_fix.py follows that through a plan)."""
    run_dir = _saved_run(tmp_path, composed)
    cfg, _ = cli.load_resume_config(
        str(run_dir), ["system.threads_per_worker=2", "logger.tags=[a]", "executor.max_retries=5"]
    )
    assert cfg.system.threads_per_worker == 2 and cfg.executor.max_retries == 5
    for key in ("system.threads_per_worker", "logger.tags", "executor.max_retries"):
        assert S.resume_safe(key), key
    for override in ("system.attn_impl=sdpa", "evaluation.num_samples=2", "algos.GRPO.beta=0.5"):
        cfg, _ = cli.load_resume_config(str(run_dir), [override])
        key, value = override.split("=")
        assert str(OmegaConf.select(cfg, key)) == value
        assert not S.resume_safe(key), key
    assert not S.resume_safe("executor.stage_overrides.GRPO.train")


def test_the_resume_safe_text_names_the_derived_keys():
    assert "executor.* but executor.stage_overrides" in RESUME_SAFE_TEXT
    assert "system.devices" in RESUME_SAFE_TEXT or "system.*" in RESUME_SAFE_TEXT


def test_the_docs_list_the_resume_safe_keys():
    """docs/operations.md's resume sentence lists exactly the keys the schema marks safe."""
    text = (ROOT / "docs" / "operations.md").read_text()
    listed = re.search(r"may change on resume: `([^`]*)`", text)
    assert listed, "docs/operations.md: the sentence 'may change on resume: `...`' is missing"
    assert listed.group(1) == RESUME_SAFE_TEXT
