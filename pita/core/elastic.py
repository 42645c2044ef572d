"""How many ranks a training task gets: chosen when it is dispatched, by simulating the rest
of the plan once per candidate k, and kept (a waiting gang holds the devices it gathers).

Why a simulation and not a rule: the task that holds a run back is a single long training
task on the critical path (PITA's value training in the default experiment), and whether it
should wait for k devices or start now on one depends on what every other chain will do with
those devices meanwhile. Greedy "take what is idle" loses (the task becomes ready while every
device runs other chains' shards and keeps the one it got); the plan's own event simulation
(pita/core/parallel_executor.py `simulate`, the dry run's and the ETA's) knows.

- `speedup(k, alpha)`: s(k) = k / (1 + alpha (k - 1)), the task's speedup on k ranks
  (Amdahl-like: alpha is the share of a step that does not shrink with k: all-reduce, the
  model's fixed cost). A task on k ranks lasts (its one-rank seconds) / s(k) + start-up(k).
- `SpeedupCurves`: alpha per (stage, family) fitted from the seconds the same task took at
  different k (kept in the per-user duration cache, `task_durations.json`); with no history
  `DEFAULT_ALPHA`, a conservative figure (worse than the 2-rank gloo bench's measured alpha:
  a curve that promises too much would make a gang wait for nothing).
- `GangStartup`: seconds from dispatch to the first optimizer step of a k-rank gang beyond a
  one-rank task (rank processes, rendezvous): measured ones when a task reported them, else
  `DEFAULT_STARTUP_S`.
- `Sizer`: the decision. For an elastic task (`TaskSpec.ranks`: a training stage that runs
  data-parallel on 1..k ranks, or a gang forced by memory from its least k up) it simulates
  the remaining plan once per k of its `ranks` (1, 2, 4, ..., max_ranks). Inside each of
  those simulations the elastic tasks that become ready later are sized too, cheaply (the
  k whose gang ends first given when the devices free up, at most the devices idle then):
  a decision that assumed every later one stays on one rank would see that chain as the
  end of the plan and give this task too few ranks. It keeps the k with the earliest
  predicted end; among ends within 2 % of it (`margin`: within the estimates' error) the k
  whose own chain ends first, so the slack goes to the chain that is not at the end yet.
  Dispatch priority is the seconds to the end of the plan from the duration cache
  (`prioritize`), so the chain that holds the run back is placed first.
  Its cost is bounded: on a plan larger than the window, a task whose own path to the end
  is shorter than the longest one by more than `slack` gets its least k without a
  simulation; the simulation covers at most `window` tasks (the highest-priority ones,
  closed under dependencies), each task's path beyond it added to its simulated end.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from pita.core.parallel import Gang, Strategy
from pita.core.tasks import TaskSpec

TRAINING_STAGES = ("pretrain", "reward_model", "train")
# No history: s(2) = 1.6, s(4) = 2.3, s(8) = 2.9. The 2-rank gloo bench measures less
# (bench/README.md, "Elastic training"); a learned curve replaces it after one run at two k.
DEFAULT_ALPHA = 0.25
# Seconds a k-rank gang adds before its first step (k rank processes importing torch and
# meeting at a rendezvous) on top of a one-rank task: measured on a 2-core CPU with the
# launcher of pita/training/ddp.py (bench/scaling.py's `startup` figures); replaced by the
# run's own measurements (`GangStartup.observe`).
DEFAULT_STARTUP_S = {1: 0.0, 2: 3.0, 4: 5.0, 8: 9.0}


def speedup(k: int, alpha: float) -> float:
    """s(k) = k / (1 + alpha (k - 1)): 1 at k = 1, k at alpha = 0, 1 at alpha = 1."""
    return k / (1.0 + alpha * (k - 1))


def _beyond(
    window: list[str],
    remaining: Mapping[str, TaskSpec],
    path_s: Mapping[str, float],
    dependants: Mapping[str, list[str]],
) -> dict[str, float]:
    """What lies beyond the window after each of its tasks: its longest path through a
    dependant outside the window (0 when the whole plan is simulated). `dependants` may be
    of a larger plan than `remaining` (a dependant of an unfinished task is unfinished too):
    only the window's own are read, not the whole plan per decision."""
    inside = set(window)
    tail = dict.fromkeys(window, 0.0)
    for d in window:
        for tid in dependants.get(d, ()):
            if tid not in inside and tid in remaining:
                tail[d] = max(tail[d], path_s.get(tid, 0.0))
    return tail


