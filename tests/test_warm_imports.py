"""CUDA workers import the libraries of the run's stages while they wait for a task
(pita.runtime.worker.warm_stage_imports, pita.experiment.run.stage_modules)."""

from __future__ import annotations

import importlib.util
import sys

from pita.algos import dpo, grpo, reward_model
from pita.runtime.worker import warm_stage_imports


def test_a_stage_module_s_warm_imports_are_imported_and_a_broken_one_is_skipped(
    tmp_path, monkeypatch
):
    (tmp_path / "heavy_lib_for_warm_test.py").write_text("LOADED = True\n")
    (tmp_path / "stage_for_warm_test.py").write_text(
        "WARM_IMPORTS = ('heavy_lib_for_warm_test',)\n"
    )
    (tmp_path / "broken_stage_for_warm_test.py").write_text("raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("heavy_lib_for_warm_test", "stage_for_warm_test"):
        monkeypatch.delitem(sys.modules, name, raising=False)

    got = warm_stage_imports(
        "broken_stage_for_warm_test,,stage_for_warm_test,no_such_module_for_warm_test"
    )

    assert got == ["heavy_lib_for_warm_test"]
    assert sys.modules["heavy_lib_for_warm_test"].LOADED


def test_every_declared_warm_import_exists():
    for module in (grpo, dpo, reward_model):
        for name in module.WARM_IMPORTS:
            assert importlib.util.find_spec(name) is not None, (module.__name__, name)


def test_the_run_names_the_modules_of_the_tasks_still_to_run():
    from pita.core.dag import Plan
    from pita.core.tasks import TaskSpec
    from pita.experiment.run import stage_modules

    plan = Plan()
    for tid, fn in (
        ("a", "pita.algos.grpo:train"),
        ("b", "pita.algos.grpo:train_hf"),
        ("c", "pita.algos.dpo:train"),
        ("d", "pita.stages.pretrain:pretrain"),
    ):
        plan.add(TaskSpec(id=tid, algo="x", dataset="d", family="f", round=0, stage="train", fn=fn))
    assert stage_modules(plan, done={"c"}) == "pita.algos.grpo,pita.stages.pretrain"


def test_a_worker_s_trl_trainer_does_not_import_mlflow_for_an_integration_pita_never_uses(
    monkeypatch,
):
    """pita's trackers log TRL's metrics (report_to="none"); with mlflow installed, a TRL
    trainer's import would still import it for transformers' MLflow integration (about 1 s
    in every DPO / GRPO worker) unless the worker's environment turns that integration off."""
    import pytest

    if importlib.util.find_spec("mlflow") is None:
        pytest.skip("mlflow is not installed: there is nothing to leave out")
    from transformers.integrations import is_mlflow_available

    from pita.core.gpu_manager import GPUManager

    monkeypatch.delenv("DISABLE_MLFLOW_INTEGRATION", raising=False)
    assert is_mlflow_available()  # the check is live: it reads the environment each call
    var = "DISABLE_MLFLOW_INTEGRATION"
    monkeypatch.setenv(var, GPUManager("cpu").worker_env([0])[var])  # what a worker starts with
    assert not is_mlflow_available()
