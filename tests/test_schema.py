"""The schema (pita/core/schema.py) declares what each key allows, and one walker checks it:
every numeric key has a range, and each out-of-range value of each key is exit 2 before any
worker starts. The walk calls `validate` in-process (what `preflight` runs before a folder
or a process exists); one real command line shows the exit-2 path end to end."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import re
import typing
from collections.abc import Iterator
from typing import Any

import pytest
from omegaconf import DictConfig, OmegaConf

from pita.algos.registry import ALGORITHMS
from pita.core.errors import ConfigError
from pita.core.schema import (
    ALGO_SCHEMAS,
    GUIDANCE_MODES,
    PitaConfig,
    Rule,
    leaf_fields,
    rule_of,
)
from pita.experiment import cli
from pita.experiment.config import drop_retired_algo_keys, validate
from tests.conftest import ROOT, run_cli

# Keys whose range is another key: V_min < V_max (validate's cross-field rules).
CROSS_CHECKED = {"V_min", "V_max"}


def _schemas() -> list[tuple[str, type]]:
    """(key prefix, schema) of every part of the config: the top level and each algorithm."""
    return [("", PitaConfig)] + [(f"algos.{n}.", a.schema) for n, a in ALGORITHMS.items()]


def _numeric(schema_of_field: type, name: str) -> bool:
    hint = typing.get_type_hints(schema_of_field)[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return hint in (int, float) or any(a in (int, float) for a in args)


def _leaves() -> list[tuple[str, str, dataclasses.Field, bool]]:
    """(prefix, key, field, numeric) of every leaf of every schema."""
    out = []
    for prefix, schema in _schemas():
        for key, f in leaf_fields(schema):
            owner = schema
            for part in key.split(".")[:-1]:  # the nested group that declares the field
                owner = typing.get_type_hints(owner)[part]
            out.append((prefix, key, f, _numeric(owner, f.name)))
    return out


def _ceiling(rule: Rule | None) -> bool:
    return rule is not None and (rule.le is not None or rule.lt is not None)


def _floor(rule: Rule | None) -> bool:
    return rule is not None and (rule.ge is not None or rule.gt is not None or rule.batch)


def test_every_numeric_key_has_a_range():
    """A floor and a ceiling: every size, count, step, rate and timeout has both (a floor
    alone lets `steps=10**12` start a run that never ends)."""
    missing = [
        prefix + key
        for prefix, key, f, numeric in _leaves()
        if (numeric or (rule_of(f) is not None and rule_of(f).batch))  # type: ignore[union-attr]
        and f.name not in CROSS_CHECKED
        and not (_floor(rule_of(f)) and _ceiling(rule_of(f)))
    ]
    assert not missing, f"give these keys a floor and a ceiling in pita/core/schema.py: {missing}"


def test_the_range_check_refuses_a_floor_alone():
    """What the test above reads: a rule with a floor only has no ceiling."""
    assert not _ceiling(Rule(ge=1)) and not _ceiling(Rule(batch=True))
    assert _floor(Rule(ge=1)) and _ceiling(Rule(ge=1, le=8)) and _ceiling(Rule(gt=0, lt=1))


def _out_of_range(rule: Rule, numeric: bool) -> list[Any]:
    """Values the rule must reject: each bound's edge and beyond it, and a wrong kind."""
    bad: list[Any] = []
    if rule.choices is not None:
        bad += ["not-a-choice", 7]
    if rule.batch:
        bad += [0, -4, "huge", True]
    if rule.pattern is not None:
        bad += ["../escape", "a/b", ".."]
    if rule.auto:
        bad += ["lots", 1.5]
    low = rule.ge - 1 if rule.ge is not None else rule.gt
    high = rule.le + 1 if rule.le is not None else rule.lt
    for edge, step in ((low, -1), (high, 1)):
        if edge is not None:
            bad += [edge, edge + 10 * step, edge + 0.5 * step] if numeric else [edge]
    if rule.items:
        bad = [[], *[[1.0, x] for x in bad if not isinstance(x, list)]]
    return bad


def _cases() -> list[tuple[str, Any]]:
    cases = []
    for prefix, key, f, numeric in _leaves():
        rule = rule_of(f)
        if rule is not None:
            cases += [(prefix + key, v) for v in _out_of_range(rule, numeric or rule.items)]
    return cases


@pytest.fixture(scope="module")
def composed() -> dict:
    cfg = cli.compose_config([])
    return OmegaConf.to_container(cfg, resolve=True)


def _set(tree: dict, key: str, value: Any) -> None:
    *parents, last = key.split(".")
    for p in parents:
        tree = tree.setdefault(p, {})
    tree[last] = value


_ABSENT = object()


@contextlib.contextmanager
def _changed(cfg: DictConfig, changes: dict[str, Any]) -> Iterator[DictConfig]:
    """`cfg` with `changes` (dotted keys) set, put back as it was on exit. One DictConfig
    serves every case: building one per case from a dict was most of this file's time."""
    saved = [(key, OmegaConf.select(cfg, key, default=_ABSENT)) for key in changes]
    for key, value in changes.items():
        OmegaConf.update(cfg, key, value, merge=False, force_add=True)
    try:
        yield cfg
    finally:
        for key, old in reversed(saved):
            if old is _ABSENT:
                parent, _, last = key.rpartition(".")
                del (OmegaConf.select(cfg, parent) if parent else cfg)[last]
            else:
                OmegaConf.update(cfg, key, old, merge=False)