def rank_choices(max_ranks: int, n_devices: int) -> list[int]:
    """1, 2, 4, ... up to max_ranks and the device count (a gang never exceeds the run)."""
    top = max(1, min(max_ranks, n_devices))
    out, k = [], 1
    while k <= top:
        out.append(k)
        k *= 2
    return out


def resized(task: TaskSpec, k: int) -> TaskSpec:
    """A copy of `task` on k ranks: only its gang's world changes, and the memory per device
    follows how its ranks share it (DDP: every rank holds the whole task; FSDP, a gang
    forced by memory: the gang's total stays and divides by k)."""
    per_rank = -(-task.mem_mb // max(1, task.gpus))
    mem_mb = task.mem_mb if task.gang.strategy is Strategy.FSDP else per_rank * k
    gang = task.gang if task.gang.ranked else Gang(Strategy.DDP)  # a task built by hand
    return replace(task, gpus=k, gang=gang.resized(k), mem_mb=mem_mb)


def set_ranks(task: TaskSpec, k: int) -> None:
    """Give `task` k ranks in place (see `resized`)."""
    new = resized(task, k)
    task.set_gang(new.gang)
    task.mem_mb = new.mem_mb


def curve_key(task: TaskSpec) -> str:
    """Tasks that scale alike: the same stage of the same algorithm (its trainer: TRL's DPO
    and pita's value training start and scale differently) on the same model family."""
    return f"{task.algo}|{task.stage}|{task.family}"


class GangStartup:
    """Seconds a k-rank gang costs before its first step, beyond a one-rank task.

    Per stage kind (`curve_key`) when its tasks reported their first step (`first_step_s`,
    dispatch -> first optimizer step, pita/runtime/worker.py) on one rank and on k: the
    difference of the means (a TRL gang whose ranks import TRL pays seconds a value-training
    gang does not); else what gangs measured beyond one rank (`observe`); else the defaults."""

    def __init__(self, defaults: Mapping[int, float] | None = None):
        self.defaults = dict(DEFAULT_STARTUP_S if defaults is None else defaults)
        self.seen: dict[int, list[float]] = {}
        self.first: dict[str, dict[int, list[float]]] = {}  # curve -> k -> first-step s

    def observe(self, k: int, seconds: float) -> None:
        if k > 1 and seconds >= 0:
            self.seen.setdefault(k, []).append(float(seconds))

    def observe_first_step(self, curve: str, k: int, seconds: float) -> None:
        """A task of `curve` reached its first step `seconds` after dispatch on k ranks."""
        if k >= 1 and seconds >= 0:
            self.first.setdefault(curve, {}).setdefault(int(k), []).append(float(seconds))

    def of_curve(self, k: int, curve: str | None) -> float | None:
        """The measured start-up of `curve`'s k-rank gangs beyond its one-rank tasks, or None."""
        by = self.first.get(curve or "", {})
        if not by.get(k) or not by.get(1):
            return None
        return max(0.0, sum(by[k]) / len(by[k]) - sum(by[1]) / len(by[1]))

    def __call__(self, k: int, curve: str | None = None) -> float:
        if k <= 1:
            return 0.0
        measured = self.of_curve(k, curve)
        if measured is not None:
            return measured
        if self.seen.get(k):
            return sum(self.seen[k]) / len(self.seen[k])
        known = sorted(self.defaults.items())
        below = [(kk, s) for kk, s in known if kk <= k]
        above = [(kk, s) for kk, s in known if kk >= k]
        if not above:  # past the largest default: grow linearly with k
            (k0, s0), (k1, s1) = known[-2], known[-1]
            return s1 + (s1 - s0) / (k1 - k0) * (k - k1)
        (k0, s0), (k1, s1) = below[-1], above[0]
        return s0 if k1 == k0 else s0 + (s1 - s0) * (k - k0) / (k1 - k0)


@dataclass
class SpeedupCurves:
    """alpha per `curve_key`, fitted from seconds of the same task at several k.

    `history`: task key -> {"curve": curve key, "by_ranks": {k: seconds}} (the duration
    cache's entries, pita/experiment/timeline.py). A pair (1 rank: t1, k ranks: tk) gives
    alpha = (k (tk - start-up(k)) / t1 - 1) / (k - 1); the curve's alpha is the median of its
    pairs, clipped to [0, 1].
    """

    history: dict[str, dict[str, Any]] = field(default_factory=dict)
    default_alpha: float = DEFAULT_ALPHA
    startup: GangStartup = field(default_factory=GangStartup)
    _alpha: dict[str, float] | None = None

    def observe(self, key: str, task: TaskSpec, k: int, seconds: float) -> None:
        """This run's task `key` took `seconds` on k ranks."""
        entry = self.history.setdefault(key, {"curve": curve_key(task), "by_ranks": {}})
        entry["curve"] = curve_key(task)
        entry.setdefault("by_ranks", {})[str(k)] = float(seconds)
        self._alpha = None

    def observe_first_step(self, curve: str, k: int, seconds: float) -> None:
        """A task of `curve` reached its first step `seconds` after dispatch on k ranks: the
        start-up that a fit subtracts changed (`GangStartup.observe_first_step`)."""
        self.startup.observe_first_step(curve, k, seconds)
        self._alpha = None

    def fitted(self) -> dict[str, float]:
        if self._alpha is None:
            pairs: dict[str, list[float]] = {}
            for entry in self.history.values():
                by = {int(k): float(s) for k, s in (entry.get("by_ranks") or {}).items()}
                t1 = by.get(1)
                if not t1 or t1 <= 0:
                    continue
                for k, tk in by.items():
                    if k > 1:
                        start = self.startup(k, str(entry.get("curve")))
                        a = (k * max(1e-9, tk - start) / t1 - 1) / (k - 1)
                        pairs.setdefault(str(entry.get("curve")), []).append(min(1.0, max(0.0, a)))
            self._alpha = {c: sorted(v)[len(v) // 2] for c, v in pairs.items()}
        return self._alpha

    def alpha(self, task: TaskSpec) -> tuple[float, str]:
        """(alpha, where from): the fitted curve of its stage and family, else the default."""
        fitted = self.fitted().get(curve_key(task))
        if fitted is not None:
            return fitted, "learned"
        return self.default_alpha, "default"

    def seconds(self, task: TaskSpec, one_rank_s: float, k: int) -> float:
        """Expected seconds of `task` on k ranks, start-up included."""
        if k <= 1:
            return one_rank_s
        return one_rank_s / speedup(k, self.alpha(task)[0]) + self.startup(k, curve_key(task))

    def one_rank(self, task: TaskSpec, seconds: float, k: int) -> float:
        """The one-rank seconds that a k-rank wall time stands for (for the ETA's estimates)."""
        if k <= 1:
            return seconds
        start = self.startup(k, curve_key(task))
        return max(0.0, seconds - start) * speedup(k, self.alpha(task)[0])


@dataclass
class Sizing:
    """One decision: the k kept, the predicted end of the plan for each k tried, its cost."""

    task: str
    k: int
    predicted: dict[int, float]  # k -> seconds until the plan's end (from the decision)
    gang_start_s: float  # predicted seconds until the gang has its k devices
    cost_s: float
    simulated: bool  # False: its least k without a simulation (off the critical path)
    simulations: int = 0

    def journal_fields(self) -> dict[str, Any]:
        return {
            "task": self.task,
            "ranks": self.k,
            "predicted_end_s": {str(k): round(v, 2) for k, v in self.predicted.items()},
            "gang_start_s": round(self.gang_start_s, 2),
            "cost_ms": round(1000 * self.cost_s, 1),
            "simulations": self.simulations,
        }


class Sizer:
    """Chooses the ranks of elastic tasks by simulating the rest of the plan (see module doc).

    `one_rank_s(task)` -> the task's expected seconds on one rank (the ETA's `TaskDurations`
    estimate, converted by `SpeedupCurves.one_rank`); `simulate(tasks, seconds, first,
    resize, ends=)` -> a dict of predicted start times and the makespan of `tasks`
    (pita/core/parallel_executor.py `simulate_window`), with the ids in `first` placed
    before the others and each task's predicted end written into `ends`.
    """

    def __init__(
        self,
        curves: SpeedupCurves,
        one_rank_s: Callable[[TaskSpec], float],
        simulate: Callable[..., tuple[dict[str, float], float]],
        n_devices: int,
        max_ranks: int,
        window: int = 250,
        key: Callable[[TaskSpec], str] = lambda t: t.id,
        version: Callable[[], Any] = lambda: 0,
    ):
        self.key = key
        self.version = version  # changes when the duration estimates do (cached paths)
        self._paths: tuple[Any, dict[str, float]] | None = None
        self._dependants: dict[str, list[str]] = {}  # of the tasks `paths` last read
        self._order: tuple[Any, list[str]] | None = None
        self._longest: list[Any] = [[], 0]  # ids by path to the end, first one unfinished
        self.margin = 0.02  # predicted ends closer than this share count as equal
        self.slack = 0.1  # big plans: a path this much shorter than the longest: least k
        self.curves = curves
        self.one_rank_s = one_rank_s
        self.simulate = simulate
        self.n_devices = n_devices
        self.choices = rank_choices(max_ranks, n_devices)  # an elastic task's: `task.ranks`
        self.window = window
        self.decisions: dict[str, Sizing] = {}

    @property
    def enabled(self) -> bool:
        return len(self.choices) > 1

    def ranks_of(self, task: TaskSpec) -> list[int]:
        """The k an elastic task may be given here (its `ranks`, at most the sizer's)."""
        return [k for k in task.ranks if k <= self.choices[-1]] or task.ranks[:1]

    def observe(self, task: TaskSpec, wall_s: float, result: Mapping[str, Any]) -> None:
        """A task finished on `task.gpus` ranks: its first step (`first_step_s`: its kind's
        start-up at that k), its seconds at that k (the curve, elastic tasks), and the
        gang's start-up when the stage measured it (`gang_startup_s` in its result)."""
        first = result.get("first_step_s")  # one-rank tasks too: the kind's baseline
        if isinstance(first, (int, float)):
            self.curves.observe_first_step(curve_key(task), task.gpus, float(first))
        if not task.elastic:
            return
        startup = result.get("gang_startup_s")
        if isinstance(startup, (int, float)):
            self.curves.startup.observe(task.gpus, float(startup))
        self.curves.observe(self.key(task), task, task.gpus, wall_s)

    def seconds(self, task: TaskSpec, k: int | None = None) -> float:
        k = task.gpus if k is None else k
        base = self.one_rank_s(task)
        return self.curves.seconds(task, base, k) if task.elastic else base

    def paths(self, tasks: Mapping[str, TaskSpec]) -> dict[str, float]:
        """Seconds from each task (itself included, one rank) to the end of `tasks`: computed
        once per duration estimate (an unfinished task's descendants are all unfinished, so
        the figure holds while the plan shrinks)."""
        stamp = self.version()
        if (
            self._paths is None
            or self._paths[0] != stamp
            or len(tasks) > len(self._paths[1])  # `tasks` only shrinks while estimates hold
        ):
            seconds = {tid: self.seconds(t, 1) for tid, t in tasks.items()}
            paths = paths_to_end(tasks, seconds)
            self._dependants = dependants_of(tasks)
            self._paths = (stamp, paths)
            self._longest = [sorted(paths, key=lambda tid: -paths[tid]), 0]
        return self._paths[1]

    def longest(self, tasks: Mapping[str, TaskSpec]) -> float:
        """The longest path to the end among `tasks` (after `paths(tasks)`): the first of
        the tasks sorted by path that is still in `tasks`; a task gone from them (finished)
        never comes back, so the scan resumes where it stopped."""
        by_path, start = self._longest
        path_s = self._paths[1] if self._paths is not None else {}
        for i in range(start, len(by_path)):
            if by_path[i] in tasks:
                self._longest[1] = i
                return path_s[by_path[i]]
        return 0.0

    def _by_priority(self, tasks: Mapping[str, TaskSpec]) -> list[str] | None:
        """Ids by priority, highest first: sorted once per duration estimate on a big plan
        (the window's choice; priorities do not change while it runs)."""
        if len(tasks) <= self.window:
            return None
        stamp = self.version()
        if self._order is None or self._order[0] != stamp or len(tasks) > len(self._order[1]):
            self._order = (stamp, sorted(tasks, key=lambda t: -tasks[t].priority))
        return self._order[1]

    def size(
        self,
        task: TaskSpec,
        remaining: Mapping[str, TaskSpec],
        running_left: Mapping[str, float],
    ) -> Sizing:
        """The k for `task` (not started) given the unfinished tasks (`remaining`, running
        ones included, each with its current k in `.gpus`) and the seconds left of the
        running ones.

        The predicted end of the plan for a k is the latest, over the simulated tasks, of
        (its simulated end + its path through the tasks outside the simulation): exactly the
        simulated makespan when the whole plan is simulated, and an estimate that does not
        ignore what lies beyond a window of the `window` highest-priority tasks on a big
        plan."""
        t0 = time.perf_counter()
        one = self.seconds(task, 1)
        path_s = self.paths(remaining)
        big = len(remaining) > self.window  # a small plan is simulated whole: milliseconds
        longest = self.longest(remaining) if big else 0.0
        if not task.elastic or (big and path_s.get(task.id, one) < (1 - self.slack) * longest):
            least = self.ranks_of(task)[0] if task.elastic else task.gpus
            sizing = Sizing(task.id, least, {}, 0.0, time.perf_counter() - t0, simulated=False)
            self.decisions[task.id] = sizing
            return sizing
        window = priority_window(
            remaining, self.window, set(running_left) | {task.id}, self._by_priority(remaining)
        )
        seconds = {  # what is left of the running tasks, the others' estimates at their k
            tid: running_left[tid] if tid in running_left else self.seconds(remaining[tid])
            for tid in window
            if tid != task.id
        }
        tail = _beyond(window, remaining, path_s, self._dependants)
        base = {tid: remaining[tid] for tid in window}
        first = list(running_left)  # the others in their priority order, as the runner does
        fixed = set(running_left) | set(self.decisions) | {task.id}  # started, or sized
        later = partial(self._size_in_simulation, fixed)
        predicted: dict[int, float] = {}
        starts: dict[int, float] = {}
        own: dict[int, float] = {}
        for k in self.ranks_of(task):
            trial = {**base, task.id: resized(task, k)}
            secs = {tid: seconds[tid] for tid in window if tid != task.id}
            secs[task.id] = self.seconds(task, k)
            end_at: dict[str, float] = {}
            start_at, _ = self.simulate(trial, secs, first, later, ends=end_at)
            predicted[k] = max(end_at[tid] + tail[tid] for tid in start_at)
            starts[k] = start_at.get(task.id, 0.0)
            own[k] = end_at.get(task.id, starts[k]) + tail[task.id]
        best = self._best(self.ranks_of(task), predicted, own)
        elapsed = time.perf_counter() - t0
        sizing = Sizing(task.id, best, predicted, starts[best], elapsed, True, len(predicted))
        self.decisions[task.id] = sizing
        return sizing

    def _best(self, choices: list[int], predicted: dict[int, float], own: dict[int, float]) -> int:
        """The earliest predicted end; within `margin` of it (a smaller difference is within
        the estimates' error) the k whose own chain ends first: when another chain sets the
        end, a shorter chain here is time the later decisions can give that one."""
        margin = self.margin * predicted[choices[0]]
        near = [k for k in choices if predicted[k] <= min(predicted.values()) + margin]
        return min(near, key=lambda k: (round(own[k], 6), k))

    def _size_in_simulation(
        self, fixed: set[str], t: TaskSpec, now: float, ends: dict[str, float], sched: Any
    ) -> tuple[TaskSpec, float] | None:
        """An elastic task that becomes ready inside the simulation is sized there, cheaply,
        as its own decision would: the k whose gang ends first given when the devices
        free up, at most the devices idle then (so no simulated gang waits holding
        devices; the run shrinks a gang that waits past its prediction). None: not
        sized here (not elastic, started, sized already, or the task being decided)."""
        if not t.elastic or t.id in fixed:
            return None
        free_at = sorted(max([now, *(ends.get(x, now) for x in d.running)]) for d in sched.devices)
        choices = self.ranks_of(t)
        k = min(choices, key=lambda k: (free_at[k - 1] + self.seconds(t, k), k))
        idle = sum(1 for at in free_at if at <= now)
        k = max([c for c in choices if c <= min(k, idle)] or choices[:1])
        new = resized(t, k)
        return new, self.seconds(new, k)

    def prioritize(self, tasks: Mapping[str, TaskSpec]) -> None:
        """Dispatch priority = the seconds from a task to the end of the plan (its longest
        path, one-rank estimates of the duration cache), not the planner's work units: the
        chain that holds the run back is the one the measured durations say."""
        for tid, p in paths_to_end(
            tasks, {t: self.seconds(x, 1) for t, x in tasks.items()}
        ).items():
            tasks[tid].priority = p


def dependants_of(tasks: Mapping[str, TaskSpec]) -> dict[str, list[str]]:
    """Each task's dependants among `tasks`."""
    dependants: dict[str, list[str]] = {tid: [] for tid in tasks}
    for tid, t in tasks.items():
        for d in t.deps:
            if d in dependants:
                dependants[d].append(tid)
    return dependants


def paths_to_end(tasks: Mapping[str, TaskSpec], seconds: Mapping[str, float]) -> dict[str, float]:
    """Seconds of the longest chain from each task (itself included) to the end of `tasks`."""
    dependants = dependants_of(tasks)
    order = topological(tasks)
    out: dict[str, float] = {}
    for tid in reversed(order):
        out[tid] = seconds.get(tid, 0.0) + max((out[c] for c in dependants[tid]), default=0.0)
    return out


def topological(tasks: Mapping[str, TaskSpec]) -> list[str]:
    """`tasks`' ids, each after its dependencies among `tasks` (a plan's order already is)."""
    seen: set[str] = set()
    out: list[str] = []
    for root in tasks:
        stack = [(root, False)]
        while stack:
            tid, expanded = stack.pop()
            if expanded:
                out.append(tid)
                continue
            if tid in seen:
                continue
            seen.add(tid)
            stack.append((tid, True))
            stack.extend((d, False) for d in tasks[tid].deps if d in tasks and d not in seen)
    return out


def priority_window(
    tasks: Mapping[str, TaskSpec], size: int, keep: set[str], order: list[str] | None = None
) -> list[str]:
    """At most about `size` of `tasks`: `keep` and the highest-priority others, closed under
    dependencies (a task is in only with every unfinished dependency), in plan order.
    `order`: ids by priority already sorted (it may hold ids not in `tasks`)."""
    if len(tasks) <= size:
        return list(tasks)
    chosen = set(keep)
    for tid in order if order is not None else sorted(tasks, key=lambda t: -tasks[t].priority):
        if tid not in tasks:
            continue
        if len(chosen) >= size:
            break
        stack = [tid]
        while stack:
            x = stack.pop()
            if x not in chosen and x in tasks:
                chosen.add(x)
                stack.extend(tasks[x].deps)
    return [tid for tid in tasks if tid in chosen]
