"""The docs name only what exists: paths, modules, functions, tests, config keys and links.

README.md, docs/*.md (not docs/guides/, kept as written) and bench/README.md are read as
text. Every reference below must resolve, or the test lists each bad one as
`file:line: reference (why)`:

- paths starting `pita/`, `conf/`, `tests/`, `bench/`, `docs/`, `scripts/` exist on disk
  (`<placeholder>` and `*` are globs);
- dotted modules `pita.x.y` exist as a package or a `.py` file, and a trailing name
  (`pita.x.y.func`, `pita.x.y:func`, `pita/x/y.py:func`) is defined at the top of it
  (read with `ast`, nothing is imported);
- test references `tests/test_x.py::test_name` name a test function of that file;
- config keys written in code spans (`training.lr`, `algos.<NAME>.beta`,
  `executor.max_tasks_per_gpu=8`; not a call such as `hydra.main(...)`) exist in the config composed in-process with Hydra's
  compose API (the `<NAME>` / `<ALGO>` placeholder: in at least one algorithm; a key of a
  group such as `dataset.path` in some option of the group); group selections
  (`dataset=gsm8k`, `hydra/launcher=slurm`) name a file of `conf/`;
- relative Markdown links point at a file, and their `#anchor` at one of its headings.

It composes the config at most once per group option and reads each source file once, so
it runs in about a second.
"""

from __future__ import annotations

import ast
import fnmatch
import functools
import importlib
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
DOCS = [
    ROOT / "README.md",
    ROOT / "bench" / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
]
README_MAX_LINES = 170
# `--config-dir ~/my_conf experiment=mine`: an option that lives in the user's folder.
USER_OPTIONS = {"mine"}
# keys of the example package's own dataset (examples/my_pita: docs/extending.md), which
# exist only with that package installed (tests/test_extending.py sets them)
USER_KEYS = {"dataset.length"}

PATH_RE = re.compile(r"(?<![\w./~:-])((?:pita|conf|tests|bench|docs|scripts)/[\w./<>*-]*)")
TEST_RE = re.compile(r"(?<![\w./-])(tests/[\w/]+\.py)::(\w+(?:::\w+)?)")
FILE_FUNC_RE = re.compile(r"(?<![\w./-])((?:pita|bench|tests|scripts)/[\w/]+\.py):(\w+)(?!:)")
MODULE_RE = re.compile(r"(?<![\w./-])(pita(?:\.\w+)+)(?::(\w+))?")
LINK_RE = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
FENCE_RE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
INLINE_RE = re.compile(r"`([^`\n]+)`")
GROUP_RE = re.compile(r"(?<![\w./+-])([a-z_]+(?:/[a-z_]+)?)=([\w.|-]+)")
FILE_SUFFIXES = {"py", "yaml", "json", "jsonl", "md", "csv", "txt", "png", "log", "lock"}


def _docs() -> Iterator[tuple[Path, str]]:
    for path in DOCS:
        yield path, path.read_text(encoding="utf-8")


def _where(path: Path, text: str, pos: int) -> str:
    return f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, pos) + 1}"


def _code_spans(text: str) -> Iterator[tuple[int, str]]:
    """(offset, text) of every fenced block and every inline code span outside them."""
    fenced = [(m.start(1), m.group(1)) for m in FENCE_RE.finditer(text)]
    yield from fenced
    blanked = FENCE_RE.sub(lambda m: " " * len(m.group(0)), text)
    for m in INLINE_RE.finditer(blanked):
        yield m.start(1), m.group(1)


def _glob_exists(rel: str) -> bool:
    rel = re.sub(r"<[^>]*>", "*", rel.rstrip("/."))
    if "*" in rel:
        return any(ROOT.glob(rel))
    return (ROOT / rel).exists()


# ---- Python sources, read with ast -------------------------------------------------------


