"""The fields of a TRL config class, read from its source without importing TRL.

The parent must stay torch-free (importing `trl.trainer.dpo_config` imports transformers'
TrainingArguments, which imports torch, and takes seconds), so `trl_fields` parses the
config's source file with `ast`: the class's annotated assignments, then its bases'
(resolved through the module's imports: `_BaseConfig` in trl/trainer/base_config.py,
`TrainingArguments` in transformers' training_args.py), located with
`importlib.util.find_spec` (which finds a top-level package without importing it).
pita/experiment/trl_options.py checks option names and cheap types with it,
pita/experiment/trl_values.py values (both import this module, not each other).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path


def _package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)  # a top-level name: found, not imported
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _module_file(module: str) -> Path | None:
    """`trl.trainer.dpo_config` -> its .py file, without importing the package."""
    top, *rest = module.split(".")
    root = _package_dir(top)
    if root is None:
        return None
    path = root.joinpath(*rest)
    if path.is_dir():
        return path / "__init__.py"
    return path.with_suffix(".py") if path.with_suffix(".py").is_file() else None


# Names a package re-exports lazily from its __init__ (not visible to ast): their real module.
_REEXPORTS = {("transformers", "TrainingArguments"): "transformers.training_args"}


@functools.cache
def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def _base_module(tree: ast.Module, module: str, name: str) -> str | None:
    """The module a base class `name` of `module` comes from (its `from ... import`)."""
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and any(a.name == name for a in node.names):
            if node.level:  # relative: from .base_config import _BaseConfig
                parent = module.rsplit(".", node.level)[0]
                source = f"{parent}.{node.module}" if node.module else parent
            else:
                source = node.module or ""
            return _REEXPORTS.get((source, name), source)
    return None


def _annotation_kinds(node: ast.AST | None) -> set[str]:
    """The type names of an annotation's union (`int | None` -> {'int', 'None'},
    `Optional[float]` -> {'float', 'None'}); '?' stands for anything else (a generic, an
    attribute). A field is type-checked only when every name is int, float, bool or None."""
    if isinstance(node, ast.Constant) and node.value is None:
        return {"None"}
    if isinstance(node, ast.Name):
        return {node.id}
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _annotation_kinds(node.left) | _annotation_kinds(node.right)
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
        if node.value.id == "Optional":
            return _annotation_kinds(node.slice) | {"None"}
    return {"?"}


def _class_fields(module: str, name: str, depth: int = 0) -> dict[str, set[str]]:
    """field -> annotation kinds of dataclass `name` in `module`, its bases' first."""
    path = _module_file(module)
    if path is None or depth > 8:
        return {}
    tree = _parse(path)
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)
    if cls is None:
        return {}
    fields: dict[str, set[str]] = {}
    for base in cls.bases:
        if isinstance(base, ast.Name):
            source = _base_module(tree, module, base.id) or module
            fields.update(_class_fields(source, base.id, depth + 1))
    for stmt in cls.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        if "ClassVar" in ast.unparse(stmt.annotation) or _init_false(stmt.value):
            fields.pop(stmt.target.id, None)
            continue
        fields[stmt.target.id] = _annotation_kinds(stmt.annotation)
    return fields


def _init_false(value: ast.AST | None) -> bool:
    return isinstance(value, ast.Call) and any(
        k.arg == "init" and isinstance(k.value, ast.Constant) and k.value.value is False
        for k in value.keywords
    )


@functools.cache
def trl_fields(module: str, name: str) -> dict[str, set[str]]:
    """The constructor fields of TRL's `trl.trainer.<module>.<name>` with their annotations'
    type names (`_annotation_kinds`); empty when TRL is not installed."""
    return _class_fields(f"trl.trainer.{module}", name)
