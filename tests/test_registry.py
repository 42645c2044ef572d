"""The algorithm table is the one place that knows algorithms (issue 20).

Each row of `pita/algos/registry.py` declares its stages' outputs and the models each stage
holds; the planner, the memory estimates and evaluate read the row, and nothing outside
`pita/algos/` branches on an algorithm's name (checked here on the syntax tree of every
module, so CI keeps it that way).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from pita.algos import registry
from pita.algos.registry import ALGORITHMS, Algorithm, Held
from pita.core.paths import Artifact
from pita.core.tasks import TaskSpec
from pita.experiment import estimates
from tests.conftest import task_spec

ROOT = Path(__file__).resolve().parents[1]
PITA = ROOT / "pita"
NAMES = frozenset(ALGORITHMS)
# "reference" is also a model role, an input name and a family key: a comparison with it is
# an algorithm-name branch only when the other side is about the algorithm.
AMBIGUOUS = frozenset({"reference"})
# The stage functions the table names ("pita.algos.grpo:train"): a list of them outside the
# table picks algorithms as surely as a list of names (growth's old `TRL_STAGES`).
STAGE_FUNCTIONS = frozenset(
    [fn for row in ALGORITHMS.values() for fn in row.functions.values()]
    + list(registry.SHARED_FUNCTIONS.values())
)


def _stage_function(value: object) -> bool:
    """True for a stage function of the table or a `module:` prefix of one."""
    if not isinstance(value, str) or ":" not in value:
        return False
    return value in STAGE_FUNCTIONS or (
        value.endswith(":") and any(f.startswith(value) for f in STAGE_FUNCTIONS)
    )


def _names_in(node: ast.AST) -> set[str]:
    """The algorithm names among the string constants of `node` ("GRPO", ("DPO", "RPO"))."""
    return {
        n.value
        for n in ast.walk(node)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in NAMES
    }


def _about_algo(node: ast.AST) -> bool:
    return "algo" in ast.unparse(node).lower()


def _affix_of_a_name(value: object) -> bool:
    """True for "GRPO" or "-HF": a prefix or suffix that picks algorithms by their name."""
    return isinstance(value, str) and any(
        n != value and (n.startswith(value) or n.endswith(value)) for n in NAMES
    )


def _branch(node: ast.AST) -> str | None:
    """Why `node` decides something by an algorithm's name, or None."""
    if isinstance(node, ast.Compare):
        sides = [node.left, *node.comparators]
        for side in sides:
            names = (
                _names_in(side)
                if isinstance(side, ast.Constant | ast.Tuple | ast.List | ast.Set)
                else set()
            )
            if names - AMBIGUOUS or (names and any(_about_algo(s) for s in sides if s is not side)):
                return f"compares with {sorted(names)}"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if node.func.attr in ("startswith", "endswith") and node.args:
            arg = node.args[0]
            values = arg.elts if isinstance(arg, ast.Tuple) else [arg]
            if any(isinstance(v, ast.Constant) and _affix_of_a_name(v.value) for v in values):
                return f"{node.func.attr}({ast.unparse(arg)})"
    if isinstance(node, ast.Tuple | ast.List | ast.Set):  # VALUE_ALGOS = ("PITA", "QSharp")
        elts = {e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in NAMES}
        if elts - AMBIGUOUS:
            return f"a list of algorithm names {sorted(elts)}"
    if isinstance(node, ast.Subscript) and _names_in(node.slice) - AMBIGUOUS:
        return f"indexes by {sorted(_names_in(node.slice))}"
    if isinstance(node, ast.Dict):
        keys = {k.value for k in node.keys if isinstance(k, ast.Constant) and k.value in NAMES}
        if keys - AMBIGUOUS:
            return f"a table keyed by {sorted(keys)}"
    if isinstance(node, ast.MatchValue) and _names_in(node) - AMBIGUOUS:
        return f"case {sorted(_names_in(node))}"
    if isinstance(node, ast.Constant) and _stage_function(node.value):
        return f"names the stage function {node.value!r}"
    return None


def name_branches(root: Path = PITA) -> list[str]:
    """`path:line: why` for every algorithm-name decision outside pita/algos/."""
    hits = []
    for path in sorted(root.rglob("*.py")):
        if (root / "algos") in path.parents:
            continue
        found: dict[int, str] = {}  # line -> the first reason seen on it
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            why = _branch(node)
            if why:
                found.setdefault(getattr(node, "lineno", 0), why)
        rel = path.relative_to(root.parent)
        hits += [f"{rel}:{line}: {why}" for line, why in sorted(found.items())]
    return hits


def test_nothing_outside_the_algorithm_table_branches_on_an_algorithm_name():
    hits = name_branches()
    assert not hits, (
        "decide by a field of the algorithm's row in pita/algos/registry.py instead:\n"
        + "\n".join(hits)
    )


