"""A stage reads typed settings (issue 33.1): `StageContext` holds each config group as a
read-only instance of its schema class (pita/core/schema.py), `ctx.algo` as the registry row's
own, and no module of pita restates a schema default with `.get("key", default)`."""

from __future__ import annotations

import ast
import dataclasses
import logging

import pytest
from omegaconf import OmegaConf

from pita.algos.registry import ALGORITHMS
from pita.core import schema as S
from pita.core.tasks import TaskSpec
from pita.experiment import cli
from pita.experiment.plan import plan_experiment
from pita.runtime.context import StageContext
from tests.conftest import ROOT

EVERY_ALGO = [f"algos.{name}.enabled=true" for name in ALGORITHMS]


def _context(cfg, task: TaskSpec, tmp_path) -> StageContext:
    return StageContext(
        task=task, cfg=cfg, run_dir=tmp_path, out_dir=tmp_path, logger=logging.getLogger("t")
    )


def test_each_task_reads_its_algorithms_schema_and_the_groups_typed(tmp_path):
    cfg = cli.compose_config(
        [*EVERY_ALGO, "training.micro_batch_size=3", "algos.DPO.beta=0.25", "algos.PITA.lr=0.02"]
    )
    plan = plan_experiment(cfg, 1)
    seen = set()
    for task in plan.tasks.values():
        if task.algo not in ALGORITHMS or task.algo in seen:
            continue
        seen.add(task.algo)
        ctx = _context(cfg, task, tmp_path)
        assert type(ctx.algo).__mro__[1] is ALGORITHMS[task.algo].schema, task.id
        assert isinstance(ctx.algo_as(ALGORITHMS[task.algo].schema), S.ReferenceConfig)
        assert isinstance(ctx.training, S.TrainingConfig)
        assert ctx.training.micro_batch_size == 3
        assert isinstance(ctx.model.reference_arch, S.TinyModelConfig)
        assert ctx.evaluation.etas == list(cfg.evaluation.etas)
    assert seen == set(ALGORITHMS)
    dpo = next(t for t in plan.tasks.values() if t.algo == "DPO")
    assert _context(cfg, dpo, tmp_path).algo_as(S.PreferenceConfig).beta == 0.25
    pita = next(t for t in plan.tasks.values() if t.algo == "PITA")
    assert _context(cfg, pita, tmp_path).algo_as(S.ValueGuidedConfig).lr == 0.02
    with pytest.raises(TypeError, match="algos.PITA is a ValueGuidedConfig"):
        _context(cfg, pita, tmp_path).algo_as(S.PreferenceConfig)


def test_settings_are_read_only(tmp_path):
    cfg = cli.compose_config([])
    task = next(iter(plan_experiment(cfg, 1).tasks.values()))
    ctx = _context(cfg, task, tmp_path)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.training.micro_batch_size = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.model.reference_arch.n_layer = 9  # type: ignore[misc]


def test_a_key_the_config_lacks_takes_the_schema_default(tmp_path):
    """The schema is the one home of a default: a partial config (a hand-built test context)
    reads the field's default, never one a stage wrote again."""
    cfg = OmegaConf.create({"training": {"micro_batch_size": 2}, "experiment": {"seed": 1}})
    task = TaskSpec(id="t", algo="any", dataset="d", family="f", round=0, stage="train", fn="m:f")
    ctx = _context(cfg, task, tmp_path)
    assert ctx.training.micro_batch_size == 2
    assert ctx.training.checkpoint_every_minutes == S.TrainingConfig.checkpoint_every_minutes
    assert ctx.evaluation.num_samples == S.EvaluationConfig.num_samples
    assert type(ctx.algo).__mro__[1] is S.ReferenceConfig


def _schema_keys() -> set[str]:
    """The name of every field of every schema class (a group's key or a leaf's)."""
    out: set[str] = set()
    schemas = [S.PitaConfig, *S.ALGO_SCHEMAS.values(), S.GuidanceConfig, S.TinyModelConfig]
    for schema in schemas:
        for f in dataclasses.fields(schema):
            out.add(f.name)
            sub = S.nested_schema(f)
            if sub is not None:
                out |= {g.name for g in dataclasses.fields(sub)}
    for f in dataclasses.fields(S.PitaConfig):
        sub = S.nested_schema(f)
        if sub is not None:
            out |= {g.name for g in dataclasses.fields(sub)}
    return out


def _empty(node: ast.expr) -> bool:
    return isinstance(node, (ast.Dict, ast.List, ast.Tuple)) and not (
        node.keys if isinstance(node, ast.Dict) else node.elts
    )