def test_each_out_of_range_value_of_each_key_is_a_config_error(composed):
    cases = _cases()
    assert len(cases) > 200  # the walk reached every schema
    cfg = OmegaConf.create(composed)
    escaped = []
    for key, value in cases:
        changes = {key: value}
        m = re.match(r"algos\.([^.]+)\.", key)
        if m:  # an algorithm's values are checked when it runs
            changes[f"algos.{m.group(1)}.enabled"] = True
        with _changed(cfg, changes):
            try:
                validate(cfg, project_root=ROOT)
            except ConfigError as exc:
                if any(line.startswith(f"{key}=") for line in exc.messages):
                    continue
        escaped.append(f"{key}={value!r}")
    assert not escaped, f"accepted out-of-range values: {escaped}"
    assert OmegaConf.to_container(cfg) == composed  # every case was put back


def test_in_range_defaults_pass(composed):
    validate(OmegaConf.create(composed), project_root=ROOT)
    for name, algo in ALGORITHMS.items():  # each schema's own defaults are valid
        tree = copy.deepcopy(composed)
        tree["algos"][name] = {**OmegaConf.to_container(OmegaConf.structured(algo.schema))}
        tree["algos"][name]["enabled"] = True
        validate(OmegaConf.create(tree), project_root=ROOT)


def test_cross_field_ranges(composed):
    for key, value, expected in [
        ("algos.QSharp.V_min", 1.0, "algos.QSharp.V_min=1.0: must be < algos.QSharp.V_max (1.0)"),
        (
            "executor.heartbeat_timeout_s",
            2.0,
            "executor.heartbeat_timeout_s=2.0: must exceed executor.heartbeat_s (2.0)",
        ),
    ]:
        tree = copy.deepcopy(composed)
        _set(tree, key, value)
        with pytest.raises(ConfigError) as info:
            validate(OmegaConf.create(tree), project_root=ROOT)
        assert expected in info.value.messages


def test_non_finite_numbers_are_out_of_every_range(composed):
    tree = copy.deepcopy(composed)
    _set(tree, "training.weight_decay", math.inf)
    with pytest.raises(ConfigError, match="training.weight_decay=inf: must be a finite number"):
        validate(OmegaConf.create(tree), project_root=ROOT)


def test_weight_decay_below_zero_exits_2_before_any_worker(tmp_path):
    """End to end: the real command line, one line on stderr, no run folder."""
    proc = run_cli(["training.weight_decay=-1", "+training.lr=0.1"], tmp_path, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert sorted(proc.stderr.strip().splitlines()) == [
        "error: training.lr: unknown key (not in pita's config schema, see conf/ and "
        "pita/core/schema.py)",
        "error: training.weight_decay=-1.0: must be >= 0",
    ]
    assert not (tmp_path / "outputs").exists()


def test_each_algorithm_yaml_starts_from_its_rows_schema():
    """conf/algo/<file>.yaml's defaults name the schema of the registry row it configures."""
    text = (ROOT / "conf" / "config.yaml").read_text()
    files = dict(re.findall(r"algo@algos\.([\w-]+): (\w+)", text))
    for name, algo in ALGORITHMS.items():
        yaml = OmegaConf.load(ROOT / "conf" / "algo" / f"{files[name]}.yaml")
        schema_name = yaml.defaults[0]
        assert ALGO_SCHEMAS[schema_name] is algo.schema, (name, schema_name)


def test_a_key_the_algorithm_does_not_have_is_unknown(composed):
    with pytest.raises(ConfigError, match=r"algos\.DPO\.num_atoms: unknown key"):
        cli.compose_config(["algos.DPO.num_atoms=5"])
    tree = copy.deepcopy(composed)  # `+algos.GRPO.betta=0.1` composes: the walker rejects it
    tree["algos"]["GRPO"]["betta"] = 0.1
    with pytest.raises(ConfigError, match=r"algos\.GRPO\.betta: unknown key"):
        validate(OmegaConf.create(tree), project_root=ROOT)


def test_a_run_saved_with_every_algorithm_key_still_resumes(composed):
    saved = copy.deepcopy(composed)
    saved["algos"]["DPO"]["num_atoms"] = 11  # the old one-union-for-all schema saved these
    cfg = drop_retired_algo_keys(OmegaConf.create(saved))
    assert "num_atoms" not in cfg.algos.DPO and cfg.algos.DPO.lr == 3e-3


def test_help_lists_allowed_values_and_the_defaults_that_run(composed):
    from pita.experiment.cli_extras import help_text

    text = help_text("run_parallel.py", composed)
    mode = next(ln for ln in text.splitlines() if ln.strip().startswith(".guidance.mode"))
    assert all(m in mode for m in GUIDANCE_MODES)
    dpo = text.split("algos.<DPO|RPO>")[1]
    lr = next(ln for ln in dpo.splitlines() if ln.strip().startswith(".lr "))
    assert lr.split()[1] == "0.003", lr  # conf/algo/dpo.yaml's, not the schema's 0.001


def test_owned_choice_lists_come_from_the_schema():
    from pita.core import schema
    from pita.training import tracking

    assert tracking.BACKENDS is schema.LOGGER_BACKENDS
    for path, name in [
        ("pita/algos/guidance.py", "GUIDANCE_MODES"),
        ("pita/training/precision.py", "PRECISION_TYPES"),
        ("pita/training/precision.py", "GPU_MODES"),
        ("pita/models/value_model.py", "VALUE_HEADS"),
        ("pita/runtime/batch_size/search.py", "AUTO_BATCH"),
    ]:
        assert re.search(rf"from pita\.core\.schema import .*{name}", (ROOT / path).read_text())