def test_the_check_sees_the_branches_it_forbids(tmp_path):
    pkg = tmp_path / "pita"
    (pkg / "algos").mkdir(parents=True)
    (pkg / "algos" / "ok.py").write_text('X = algo == "GRPO"\n')  # the table's own package
    (pkg / "bad.py").write_text(
        "\n".join(
            [
                'a = algo.startswith("GRPO")',
                'b = task.algo.endswith("-HF")',
                'c = algo in ("PITA", "QSharp")',
                'd = algo == "reference"',
                'e = {"DPO": 1}[algo]',
                'f = cfg.algos["QSharp"]',
                'VALUE = ["PITA", "QSharp-HF"]',
                'g = task.fn in ("pita.algos.dpo:train", "pita.algos.grpo:train")',
                'h = task.fn.startswith("pita.algos.qsharp:")',
                'ok1 = role == "reference"',  # a model role, not an algorithm
                'ok2 = ctx.has_input("reference")',
                'ok3 = stage.endswith("_merge")',
                'ok4 = PRELOAD = ("pita.algos.value_training", "pita.stages.pretrain")',
            ]
        )
        + "\n"
    )
    hits = name_branches(pkg)
    assert [h.split(":")[:2] for h in hits] == [["pita/bad.py", str(i)] for i in range(1, 10)]


# ---- each row declares its stages -------------------------------------------------------------


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_a_row_declares_the_outputs_and_models_of_its_stages(name):
    row = ALGORITHMS[name]
    assert set(row.functions) <= set(row.round_stages)
    assert set(row.outputs) == set(row.functions), "each own function declares its outputs"
    assert all(row.outputs.values())
    assert set(row.models) == set(row.round_stages), "each stage says which models it holds"


def test_stage_outputs_come_from_the_row_and_bind_an_override_too():
    assert registry.stage_outputs("QSharp-HF", "collect") == (Artifact.RECORDS, Artifact.PAIRS)
    assert registry.stage_outputs("DPO", "train") == (Artifact.MODEL,)
    assert registry.stage_outputs("GRPO", "evaluate_merge") == (Artifact.METRICS,)
    assert registry.stage_outputs("any", "pretrain") == (Artifact.MODEL,)
    assert registry.stage_outputs("diagnostic", "device_check") == ()
    plugged = {"QSharp": {"train": "mypkg.mod:train"}, "any": {"evaluate": "mypkg.mod:ev"}}
    # issue 21: outputs are the stage's contract; an override that writes nothing fails
    assert registry.stage_outputs("QSharp", "train", plugged) == (Artifact.VALUE_MODEL,)
    assert registry.stage_outputs("PITA", "evaluate", plugged) == (Artifact.SAMPLES,)
    assert registry.stage_outputs("PITA", "train", plugged) == (Artifact.VALUE_MODEL,)


def test_a_guide_is_held_only_once_there_is_one():
    assert [h.model for h in registry.stage_models("PITA", "collect", 0)] == ["reference"]
    assert [h.model for h in registry.stage_models("PITA", "collect", 1)] == ["reference", "value"]


def test_a_held_model_names_a_known_role_and_use():
    with pytest.raises(ValueError, match="model must be one of"):
        Held("critic", "train")


# ---- a new row gets its own estimate ----------------------------------------------------------


def _train_task(algo: str) -> TaskSpec:
    family = {
        "name": "tiny",
        "memory_gb": estimates.family_file_memory_gb("tiny"),
        "reference_arch": {"n_layer": 1, "d_model": 64, "n_head": 4},
        "guide_arch": {"n_layer": 2, "d_model": 64, "n_head": 4},
    }
    return task_spec(
        id=f"{algo}.goal_walk.tiny.r0.train",
        algo=algo,
        mem_mb=1536,
        family_cfg=family,
        dataset_cfg={"name": "goal_walk", "num_nodes": 8, "walk_length": 3},
    )


CFG = OmegaConf.create(
    {
        "training": {"micro_batch_size": 4},
        "algos": {"GRPO": {"batch_size": 64, "num_generations": 16}, "GRPO2": {"batch_size": 64}},
    }
)


def test_a_new_grpo_like_row_gets_the_estimate_its_own_declaration_implies(monkeypatch):
    """GRPO2 is not GRPO: its estimate follows the models its row says its train holds."""
    from pita.runtime.batch_size.search import estimate_from_config

    grpo2 = Algorithm(
        "GRPO2",
        ("train", "evaluate"),
        {"train": "pita.algos.grpo:train"},
        outputs={"train": (Artifact.MODEL,)},
        models={"train": (Held("policy", "train"),), "evaluate": (Held("policy", "generate"),)},
    )
    monkeypatch.setitem(ALGORITHMS, "GRPO2", grpo2)

    mb, source = estimates.estimate(_train_task("GRPO2"), CFG)
    size = estimates.tiny_size({"n_layer": 1, "d_model": 64, "n_head": 4}, 8 + 16)
    prompt, new = estimates.sequence_lengths({"name": "goal_walk", "walk_length": 3}, CFG)
    train = estimate_from_config(
        size.config,
        mode="train",
        prompt_tokens=prompt,
        new_tokens=new,
        dtype_bytes=4,
        n_params=size.params,
        optimizer_bytes_per_param=8.0,
    )
    expected = int((size.weight_bytes + train.bytes_for(64)) / 2**20) + estimates.WORKER_OVERHEAD_MB
    assert (mb, source) == (expected, "size: model.reference_arch")
    grpo_mb, _ = estimates.estimate(_train_task("GRPO"), CFG)
    assert grpo_mb > mb  # GRPO's train also scores with π_ref and samples its groups

    # a row that declares no models for a stage gets no size-based estimate, not GRPO's
    monkeypatch.setitem(ALGORITHMS, "GRPO2", Algorithm("GRPO2", ("train",), {}))
    mb, source = estimates.estimate(_train_task("GRPO2"), CFG)
    assert (mb, source) == (1536, "model.memory_gb=0.5")
