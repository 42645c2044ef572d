"""Builders take values, not the context (issue 33.1): a stage function is the one place
that holds its `StageContext`; it unpacks it once (pita/runtime/kit.py: the checkpoint plan,
the identity, the tracker) and the pieces it calls take values, as a torchtune recipe's
builders take config sections. Checked by following `ctx` through the source: every pita
function that is handed the context, transitively (as an argument, or as the body a callee
runs with it, `run_stage(ctx, body)`)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import ROOT


class _Module:
    def __init__(self, root: Path, name: str):
        base = root / name.replace(".", "/")
        path = base.with_suffix(".py") if base.with_suffix(".py").exists() else base / "__init__.py"
        tree = ast.parse(path.read_text())
        self.functions = {
            n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        }
        self.names: dict[str, tuple[str, str]] = {}  # local name -> ("module", m) | (m, function)
        for node in ast.walk(tree):  # function-level imports count: the stages import lazily
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pita"):
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    is_module = _exists(root, sub)
                    self.names[a.asname or a.name] = (
                        ("module", sub)
                        if is_module
                        else (
                            str(node.module),
                            a.name,
                        )
                    )
        self.names.update({f: (name, f) for f in self.functions})


def _exists(root: Path, module: str) -> bool:
    base = root / module.replace(".", "/")
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def reached_by_context(root: Path, start: str) -> set[str]:
    """'module:function' of every function `ctx` reaches from `start` (itself excluded)."""
    modules: dict[str, _Module] = {}

    def module(name: str) -> _Module | None:
        if name not in modules and _exists(root, name):
            modules[name] = _Module(root, name)
        return modules.get(name)

    def resolve(mod: str, expr: ast.expr) -> tuple[str, ast.FunctionDef] | None:
        m = module(mod)
        if m is None:
            return None
        target = None
        if isinstance(expr, ast.Name):
            target = m.names.get(expr.id)
        elif isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
            owner = m.names.get(expr.value.id)
            target = (owner[1], expr.attr) if owner and owner[0] == "module" else None
        if target is None or target[0] == "module":
            return None
        callee = module(target[0])
        fn = callee.functions.get(target[1]) if callee else None
        return (target[0], fn) if fn is not None else None  # type: ignore[return-value]

    def positional(fn: ast.FunctionDef) -> list[str]:
        return [a.arg for a in fn.args.posonlyargs + fn.args.args]

    start_mod, start_fn = start.split(":")
    first = module(start_mod)
    assert first is not None and start_fn in first.functions, start
    todo = [(start_mod, first.functions[start_fn], positional(first.functions[start_fn])[0])]
    seen: set[str] = set()
    while todo:
        mod, fn, holder = todo.pop()
        if f"{mod}:{fn.name}" in seen:
            continue
        seen.add(f"{mod}:{fn.name}")
        for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
            args = [a for a in call.args if not isinstance(a, ast.Starred)]
            at = [i for i, a in enumerate(args) if isinstance(a, ast.Name) and a.id == holder]
            kw = [
                k.arg
                for k in call.keywords
                if isinstance(k.value, ast.Name) and k.value.id == holder
            ]
            if not at and not kw:
                continue
            callee = resolve(mod, call.func)
            if callee is not None:
                params = positional(callee[1])
                param = params[at[0]] if at and at[0] < len(params) else (kw[0] if kw else None)
                if param:
                    todo.append((callee[0], callee[1], param))
            for a in args:  # a body handed over with the context runs with it
                body = resolve(mod, a) if isinstance(a, ast.Name) and a.id != holder else None
                if body is not None and positional(body[1]):
                    todo.append((body[0], body[1], positional(body[1])[0]))
    return seen - {start}


# the launcher (a context per rank) and kit's three unpackers; then each stage's body
LAUNCH_AND_UNPACK = {
    "pita.runtime.gang:run_stage",
    "pita.runtime.gang:gang_world_size",
    "pita.runtime.gang:stall_rule",
    "pita.runtime.kit:checkpoint_plan",
    "pita.runtime.kit:checkpoint_identity",
    "pita.runtime.kit:task_tracker",
}


@pytest.mark.parametrize(
    "stage, body",
    [
        ("pita.algos.value_training:train_value", "pita.algos.value_training:_train_value_rank"),
        ("pita.stages.pretrain:pretrain", "pita.stages.pretrain:_pretrain"),
    ],
)
def test_training_loops_hand_their_pieces_values_not_the_context(stage, body):
    """pita's own training loops (the value trainer, pretrain): 24 and 14 functions were
    handed `ctx` before (the data, model, probe, optimizer, train step, checkpointer...)."""
    readers = LAUNCH_AND_UNPACK | {body}
    reached = reached_by_context(ROOT, stage)
    assert reached == readers, (
        f"these now take the context: {sorted(reached - readers)}; pass them values "
        f"unpacked in {body} (no longer reached: {sorted(readers - reached)})"
    )


def test_the_follower_finds_a_context_passed_on(tmp_path):
    """The check above can fail: a piece handed `ctx` (as an argument, by keyword, through
    an imported module, or as a body run with it) is found, two calls deep."""
    pkg = tmp_path / "pita"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "helpers.py").write_text(
        "def deep(c):\n    return c.cfg\n\ndef piece(x, context):\n    return deep(context)\n"
    )
    (pkg / "stage.py").write_text(
        "from pita import helpers\nfrom pita.helpers import piece\n\n"
        "def body(ctx, dist):\n    return helpers.deep(ctx)\n\n"
        "def launch(ctx, fn):\n    return fn(ctx, None)\n\n"
        "def start(ctx):\n    piece(1, context=ctx)\n    return launch(ctx, body)\n\n"
        "def untouched(ctx):\n    return ctx\n"
    )
    assert reached_by_context(tmp_path, "pita.stage:start") == {
        "pita.helpers:piece",
        "pita.helpers:deep",
        "pita.stage:launch",
        "pita.stage:body",
    }