@functools.cache
def _top_names(file: Path) -> dict[str, ast.AST | None]:
    """Names defined at the top of a module (functions, classes, assignments, imports)."""
    tree = ast.parse(file.read_text(encoding="utf-8"))
    names: dict[str, ast.AST | None] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        names[n.id] = None
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = None
    return names


def _defined(file: Path, attrs: list[str]) -> bool:
    """`attrs` (e.g. ["Class", "method"]) is defined in `file`."""
    scope: dict[str, ast.AST | None] = _top_names(file)
    for i, name in enumerate(attrs):
        if name not in scope:
            return False
        node = scope[name]
        if i + 1 < len(attrs):
            if not isinstance(node, ast.ClassDef):
                return False
            scope = {
                n.name: n
                for n in node.body
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            }
    return True


def _module_problem(dotted: str, attr: str | None) -> str | None:
    """None if `dotted` (+ `attr`) names a module of this tree and something defined in it."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:cut])
        file = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if file.is_file():
            rest = parts[cut:] + ([attr] if attr else [])
            if rest and not _defined(file, rest):
                return f"{'.'.join(rest)} is not defined in {file.relative_to(ROOT)}"
            return None
    return "no such module"


@functools.cache
def _functions_in(path: Path) -> frozenset[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef)
    return frozenset(n.name for n in ast.walk(tree) if isinstance(n, kinds))


def _test_problem(file: str, name: str) -> str | None:
    path = ROOT / file
    if not path.is_file():
        return "no such file"
    return None if name.split("::")[-1] in _functions_in(path) else "no such test"


# ---- the config, composed with Hydra ------------------------------------------------------


def _register_schema() -> None:
    """Register pita's structured config with Hydra, wherever the schema module lives."""
    for name in ("pita.experiment.cli", "pita.core.schema", "pita.experiment.config"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "register_configs"):
            module.register_configs()
            return
    raise AssertionError("no register_configs() in pita.experiment.cli or the schema module")


