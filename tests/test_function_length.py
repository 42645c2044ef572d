"""Small functions (docs/STYLE.md, issue 46): no function in `pita/` longer than
`LONGEST` lines, at most `MOST_OVER` longer than `OVER` (cut into named steps, as
`_run_locked` became). A function's length is its `def` line to its last line (docstring
and comments included), as the ast gives them.

`python tests/test_function_length.py` prints the counts and the longest functions."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LONGEST, MOST_LONGER = 80, 0  # issue 46: no function over 80 lines
OVER, MOST_OVER = 60, 8  # and at most 8 over 60


def function_lengths(root: Path = ROOT) -> list[tuple[int, str]]:
    """(lines, "path:name") of every function and method under `root/pita`, longest first."""
    rows = []
    for path in sorted((root / "pita").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                rows.append((length, f"{path.relative_to(root)}:{node.name}"))
    return sorted(rows, reverse=True)


def test_no_function_is_longer_than_the_limit():
    too_long = [f"{name} ({n} lines)" for n, name in function_lengths() if n > LONGEST]
    assert len(too_long) <= MOST_LONGER, f"longer than {LONGEST} lines: {too_long}"


def test_few_functions_are_longer_than_sixty_lines():
    long = [f"{name} ({n})" for n, name in function_lengths() if n > OVER]
    assert len(long) <= MOST_OVER, f"{len(long)} functions over {OVER} lines: {long}"


if __name__ == "__main__":
    rows = function_lengths()
    print(
        f"over {LONGEST}: {sum(n > LONGEST for n, _ in rows)}, "
        f"over {OVER}: {sum(n > OVER for n, _ in rows)}"
    )
    for n, name in rows:
        if n > OVER:
            print(f"{n:4d} {name}")
