"""Task durations across runs, for the ETA and the dry run's wall-time line (orchestrator side).

The durations of finished tasks (from the journal's `task_done` events) are kept per user in
`$PITA_CACHE_DIR/task_durations.json` (next to the peaks cache of pita/experiment/estimates.py),
keyed by the task id, its sharding, the device kind and a fingerprint of the config that changes
a task's work, so a later run of the same experiment starts with an ETA from measured durations.
The end-of-run report (timeline.png, time.md) is pita/results/timeline.py.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pita.core import user_cache
from pita.core.host_share import HostShare, mean_rates
from pita.core.journal import read_events
from pita.core.paths import RunPaths, pita_cache_dir
from pita.core.schema import result_config

# --- durations across runs ------------------------------------------------------------------


def durations_cache_path() -> Path:
    return pita_cache_dir() / "task_durations.json"


def _node(cfg: Any, dotted: str) -> Any:
    node = cfg
    for part in dotted.split("."):
        try:
            node = node[part]
        except (KeyError, TypeError, AttributeError, IndexError):
            return None
    return node


def _num(cfg: Any, dotted: str) -> float:
    """The number at `dotted`, 0.0 when absent (for `a or b` chains)."""
    node = _node(cfg, dotted)
    try:
        return float(node) if node is not None else 0.0
    except (TypeError, ValueError):
        return 0.0


def _amount(cfg: Any, dotted: str) -> float:
    """The number at `dotted`; absent (a partial config), the schema's own default for it
    (`algos.<NAME>.*`: that algorithm's schema), never a restated one; a key without a
    numeric default (a dataset size of another task, a key the algorithm lacks) counts as 1."""
    node = _node(cfg, dotted)
    if node is None:
        node = _schema_default(dotted)
    try:
        return float(node) if node is not None else 1.0
    except (TypeError, ValueError):
        return 1.0


def _schema_default(dotted: str) -> Any:
    from pita.algos.registry import ALGORITHMS
    from pita.core.schema import default_of

    group, _, key = dotted.partition(".")
    try:
        if group == "algos":
            name, _, key = key.partition(".")
            return default_of(key, ALGORITHMS[name].schema) if name in ALGORITHMS else None
        return default_of(dotted)
    except KeyError:
        return None


def task_size(task: Any, cfg: Any) -> dict[str, float]:
    """What a task's duration grows with, per stage: optimizer steps x batch for training
    (epochs x examples when steps are derived), prompts x samples for generation, and the
    model's size (`memory_gb`). Tasks of one kind differ by these; seconds scale with their
    product (`DurationHistory.scaled`). A missing amount counts as 1."""
    algo = f"algos.{task.algo}"
    examples = (
        _num(cfg, "data_collection.max_examples")
        or _num(task.dataset_cfg, "train_size")
        or _amount(cfg, "dataset.train_size")
    )
    stage = task.stage.removesuffix("_merge")
    if stage == "pretrain":
        size = {
            "steps": _amount(cfg, "pretrain.steps"),
            "batch": _amount(cfg, "pretrain.batch_size"),
        }
    elif stage == "train":
        steps = _num(cfg, f"{algo}.steps")
        size = (
            {"steps": steps, "batch": _amount(cfg, f"{algo}.batch_size")}
            if steps > 0
            else {"epochs": _amount(cfg, f"{algo}.epochs"), "examples": examples}
        )
    elif stage == "collect":
        samples = _num(cfg, f"{algo}.samples_per_example") or _amount(
            cfg, f"{algo}.pairs_per_example"
        )
        size = {"examples": examples / task.num_shards, "samples": samples}
    elif stage == "reward_model":
        size = {"epochs": _amount(cfg, f"{algo}.reward_epochs"), "examples": examples}
    elif stage == "evaluate":
        test = _num(task.dataset_cfg, "test_size") or _amount(cfg, "dataset.test_size")
        etas = _node(cfg, "evaluation.etas")
        size = {
            "examples": test / task.num_shards,
            "samples": _amount(cfg, "evaluation.num_samples"),
            "etas": float(len(etas) if isinstance(etas, (list, tuple)) and etas else 1),
        }
    else:
        size = {}
    size["model_gb"] = _num(task.family_cfg, "memory_gb") or _amount(cfg, "model.memory_gb")
    return {k: max(v, 1e-9) for k, v in size.items()}


def _product(size: Mapping[str, float]) -> float:
    out = 1.0
    for v in size.values():
        out *= float(v)
    return out


class DurationKey:
    """task -> cache key (task id, shard count, stage function, device kind, config print);
    `describe(task)` adds what a later run with another config compares by: the task's kind
    and size (`task_size`)."""

    def __init__(self, cfg: Any, device_kind: str):
        from omegaconf import OmegaConf

        try:
            resolved = OmegaConf.to_container(cfg, resolve=True)
        except Exception:  # a partial config in a unit test: no print, ids still distinguish
            resolved = {}
        work: dict[str, Any] = (
            {str(k): v for k, v in resolved.items()} if isinstance(resolved, dict) else {}
        )
        self.cfg = work
        # what a task computes changes how long it works; where it runs and what is recorded
        # do not (the device kind is in the key itself): `schema.result_config`
        work = result_config(work)
        if isinstance(work.get("experiment"), dict):  # seeds of a sweep take as long
            work["experiment"] = {k: v for k, v in work["experiment"].items() if k != "seed"}
        blob = json.dumps(work, sort_keys=True, default=str)
        self.print = hashlib.sha256(blob.encode()).hexdigest()[:12]
        self.device_kind = device_kind

    def __call__(self, t: Any) -> str:
        return f"{t.id}|{t.num_shards}|{t.fn}|{self.device_kind}|{self.print}"

    def kind(self, t: Any) -> str:
        """Tasks that differ only by size: algo, stage, dataset, family, device kind. Not the
        shard count: a shard's size is its share of the examples (`task_size`), so a run on
        8 devices estimates its shards from a run on 1."""
        return f"{t.algo}|{t.stage}|{t.dataset}|{t.family}|{t.fn}|{self.device_kind}"

    def describe(self, t: Any) -> dict[str, Any]:
        return {"kind": self.kind(t), "size": task_size(t, self.cfg)}


def duration_key(cfg: Any, device_kind: str) -> DurationKey:
    return DurationKey(cfg, device_kind)


@dataclass
class DurationHistory:
    """The durations cache as read: exact keys, and each kind's (seconds, size) records."""

    exact: dict[str, float]
    by_kind: dict[str, list[tuple[float, float]]]
    # (kind, size) -> seconds: a dry run of 34,292 tasks asks for each task several times
    _memo: dict[tuple[str, float], float | None] = field(default_factory=dict, repr=False)
    _sizes: dict[tuple[str, int], float] = field(default_factory=dict, repr=False)

    def scaled(self, task: Any, key: DurationKey) -> float | None:
        """Seconds of `task` from earlier tasks of its kind: with two sizes or more, a line
        through them (a fixed start-up plus seconds per unit of size, `fit_line`); with one,
        in proportion to size (the start-up scales too: an over-estimate for a larger task)."""
        kind = key.kind(task)
        seen = self.by_kind.get(kind)
        if not seen:
            return None
        sized = (task.id, task.num_shards)  # what task_size reads does not change in a run
        if sized not in self._sizes:
            self._sizes[sized] = _product(task_size(task, key.cfg))
        size = self._sizes[sized]
        if (kind, size) not in self._memo:
            line = fit_line(seen)
            self._memo[kind, size] = (
                line[0] + line[1] * size
                if line is not None
                else sum(wall * size / old for wall, old in seen) / len(seen)
            )
        return self._memo[kind, size]


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """(start-up s, s per unit) by least squares over (seconds, size) points, both kept
    non-negative; None with fewer than two distinct sizes."""
    if len({size for _, size in points}) < 2:
        return None
    n = len(points)
    mx = sum(s for _, s in points) / n
    my = sum(w for w, _ in points) / n
    var = sum((s - mx) ** 2 for _, s in points)
    slope = max(0.0, sum((s - mx) * (w - my) for w, s in points) / var)
    start = my - slope * mx
    if start < 0:  # through the origin instead
        return 0.0, sum(w * s for w, s in points) / sum(s * s for _, s in points)
    return start, slope


def _entry(value: Any) -> tuple[float, str | None, float | None]:
    wall = float(value["wall_s"])
    if not wall >= 0:
        raise ValueError("wall_s")
    kind, size = value.get("kind"), value.get("size")
    if not isinstance(kind, str) or not isinstance(size, dict):
        return wall, None, None  # an entry of an older pita: exact key only
    product = _product({k: float(v) for k, v in size.items()})
    return wall, kind, product if product > 0 else None


def load_history(path: Path | None = None) -> DurationHistory:
    """The durations cache ({} when there is no trustworthy cache: pita/core/user_cache.py)."""
    path = path or durations_cache_path()
    parsed = user_cache.entries(user_cache.read_json(path, "durations"), path, "durations", _entry)
    by_kind: dict[str, list[tuple[float, float]]] = {}
    for wall, kind, size in parsed.values():
        if kind is not None and size is not None:
            by_kind.setdefault(kind, []).append((wall, size))
    return DurationHistory({k: v[0] for k, v in parsed.items()}, by_kind)


def load_rank_history(path: Path | None = None) -> dict[str, dict[str, Any]]:
    """Recorded seconds per rank count: key -> {"curve": algo|stage|family, "by_ranks": {k:
    s}, "first_step": {k: s}} (what pita/core/elastic.py fits speedup curves and each kind's
    gang start-up from); entries with neither are left out."""
    path = path or durations_cache_path()

    def parse(v: Any) -> dict[str, Any] | None:
        if not isinstance(v, dict) or not isinstance(v.get("curve"), str):
            return None
        out: dict[str, Any] = {"curve": v["curve"]}
        for name in ("by_ranks", "first_step"):  # seconds, and dispatch -> first step, per k
            if isinstance(v.get(name), dict):
                out[name] = {str(int(r)): float(x) for r, x in v[name].items()}
        return out if len(out) > 1 else None

    data = user_cache.read_json(path, "durations")
    parsed = user_cache.entries(data, path, "durations", parse)
    return {k: v for k, v in parsed.items() if v is not None}


def ranks_of(events: list[dict[str, Any]]) -> dict[str, int]:
    """task id -> how many devices (ranks) its last started attempt had."""
    return {
        e["task"]: max(1, len(e.get("devices") or [0]))
        for e in events
        if e.get("event") == "task_running"
    }


def record_durations(
    run_dir: Path,
    tasks: Mapping[str, Any],
    key: Callable[[Any], str],
    path: Path | None = None,
    *,
    events: list[dict[str, Any]] | None = None,
    one_rank: Callable[[Any, float, int], float] | None = None,
    share: HostShare | None = None,
) -> int:
    """Add this run's finished tasks' durations to the cache; how many were recorded.
    `events`: the run's journal when the caller has read it already.

    `wall_s` is what the task stands for on one rank with the host's cores to itself
    (`share`: tasks that shared the CPU count their work, `work_walls`; `one_rank(task,
    wall, k)` converts a gang's wall time); an elastic task also keeps its seconds per rank
    count (`by_ranks`, across runs) and its curve key, from which speedup curves are fitted."""
    from pita.core.elastic import curve_key

    path = path or durations_cache_path()
    if events is None:
        events = read_events(RunPaths(run_dir).journal)
    walls = work_walls(events, share)
    firsts = first_steps(events)
    ranks = ranks_of(events)
    if not walls:
        return 0

    def add(data: dict[str, Any]) -> None:
        for tid, wall in walls.items():
            if tid in tasks:
                t, k = tasks[tid], ranks.get(tid, 1)
                one = one_rank(t, wall, k) if one_rank and k > 1 else wall
                entry: dict[str, Any] = {"wall_s": round(one, 3), "run": str(run_dir)}
                if isinstance(key, DurationKey):  # kind and size: scaled for another config
                    entry.update(key.describe(t))
                old = data.get(key(t))
                old = old if isinstance(old, dict) else {}
                if getattr(t, "elastic", False):
                    by = dict(old.get("by_ranks") or {})
                    entry.update(curve=curve_key(t), by_ranks={**by, str(k): round(wall, 3)})
                if tid in firsts:  # the kind's start-up on k ranks (GangStartup)
                    seen = dict(old.get("first_step") or {})
                    entry.update(curve=curve_key(t), first_step={**seen, str(k): firsts[tid]})
                data[key(t)] = entry

    return len(walls) if user_cache.update_json(path, "durations", add) else 0


def done_walls(events: list[dict[str, Any]]) -> dict[str, float]:
    """task id -> wall_s of its (last) task_done event."""
    return {
        e["task"]: float(e.get("wall_s") or 0.0) for e in events if e.get("event") == "task_done"
    }


def work_walls(events: list[dict[str, Any]], share: HostShare | None) -> dict[str, float]:
    """task id -> the work of its (last) finished attempt (`HostShare.work`: its CPU seconds,
    or its wall_s x the host's mean rate while it ran; pita/core/host_share.py), or wall_s
    itself without a share (GPUs)."""
    walls = done_walls(events)
    if share is None:
        return walls
    rates, ranks, cpu = mean_rates(events, share), ranks_of(events), done_figures(events, "cpu_s")
    return {
        tid: share.work(wall, rates.get(tid, 1.0), cpu.get(tid), ranks.get(tid, 1))
        for tid, wall in walls.items()
    }


def first_steps(events: list[dict[str, Any]]) -> dict[str, float]:
    """task id -> seconds from its dispatch to its first step (`first_step_s` of its last
    task_done event, where the stage reported steps)."""
    return {tid: round(s, 3) for tid, s in done_figures(events, "first_step_s").items()}


def done_figures(events: list[dict[str, Any]], name: str) -> dict[str, float]:
    """task id -> the number `name` of its last task_done event, where it has one."""
    return {
        e["task"]: float(e[name])
        for e in events
        if e.get("event") == "task_done" and isinstance(e.get(name), (int, float))
    }
