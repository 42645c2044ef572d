"""No two modules of `pita/` import each other (issue 46): a pair that does is one module
cut in two, or a helper that belongs in a third module both import. Imports inside
functions count (the stages import lazily), `if TYPE_CHECKING:` ones too."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def pita_imports(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the pita modules it imports (a `from pkg import name` of a submodule
    counts as that submodule)."""
    paths = {_module_name(p): p for p in (root / "pita").rglob("*.py")}
    out: dict[str, set[str]] = {}
    for name, path in paths.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("pita")}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pita"):
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    found.add(sub if sub in paths else str(node.module))
        out[name] = {m for m in found if m in paths and m != name}
    return out


def test_no_two_modules_import_each_other():
    imports = pita_imports()
    pairs = sorted(
        f"{a} <-> {b}" for a, deps in imports.items() for b in deps if a < b and a in imports[b]
    )
    assert not pairs, pairs
