"""A bound on YAML alias expansion for every YAML file pita reads through OmegaConf.

YAML anchors and aliases let a 500-byte file describe a tree of a billion nodes (each
level's list holds nine aliases of the level above: the "billion laughs"). PyYAML composes
it in microseconds, as a graph whose aliases share their node; OmegaConf then copies every
shared node into its own tree, and a composition of pita's config (Hydra's `OmegaConf.load`,
a run's saved config read on resume) ran for minutes. No pita config comes near
`MAX_YAML_NODES` nodes, so a document whose expanded tree would pass it is refused before
OmegaConf sees it, in time linear in the file, with the file's name and the anchor's line
(one line through pita/experiment/cli.py's YAML error line, exit 2).

PyYAML has no such limit and OmegaConf builds its loader class on every call
(`omegaconf._utils.get_yaml_loader`, imported inside `OmegaConf.load` and
`OmegaConf.create`), so `install()` wraps that function once per process.
"""

from __future__ import annotations

from typing import Any

MAX_YAML_NODES = 200_000  # pita's whole composed config is ~1,500 nodes


def expanded_size(root: Any, limit: int = MAX_YAML_NODES) -> int:
    """The number of nodes of `root`'s tree with every alias expanded (a node reached twice
    counts twice), counted over the graph's distinct nodes once each; stops counting past
    `limit`. A node that contains itself counts as over the limit."""
    import yaml

    sizes: dict[int, int] = {}
    stack: list[tuple[Any, bool]] = [(root, False)]
    on_path: set[int] = set()
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            on_path.discard(key)
            kids = _children(node, yaml)
            sizes[key] = min(limit + 1, 1 + sum(sizes[id(k)] for k in kids))
            continue
        if key in sizes:
            continue
        if key in on_path:  # &a [*a]: a tree without end
            return limit + 1
        on_path.add(key)
        stack.append((node, True))
        stack.extend((k, False) for k in _children(node, yaml) if id(k) not in sizes)
    return sizes[id(root)]


def _children(node: Any, yaml: Any) -> list[Any]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def bounded(make_loader: Any) -> Any:
    """`make_loader` (OmegaConf's loader factory) whose loaders refuse a document whose
    aliases expand past MAX_YAML_NODES nodes (a yaml ConstructorError naming its place)."""

    def get_yaml_loader() -> Any:
        import yaml

        base = make_loader()

        class BoundedLoader(base):  # type: ignore[misc, valid-type]
            def construct_document(self, node: Any) -> Any:
                if expanded_size(node) > MAX_YAML_NODES:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"its aliases expand to over {MAX_YAML_NODES:,} nodes (an alias bomb?); "
                        f"refused before expanding them",
                        node.start_mark,
                    )
                return super().construct_document(node)

        return BoundedLoader

    get_yaml_loader.pita_bounded = True  # type: ignore[attr-defined]
    return get_yaml_loader


def install() -> None:
    """Bound every loader OmegaConf makes from now on in this process (idempotent)."""
    from omegaconf import _utils

    if not getattr(_utils.get_yaml_loader, "pita_bounded", False):
        _utils.get_yaml_loader = bounded(_utils.get_yaml_loader)