def _dotted_key(arg: ast.expr, keys: set[str]) -> str | None:
    """The schema key a dotted path names (`"pretrain.steps"`, `f"{algo}.epochs"`: its last
    part), else None."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and "." in arg.value:
        last = arg.value.rsplit(".", 1)[1]
    elif (
        isinstance(arg, ast.JoinedStr)
        and arg.values
        and isinstance(arg.values[-1], ast.Constant)
        and str(arg.values[-1].value).startswith(".")
    ):
        last = str(arg.values[-1].value)[1:]
    else:
        return None
    return last if last in keys else None


def _path_reads_with_default(tree: ast.AST, keys: set[str]) -> set[tuple[int, str]]:
    """(line, key) of each call reading a dotted path of a schema key with a default after
    it: `f(cfg, "pretrain.steps", 1)`, `OmegaConf.select(cfg, "a.b", default=2)`."""
    hits = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        defaulted = any(kw.arg == "default" for kw in node.keywords)
        for i, arg in enumerate(node.args):
            key = _dotted_key(arg, keys)
            if key and (len(node.args) > i + 1 or defaulted):
                hits.add((node.lineno, key))
    return hits


def _restated_defaults(source: str, keys: set[str]) -> list[tuple[int, str]]:
    """(line, key) of each `x.get("<key>", <default>)`, `x.get("<key>") or <default>` and
    dotted-path read with a default (`_path_reads_with_default`)."""
    tree = ast.parse(source)
    hits = _path_reads_with_default(tree, keys)
    for node in ast.walk(tree):
        call = node.values[0] if isinstance(node, ast.BoolOp) else node
        if not (
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute)
            and call.func.attr == "get"
            and call.args
            and isinstance(call.args[0], ast.Constant)
            and call.args[0].value in keys
        ):
            continue
        two_args = len(call.args) == 2 and call is node
        or_default = (
            isinstance(node, ast.BoolOp)
            and isinstance(node.op, ast.Or)
            and not _empty(node.values[-1])  # `or {}`: a missing group, no default restated
        )
        if two_args or or_default:
            hits.add((node.lineno, call.args[0].value))
    return sorted(hits)


def test_the_scan_finds_restated_defaults():
    keys = {"checkpoint_every_minutes", "num_samples", "steps", "epochs"}
    source = (
        'a = tr.get("checkpoint_every_minutes", 0.0)\n'
        'b = ev.get("num_samples") or 1\n'
        'c = row.get("wall_s", 0.0)\n'
        'd = ev.get("num_samples")\n'
        'e = cfg.get("num_samples") or {}\n'
        'f = _num(cfg, "pretrain.steps", 1)\n'  # durations.py's form, before issue 45
        'g = _num(cfg, f"{algo}.epochs", 1)\n'
        'h = OmegaConf.select(cfg, "evaluation.num_samples", default=4)\n'
        'i = _amount(cfg, "pretrain.steps")\n'  # the schema's default: not restated
        'j = _num(cfg, "pretrain.wall_s", 1)\n'  # not a schema key
    )
    assert _restated_defaults(source, keys) == [
        (1, "checkpoint_every_minutes"),
        (2, "num_samples"),
        (6, "steps"),
        (7, "epochs"),
        (8, "num_samples"),
    ]


# `.get` of a name a schema also uses, on a mapping that is not a config group.
NOT_CONFIG = {
    ("pita/core/monitor.py", "devices"): "a worker's info, not system.devices",
    ("pita/core/progress.py", "progress"): "a worker's info, not executor.progress",
    ("pita/results/timeline.py", "devices"): "a journal event, not system.devices",
    ("pita/experiment/durations.py", "devices"): "a journal event, not system.devices",
    ("pita/experiment/run.py", "progress"): "a worker's info, not executor.progress",
    ("pita/models/placement.py", "trust_remote_code"): "from_pretrained's keyword arguments",
    ("pita/models/value_model.py", "loss_type"): "a saved value model's own config file",
}


def test_no_module_restates_a_schema_default():
    """A `.get("key", default)` of a schema key restates (and once contradicted) the default
    the schema owns: the typed settings (`ctx.training`, ...) or the composed config read
    the key instead."""
    keys = _schema_keys()
    found = [
        f"{path.relative_to(ROOT)}:{line}: .get({key!r}, ...)"
        for path in sorted((ROOT / "pita").rglob("*.py"))
        for line, key in _restated_defaults(path.read_text(), keys)
        if (str(path.relative_to(ROOT)), key) not in NOT_CONFIG
    ]
    assert not found, "\n".join(found)


@pytest.mark.slow  # one mypy run over the stage's imports: tens of seconds cold
def test_mypy_checks_a_stage_against_the_schema(tmp_path):
    """A stage's reads of its typed settings are checked (the mypy test's files include the
    stage code, tests/test_types.py): a misspelt key, a key of the wrong group and a value of
    the wrong type are each an error before anything runs; the right reads are none."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (pip install -e '.[dev]')")
    stage = tmp_path / "stage.py"
    stage.write_text(
        "from pita.core.schema import ValueGuidedConfig\n"
        "from pita.runtime.context import StageContext\n\n\n"
        "def good(ctx: StageContext) -> float:\n"
        "    return ctx.training.micro_batch_size * ctx.algo_as(ValueGuidedConfig).lr\n\n\n"
        "def bad(ctx: StageContext) -> None:\n"
        "    ctx.training.micro_batch_sise\n"  # misspelt
        "    ctx.system.micro_batch_size\n"  # another group's key
        "    ctx.algo_as(ValueGuidedConfig).guidance.top_k.upper()\n"  # an int, not a str
        "    ctx.input('data').name\n"  # one folder: fine
        "    ctx.inputs('data').name\n"  # a list of folders
    )
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), str(stage)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    errors = [ln for ln in proc.stdout.splitlines() if ": error:" in ln]
    lines = sorted(int(ln.split(":")[1]) for ln in errors)
    assert lines == [10, 11, 12, 14], proc.stdout
