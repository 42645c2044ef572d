"""The device slots of a Ray cluster, reserved once per run, with a warm actor in each.

Why one placement group for every slot (and not one per gang): pita's own scheduler
already decides which devices each task gets (memory, packing, gangs, priorities: the
same `Scheduler` as on one machine); what it needs from Ray is a warm process on each
device that stays there. So at its start a run reserves every slot of the cluster in one
placement group (one bundle per GPU, or per CPU on a cluster without GPUs, strategy PACK),
waits for it at most `executor.ray_placement_timeout_s` (a cluster that cannot give it is
one line naming what was asked per bundle and what each node offers, never a hang: another
job holding the devices is the usual cause), and starts one `SlotWorker` actor in each
bundle (pita/runtime/ray_slot.py). Slot i is device i of the scheduler; slots are numbered
node by node, and the scheduler puts a gang on one node when one node has k free slots
(`Scheduler.node_of`, pita/core/parallel_executor.py), across nodes only when none has.

Before the first task every node reads a probe the orchestrator wrote into the run folder
and writes one back (`check_shared_storage`): a node that does not share the run folder is
named in one line (exit 2) instead of failing its first task with "no such file".
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pita.core.errors import ConfigError
from pita.core.paths import atomic_write_text

PROBE_TIMEOUT_S = 60.0


@dataclass
class Slot:
    """Device `index` of the run: bundle `bundle` of the placement group, on `node`."""

    index: int
    bundle: int
    node: str  # Ray node id, hex
    actor: Any = None
    ip: str = ""


def slot_resource(kind: str) -> dict[str, float]:
    """What one slot's bundle asks for: one GPU, or one CPU on a cluster without GPUs."""
    return {"GPU": 1.0} if kind == "gpu" else {"CPU": 1.0}


def cluster_offers(ray: Any) -> str:
    """What the alive nodes have, e.g. `node 9bd6acfc (10.0.0.2): CPU 2, GPU 0; ...`, and
    what is free cluster-wide now."""
    parts = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        res = n.get("Resources", {})
        parts.append(
            f"node {n['NodeID'][:8]} ({n.get('NodeManagerAddress', '?')}): "
            f"CPU {int(res.get('CPU', 0))}, GPU {int(res.get('GPU', 0))}, "
            f"memory {res.get('memory', 0) / 2**30:.0f} GB"
        )
    free = ray.available_resources()
    return (
        f"{'; '.join(parts) or 'no alive node'} (free now: CPU {int(free.get('CPU', 0))}, "
        f"GPU {int(free.get('GPU', 0))})"
    )


def reserve(ray: Any, kind: str, count: int, timeout_s: float) -> tuple[Any, list[str]]:
    """One placement group of `count` slot bundles (PACK), ready within `timeout_s`; the
    group and each bundle's node id. Raises ConfigError (one line) when Ray cannot place it."""
    from ray.util.placement_group import (
        placement_group,
        placement_group_table,
        remove_placement_group,
    )

    bundle = slot_resource(kind)
    group = placement_group([dict(bundle) for _ in range(count)], strategy="PACK")
    if not group.wait(timeout_seconds=timeout_s):
        offers = cluster_offers(ray)
        remove_placement_group(group)
        asked = ", ".join(f"{k} {v:g}" for k, v in bundle.items())
        raise ConfigError(
            f"executor.ray_placement_timeout_s={timeout_s:g}: Ray could not place {count} "
            f"bundle(s) of {{{asked}, memory: not asked}} (one per device slot) within "
            f"{timeout_s:g} s; the cluster offers {offers}"
        )
    nodes = placement_group_table(group)["bundles_to_node_id"]
    return group, [nodes[i] for i in range(count)]


def number_slots(bundle_nodes: list[str]) -> list[Slot]:
    """Slots numbered node by node (in the order nodes first appear), so consecutive slots
    share a node: a gang on consecutive free slots is packed on one node when it fits."""
    order: dict[str, int] = {}
    for node in bundle_nodes:
        order.setdefault(node, len(order))
    ranked = sorted(range(len(bundle_nodes)), key=lambda b: (order[bundle_nodes[b]], b))
    return [Slot(i, b, bundle_nodes[b]) for i, b in enumerate(ranked)]


def check_shared_storage(
    ray: Any, slots: list[Slot], folder: Path, timeout_s: float = PROBE_TIMEOUT_S
) -> None:
    """Every node of `slots` reads a probe written here into `folder` and writes one back,
    read here. Raises ConfigError (one line) naming each node that cannot."""
    folder.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex
    probe = folder / f"storage-probe-{token[:12]}"
    atomic_write_text(probe, token)
    first: dict[str, Slot] = {}
    for slot in slots:
        first.setdefault(slot.node, slot)
    replies = {node: Path(f"{probe}-{node[:12]}") for node in first}
    refs = {
        node: s.actor.probe.remote(str(probe), token, str(replies[node]))
        for node, s in first.items()
    }
    problems = []
    try:
        for node, ref in refs.items():
            try:
                why = ray.get(ref, timeout=timeout_s)
            except Exception as exc:  # noqa: BLE001 - a node whose probe did not answer
                why = f"no answer within {timeout_s:.0f} s ({type(exc).__name__})"
            if not why and _read(replies[node]) != token:
                why = f"its probe {replies[node].name} did not reach this machine"
            if why:
                problems.append(f"node {node[:8]} ({first[node].ip or '?'}): {why}")
    finally:
        for path in (probe, *replies.values()):
            path.unlink(missing_ok=True)
    if problems:
        raise ConfigError(
            f"the run folder {folder.parent} is not shared with every Ray node: "
            + "; ".join(problems)
            + "; put the run on storage every node mounts (hydra.run.dir=/shared/...)"
        )


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