@functools.cache
def _compose(overrides: tuple[str, ...] = ()):
    """The composed config (with `hydra.*`), or None if these overrides do not compose."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    _register_schema()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base=None):
            return compose("config", overrides=list(overrides), return_hydra_config=True)
    except Exception:
        return None
    finally:
        GlobalHydra.instance().clear()


def _has(node, parts: list[str]) -> bool:
    """`parts` is a path in `node`; `<X>` placeholders match any key, `*` globs a key."""
    from omegaconf import DictConfig

    if not parts:
        return True
    if not isinstance(node, DictConfig):
        return False
    if len(node) == 0:
        return True  # an empty mapping, a dict-typed field such as executor.stage_overrides
    head, rest = parts[0], parts[1:]
    if head.startswith("<") or "*" in head:
        pattern = "*" if head.startswith("<") else head
        keys = [k for k in node.keys() if fnmatch.fnmatchcase(str(k), pattern)]
    else:
        keys = [head] if head in node else []
    return any(_has(node._get_node(k), rest) for k in keys)


def _key_problem(key: str) -> str | None:
    if key in USER_KEYS:
        return None
    parts = key.split(".")
    cfg = _compose()
    assert cfg is not None, "the default config does not compose"
    if _has(cfg, parts):
        return None
    group = CONF / parts[0]
    if group.is_dir():  # dataset.path lives in some datasets only, and so on
        for option in sorted(group.glob("*.yaml")):
            other = _compose((f"{parts[0]}={option.stem}",))
            if other is not None and _has(other, parts):
                return None
    return "no such config key"


def _keys_in(code: str, tops: set[str]) -> Iterator[tuple[int, str]]:
    """(offset, key) of the dotted config keys in a code span; `a.b|c` gives a.b and a.c."""
    alternation = r"(?:\|[A-Za-z_][\w-]*)*"
    for m in re.finditer(
        r"(?<![\w./${<@-])([a-z_]+)((?:\.(?:<\w+>|[A-Za-z_][\w-]*))+)("
        + alternation
        + r")(\*?)(?![\w(-])",
        code,
    ):
        top, rest, alts, star = m.group(1), m.group(2), m.group(3), m.group(4)
        if top not in tops:
            continue
        parts = (top + rest).split(".")
        if parts[-1] in FILE_SUFFIXES:
            continue
        for last in [parts[-1], *[a for a in alts.split("|") if a]]:
            yield m.start(), ".".join([*parts[:-1], last + star])


# ---- the tests -------------------------------------------------------------------------


def _report(bad: list[str], what: str) -> None:
    assert not bad, f"{len(bad)} {what} in the docs do not exist:\n  " + "\n  ".join(bad)


def test_paths_exist():
    bad = []
    for path, text in _docs():
        for m in PATH_RE.finditer(text):
            rel = m.group(1).rstrip(".,;:)")
            if not _glob_exists(rel):
                bad.append(f"{_where(path, text, m.start())}: {rel} (no such path)")
    _report(bad, "paths")


def test_modules_and_functions_exist():
    bad = []
    for path, text in _docs():
        for m in MODULE_RE.finditer(text):
            problem = _module_problem(m.group(1).rstrip("."), m.group(2))
            if problem:
                bad.append(f"{_where(path, text, m.start())}: {m.group(0)} ({problem})")
        for m in FILE_FUNC_RE.finditer(text):
            file = ROOT / m.group(1)
            if not file.is_file():
                problem = "no such file"
            elif not _defined(file, [m.group(2)]):
                problem = f"{m.group(2)} is not defined there"
            else:
                continue
            bad.append(f"{_where(path, text, m.start())}: {m.group(0)} ({problem})")
    _report(bad, "modules / functions")


def test_named_tests_exist():
    bad = []
    for path, text in _docs():
        for m in TEST_RE.finditer(text):
            problem = _test_problem(m.group(1), m.group(2))
            if problem:
                bad.append(f"{_where(path, text, m.start())}: {m.group(0)} ({problem})")
    _report(bad, "tests")


def test_config_keys_and_group_options_exist():
    cfg = _compose()
    assert cfg is not None, "the default config does not compose"
    tops = {str(k) for k in cfg.keys()}
    groups = {p.relative_to(CONF).as_posix() for p in CONF.rglob("*") if p.is_dir()}
    bad = []
    for path, text in _docs():
        for offset, code in _code_spans(text):
            for pos, key in _keys_in(code, tops):
                problem = _key_problem(key)
                if problem:
                    bad.append(f"{_where(path, text, offset + pos)}: {key} ({problem})")
            for m in GROUP_RE.finditer(code):
                group, options = m.group(1), m.group(2)
                if group not in groups:
                    continue
                for option in options.split("|"):
                    if option in USER_OPTIONS or not re.search(r"\w", option):
                        continue  # experiment=... stands for any experiment
                    if (CONF / group / f"{option}.yaml").is_file():
                        continue
                    where = _where(path, text, offset + m.start())
                    bad.append(f"{where}: {group}={option} (no conf/{group}/{option}.yaml)")
    _report(bad, "config keys / group options")


def _anchors(md: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in md.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_links_resolve():
    bad = []
    for path, text in _docs():
        for m in LINK_RE.finditer(text):
            target = m.group(1)
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not checked here
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            where = _where(path, text, m.start())
            if not dest.exists():
                bad.append(f"{where}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{where}: {target} (no heading #{anchor} in {dest.name})")
    _report(bad, "links")


def test_readme_is_a_front_page():
    lines = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): move details to docs/"
    )


@pytest.mark.parametrize(
    "text, expected",
    [
        ("`training.lr_typo=1`", "training.lr_typo"),
        ("`algos.<NAME>.no_such_key`", "algos.<NAME>.no_such_key"),
    ],
)
def test_the_checker_catches_a_bad_key(text, expected):
    cfg = _compose()
    tops = {str(k) for k in cfg.keys()}
    keys = [k for _, code in _code_spans(text) for _, k in _keys_in(code, tops)]
    assert keys == [expected] and _key_problem(expected) == "no such config key"
