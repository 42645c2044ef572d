"""Ready-queue scheduling of the task DAG onto devices, with retries by failure class.

`Scheduler` is pure placement logic: given ready tasks, device memory and what is running,
it picks (task, devices) pairs — highest priority first (`estimate_job_priority`,
critical path by default), admission by free memory minus the reservations of running
tasks, k-device gangs chosen by free memory, and up to `max_tasks_per_device` tasks per
device (`executor.max_tasks_per_gpu`: auto packs GPUs while memory estimates fit, see
pita/core/resources.py). Packing must not starve what needs a lot of one device, so a
task that does not fit *holds* devices (nothing new starts there until it fits):
  - a k-device gang holds its k best devices at once;
  - a large single-device task (more than half a device) holds the device where it
    would fit soonest;
  - any other task that was passed over `hold_after` times while lower-priority tasks
    started (aging) holds one device too.
`DagRunner` drives a `WorkerPool` (or the in-process executor) with it, journals every
state change, refines the memory estimates of waiting tasks when a finished task reports
its measured peak, and applies the retry policy of docs/DESIGN.md §3:
  oom -> retry at half the micro-batch (effective batch kept by accumulation);
  killed / cuda_fault / timeout -> recycle the worker, retry up to executor.max_retries;
  error -> fail the task and skip its dependants; the other chains keep running.
"""

from __future__ import annotations

import bisect
import heapq
import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from pita.core.dag import Plan
from pita.core.elastic import resized, set_ranks
from pita.core.errors import NODE_LOST, RETRYABLE, ExecutorBroken
from pita.core.host_share import HostShare
from pita.core.journal import RUN_FILE_PREFIX, RunFileError
from pita.core.parallel import Strategy
from pita.core.tasks import TaskSpec

log = logging.getLogger(__name__)
# A sized gang still waiting past its predicted start is decided again this often (the
# prediction was wrong: others ran longer), then shrunk to the devices free.
REDECIDE = 2
# While nothing runs, a sized gang waits for its workers to start (a run's first seconds:
# each worker imports torch), not behind another task: shrinking it then would put the
# run's first training task (pretrain, on the critical path) on one rank for no gain.
WORKER_START_GRACE_S = 60.0


def estimate_job_priority(job: TaskSpec, cfg: Any = None) -> float:
    """Higher runs first. Default: critical path (work from this task to the DAG's end).

    Customise here (the seed guide's hook, docs/guides/gpu_execution.txt), e.g. `return -job.round` for breadth-first.
    """
    return job.priority


@dataclass
class DeviceState:
    index: int
    total_mb: int
    free_mb: int  # as last measured (NVML) or simulated
    running: dict[str, int] = field(default_factory=dict)  # task id -> reserved MB
    allocated_by_ours_mb: int = 0  # NVML: memory our own workers already hold on this device


def per_device(task: TaskSpec) -> int:
    """MB a task needs on each of its devices (`mem_mb` is its gang's total)."""
    return -(-task.mem_mb // task.gpus)


def _pack_order(free_mb: dict[int, int], d: DeviceState) -> tuple[int, int, int]:
    """Where a task is packed: the device with the fewest tasks, then the most memory left."""
    return len(d.running), -free_mb[d.index], d.index


class Scheduler:
    def __init__(
        self,
        devices: list[DeviceState],
        max_tasks_per_device: int = 1,
        priority: Callable[[TaskSpec], float] = estimate_job_priority,
        simulated_memory: bool = True,
        hold_after: int = 3,
        large_fraction: float = 0.5,
        host: HostShare | None = None,
    ):
        self.devices = devices
        # tasks that compute on the host's CPU share its cores (fake / CPU devices): the
        # simulations slow them down together (pita/core/host_share.py); None: devices of their own
        self.host = host
        self.max_tasks = max_tasks_per_device
        self.priority = priority
        # Simulated devices (fake/cpu) have no NVML reading: free = total - reservations.
        self.simulated_memory = simulated_memory
        self.hold_after = hold_after  # aging: passed over this often -> the task holds a device
        self.large_fraction = (
            large_fraction  # above this share of a device a task holds one at once
        )
        self.passed_over: dict[str, int] = {}
        self.held: dict[int, str] = {}  # device -> the task it is held for (last place() call)
        # device -> its Ray node: a gang goes on one node when one has room (empty: one machine)
        self.node_of: dict[int, str] = {}

    def available_mb(self, d: DeviceState) -> int:
        """Free memory minus what running tasks reserved but have not allocated yet.

        Simulated devices (fake GPUs, CPU slots) have no measurement: total - reservations.
        On NVML devices the measured free memory already excludes what our workers hold,
        so only the not-yet-allocated part of the reservations is subtracted.
        """
        reserved = sum(d.running.values())
        if self.simulated_memory:
            return d.total_mb - reserved
        return d.free_mb - max(0, reserved - d.allocated_by_ours_mb)

    def _eligible(self, d: DeviceState, mem_mb: int) -> bool:
        return len(d.running) < self.max_tasks and self.available_mb(d) >= mem_mb

    def _capacity_mb(self, d: DeviceState) -> int:
        """What the device could offer once its running tasks finish."""
        return d.total_mb if self.simulated_memory else d.free_mb + d.allocated_by_ours_mb

    def _hold_for(self, task: TaskSpec, per_device_mb: int, blocked: set[int]) -> list[int]:
        """Devices a task that does not fit now should hold, or [] (it just waits)."""
        free = [d for d in self.devices if d.index not in blocked]
        if task.gpus > 1:  # a gang: its best devices, fewest tasks and most memory first
            best = sorted(free, key=lambda d: (len(d.running), -self.available_mb(d)))
            return [d.index for d in best[: task.gpus]]
        could = [d for d in free if self._capacity_mb(d) >= per_device_mb]
        if not could:
            return []
        large = per_device_mb > self.large_fraction * max(d.total_mb for d in could)
        if not large and self.passed_over.get(task.id, 0) < self.hold_after:
            return []
        soonest = max(could, key=lambda d: (self.available_mb(d), -len(d.running), -d.index))
        return [soonest.index]

    def _one_node(
        self, candidates: list[DeviceState], k: int, packed: Callable[[DeviceState], Any]
    ) -> list[DeviceState]:
        """k of `candidates` on one node (the node with the most of them free, in `place`'s
        packing order `packed`), or [] when no node has k: the gang then spans nodes."""
        by_node: dict[str, list[DeviceState]] = {}
        for d in candidates:
            by_node.setdefault(self.node_of.get(d.index, ""), []).append(d)
        best = max(by_node.values(), key=len)
        if len(best) < k:
            return []
        return sorted(best, key=packed)[:k]

    def place(
        self, ready: Iterable[TaskSpec], presorted: bool = False
    ) -> list[tuple[TaskSpec, list[int]]]:
        """Assign as many ready tasks as fit now; mutates device reservations. `presorted`:
        `ready` is in dispatch order already (highest priority first, ties in plan order:
        the simulation keeps it so, and passes a lazy sequence it may stop reading)."""
        placements = []
        blocked: set[int] = set()  # devices held back for a waiting gang or large task
        waiting: list[str] = []  # tasks that did not fit, in priority order
        self.held = {}
        cap = self.max_tasks
        # the devices with a free slot, in device order (a simulation asks this millions of
        # times: most devices are full, the others are few)
        open_devices = [d for d in self.devices if len(d.running) < cap]
        for task in ready if presorted else sorted(ready, key=self.priority, reverse=True):
            if not open_devices:
                break  # every device is full: the rest wait (a plan of 100k tasks stays fast)
            per_device_mb = per_device(task)
            free_mb = {d.index: self.available_mb(d) for d in open_devices}
            candidates = [
                d
                for d in open_devices
                if d.index not in blocked and free_mb[d.index] >= per_device_mb
            ]
            if len(candidates) < task.gpus:
                for index in self._hold_for(task, per_device_mb, blocked):
                    blocked.add(index)
                    self.held[index] = task.id
                waiting.append(task.id)
                continue
            if task.gpus == 1 and task.preferred_device is not None:
                pref = [d for d in candidates if d.index == task.preferred_device and not d.running]
                if pref:
                    candidates = pref
            # Pack: the device with the fewest tasks, then the most memory left (one device:
            # the least of them, not a sort: a big plan's simulation places 100,000s of tasks)
            packed = partial(_pack_order, free_mb)
            if task.gpus == 1:
                chosen = [min(candidates, key=packed)]
            else:
                chosen = sorted(candidates, key=packed)[: task.gpus]
            if task.gpus > 1 and self.node_of:
                chosen = self._one_node(candidates, task.gpus, packed) or chosen
            for d in chosen:
                d.running[task.id] = per_device_mb
            if any(len(d.running) >= cap for d in chosen):
                open_devices = [d for d in open_devices if len(d.running) < cap]
            placements.append((task, sorted(d.index for d in chosen)))
            self.passed_over.pop(task.id, None)
            for tid in waiting:  # a lower-priority task started while these waited
                self.passed_over[tid] = self.passed_over.get(tid, 0) + 1
            waiting.clear()
        return placements

    def release(self, task_id: str) -> None:
        for d in self.devices:
            if task_id in d.running:
                del d.running[task_id]


def simulate(
    plan: Plan,
    scheduler: Scheduler,
    duration: Callable[[TaskSpec], float] = lambda t: t.work,
    *,
    starts: dict[str, float] | None = None,
    ends: dict[str, float] | None = None,
    on_ready: Callable[[TaskSpec, float, dict[str, float], set[str]], None] | None = None,
    first: frozenset[str] | set[str] = frozenset(),
) -> tuple[dict[str, list[int]], float]:
    """Event simulation of the schedule (dry run placement): task -> devices, makespan.

    Ready tasks are tracked by counting each task's unfinished dependencies, so a plan of
    tens of thousands of tasks simulates in seconds (the ready list keeps plan order).
    `duration(task)` is the task's work: its seconds with the host's cores to itself. On a
    scheduler with a `host` (tasks computing on shared CPU cores) the running tasks progress
    together at the host's rate (pita/core/host_share.py): a virtual clock of work seconds
    orders their ends. `starts` / `ends` (if given) receive each task's simulated start and
    end. `on_ready(task, now, ends, unstarted)` is called once for each task as it becomes
    ready, before it can be placed, with the running tasks' (expected) end times and the
    ids not started yet: the dry run sizes elastic tasks there (pita/core/elastic.py), as
    the real run does at dispatch. The ids in `first` are placed before every other ready
    task (running tasks that hold their devices now), dependencies outside the plan are met."""
    order = {tid: i for i, tid in enumerate(plan.tasks)}
    waiting_on = {tid: sum(1 for d in t.deps if d in plan.tasks) for tid, t in plan.tasks.items()}
    dependants: dict[str, list[str]] = {}
    for tid, t in plan.tasks.items():
        for d in t.deps:
            dependants.setdefault(d, []).append(tid)
    ready_ids = {tid for tid, n in waiting_on.items() if n == 0}
    # the ready tasks in dispatch order (the scheduler's priority, then plan order), kept
    # sorted as tasks become ready and start: no sort of thousands of ready tasks an event
    rank = lambda tid: (tid not in first, -scheduler.priority(plan.tasks[tid]), order[tid])  # noqa: E731
    queue = sorted((rank(tid), tid) for tid in ready_ids)
    running: list[tuple[float, str]] = []  # (virtual end, id)
    placement: dict[str, list[int]] = {}
    unstarted = set(plan.tasks)
    fresh = set(ready_ids)
    clock = _Clock(scheduler.host)
    while ready_ids or running:
        if on_ready is not None and fresh:
            ends_now = {tid: clock.wall_at(end) for end, tid in running}
            for tid in sorted(fresh, key=order.__getitem__):
                on_ready(plan.tasks[tid], clock.now, ends_now, unstarted)
        fresh = set()
        for task, devs in scheduler.place((plan.tasks[tid] for _, tid in queue), presorted=True):
            del queue[bisect.bisect_left(queue, (rank(task.id), task.id))]
            placement[task.id] = devs
            if starts is not None:
                starts[task.id] = clock.now
            heapq.heappush(running, (clock.virtual + duration(task), task.id))
            clock.start(task)
            ready_ids.discard(task.id)
            unstarted.discard(task.id)
        if not running:
            break  # nothing fits: reported by the caller
        virtual_end, tid = heapq.heappop(running)
        clock.end_at(virtual_end, tid)
        if ends is not None:
            ends[tid] = clock.now
        scheduler.release(tid)
        for child in dependants.get(tid, []):
            waiting_on[child] -= 1
            if waiting_on[child] == 0:
                ready_ids.add(child)
                fresh.add(child)
                bisect.insort(queue, (rank(child), child))
    return placement, clock.now


class _Clock:
    """The simulation's wall clock and virtual (work) clock: the same without a host share."""

    def __init__(self, host: HostShare | None):
        self.host = host
        self.now = self.virtual = self.demand = 0.0
        self.demands: dict[str, float] = {}

    def rate(self) -> float:
        return 1.0 if self.host is None else self.host.rate(self.demand)

    def wall_at(self, virtual: float) -> float:
        """When the virtual clock reaches `virtual`, if nothing starts or ends before."""
        return self.now + (virtual - self.virtual) / self.rate()

    def start(self, task: TaskSpec) -> None:
        if self.host is not None:
            self.demands[task.id] = self.host.demand(task)
            self.demand += self.demands[task.id]

    def end_at(self, virtual: float, task_id: str) -> None:
        self.now, self.virtual = self.wall_at(virtual), virtual
        self.demand = max(0.0, self.demand - self.demands.pop(task_id, 0.0))


@dataclass
class RunSummary:
    done: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # task id -> "class: message"
    skipped: dict[str, str] = field(default_factory=dict)  # task id -> failed dependency
    interrupted: bool = False
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failed and not self.skipped and not self.interrupted


class DagRunner:
    """Runs a Plan to completion on an executor (WorkerPool or InProcessExecutor)."""

    def __init__(
        self,
        plan: Plan,
        executor,
        scheduler: Scheduler,
        *,
        cfg_dict: dict,
        run_dir,
        journal=None,
        max_retries: int = 2,
        already_done: set[str] | None = None,
        round_barrier: bool = False,
        on_event: Callable[[str, TaskSpec, Any], None] | None = None,
        refresh_memory: Callable[[], list[tuple[int, int]]] | None = None,
        estimator: Any = None,
        sizer: Any = None,
        grower: Any = None,
    ):
        self.plan = plan
        self.executor = executor
        self.scheduler = scheduler
        self.cfg_dict = cfg_dict
        self.run_dir = run_dir
        self.journal = journal
        self.max_retries = max_retries
        self.done: set[str] = set(already_done or ())
        self.round_barrier = round_barrier  # benchmark baseline only: the original runner's policy
        self.on_event = on_event or (lambda kind, task, info: None)
        self.refresh_memory = refresh_memory  # -> [(free MB, MB held by our workers)] per device
        # Learns from measured peaks: observe(task, result) -> bool (learned something),
        # refine(task) -> (mem MB, source) | None (pita.experiment.estimates.PeakEstimator).
        self.estimator = estimator
        # Chooses the ranks of elastic training tasks when they become ready
        # (pita.core.elastic.Sizer); None: every task keeps its planned devices.
        self.sizer = sizer
        self.sized_at: dict[str, float] = {}  # sized task -> when (its wait is bounded)
        self.redecided: dict[str, int] = {}  # sized task -> times decided again after a wait
        self.started: dict[str, float] = {}  # running task -> when it was dispatched
        # Grows a running training task at a checkpoint into idle devices
        # (pita.core.growth.Grower); None: a task keeps its ranks until it ends.
        self.grower = grower
        self.attempts: dict[str, int] = {}
        self.nodes_lost: dict[str, int] = {}  # task -> attempts a lost Ray node ended
        self.running: dict[Future, TaskSpec] = {}
        self.placement: dict[str, list[int]] = {}
        self.summary = RunSummary(done=sorted(self.done))

    def _journal(self, event: str, **fields: Any) -> None:
        if self.journal is not None:
            self.journal.append(event, **fields)

    def _ready(self, pending: dict[str, TaskSpec]) -> list[TaskSpec]:
        ready = [t for t in pending.values() if all(d in self.done for d in t.deps)]
        if self.round_barrier and ready:
            unfinished = [t.round for t in pending.values()] + [
                t.round for t in self.running.values()
            ]
            lowest = min(unfinished) if unfinished else 0
            ready = [t for t in ready if t.round <= lowest]
        return ready

    def _skip_dependants(self, failed_id: str, pending: dict[str, TaskSpec]) -> None:
        dependants = self.plan.dependants()
        stack = list(dependants[failed_id])
        while stack:
            tid = stack.pop()
            if tid in pending:
                del pending[tid]
                self.summary.skipped[tid] = failed_id
                self._journal("task_skipped", task=tid, because=failed_id)
                self.on_event("skipped", self.plan.tasks[tid], failed_id)
                stack.extend(dependants[tid])

    def run(self) -> RunSummary:
        t0 = time.time()
        pending = {tid: t for tid, t in self.plan.tasks.items() if tid not in self.done}
        if self.sizer is not None and self.sizer.enabled:
            self.sizer.prioritize(pending)  # the chain the measured durations say goes first
        try:
            while pending or self.running:
                if self.refresh_memory is not None and not self.scheduler.simulated_memory:
                    for d, (free, ours) in zip(self.scheduler.devices, self.refresh_memory()):
                        d.free_mb, d.allocated_by_ours_mb = free, ours
                ready = self._ready(pending)
                if self.sizer is not None and self.sizer.enabled:
                    self._size(ready, pending)
                for task, devices in self.scheduler.place(ready):
                    del pending[task.id]
                    self.started[task.id] = time.time()
                    self.sized_at.pop(task.id, None)
                    attempt = self.attempts.get(task.id, 0) + 1
                    self.attempts[task.id] = attempt
                    self.placement[task.id] = devices
                    where = self._where(devices)
                    if where:  # on Ray: the gang carries its ranks' nodes to the worker
                        task.gang = replace(task.gang, nodes=tuple(where["nodes"]))
                    self._journal(
                        "task_running", task=task.id, devices=devices, attempt=attempt, **where
                    )
                    self.on_event("running", task, devices)
                    if self.grower is not None:
                        self.grower.dispatched(task)
                    fut = self.executor.submit(task, devices, self.cfg_dict, self.run_dir, attempt)
                    self.running[fut] = task
                if self.grower is not None:
                    self.grower.tick(self)
                if not self.running:
                    if pending:  # nothing runnable and nothing running: impossible placements
                        for tid in list(pending):
                            self.summary.failed[tid] = "error: cannot be placed on any device"
                            self._journal(
                                "task_failed", task=tid, failure="error", message="unplaceable"
                            )
                        pending.clear()
                    break
                finished, _ = wait(list(self.running), timeout=0.5, return_when=FIRST_COMPLETED)
                for fut in finished:
                    self._handle(fut, pending)
                check = getattr(self.executor, "check", None)
                if check is not None:
                    check()  # a dead pool thread would leave every future pending forever
                self._drop_lost_devices(pending)
        except KeyboardInterrupt:
            self.summary.interrupted = True
            self._journal("run_interrupted", running=[t.id for t in self.running.values()])
            raise
        finally:
            self.summary.wall_s = round(time.time() - t0, 3)
        return self.summary

    def _where(self, devices: list[int]) -> dict[str, Any]:
        """`nodes`: the Ray node ids (hex) of `devices` for the journal (Ray only)."""
        nodes_of = getattr(self.executor, "nodes_of", None)
        return {"nodes": nodes_of(devices)} if nodes_of is not None else {}

    def _drop_lost_devices(self, pending: dict[str, TaskSpec]) -> None:
        """Stop placing tasks on the devices of lost Ray nodes; give the waiting gangs that
        no longer fit the ranks left (a training task resumes from its newest checkpoint on
        any k). A task the devices left cannot hold stops the run (exit 1, resumable)."""
        lost_devices = getattr(self.executor, "lost_devices", None)
        lost = lost_devices() if lost_devices is not None else set()
        if not lost & {d.index for d in self.scheduler.devices}:
            return
        self.scheduler.devices = [d for d in self.scheduler.devices if d.index not in lost]
        nodes = self.executor.lost_nodes_line()
        left = len(self.scheduler.devices)
        self._journal("node_lost", nodes=nodes, devices=sorted(lost), devices_left=left)
        log.warning("Ray node(s) %s lost: %d device(s) left", nodes, left)
        for task in pending.values():
            self._fit_devices_left(task, nodes)

    def _fit_devices_left(self, task: TaskSpec, nodes: str) -> None:
        left = self.scheduler.devices
        if task.ranks:
            task.ranks = [k for k in task.ranks if k <= len(left)] or [1]
        if task.gpus > len(left) and task.strategy is not Strategy.NONE and left:
            previous = max(task.ranks or [len(left)])
            set_ranks(task, min(previous, len(left)))
            self._journal("task_resized", task=task.id, ranks=task.gpus, why=NODE_LOST)
        need = per_device(task)
        have = sum(1 for d in left if d.total_mb >= need)
        if task.gpus > have:
            raise ExecutorBroken(
                f"{task.id} needs {task.gpus} device(s) with {need} MB each; after losing "
                f"Ray node(s) {nodes} the cluster has {have}"
            )

    def _size(self, ready: list[TaskSpec], pending: dict[str, TaskSpec]) -> None:
        """Choose k for each newly ready elastic task (a simulation of the rest of the plan
        per candidate k). A sized gang still waiting past its predicted start is decided
        again on what the run looks like now (up to `REDECIDE` times), then shrunk to the
        devices free: no task waits behind a gang much longer than predicted."""
        now = time.time()
        for task in sorted(ready, key=self.scheduler.priority, reverse=True):
            if not task.elastic:
                continue
            if task.id not in self.sizer.decisions:
                self._decide(task, pending, now)
            elif task.id in self.sized_at and task.gpus > self.sizer.ranks_of(task)[0]:
                sizing = self.sizer.decisions[task.id]
                waited = now - self.sized_at[task.id]
                if waited <= sizing.gang_start_s + max(1.0, 0.25 * sizing.gang_start_s):
                    continue
                if not self.running and waited < WORKER_START_GRACE_S:
                    continue  # waiting for workers to come up, not behind another task
                previous = task.gpus
                self.redecided[task.id] = self.redecided.get(task.id, 0) + 1
                if self.redecided[task.id] <= REDECIDE:
                    k = self._decide(task, pending, now, journal=False)
                else:
                    k = self._free_ranks(task)
                    set_ranks(task, k)
                    del self.sized_at[task.id]
                if k != previous:
                    self._journal(
                        "task_resized", task=task.id, ranks=k, previous=previous, why="waited"
                    )
                log.info("%s waited %.1fs for %d devices: %d now", task.id, waited, previous, k)

    def _decide(
        self, task: TaskSpec, pending: dict[str, TaskSpec], now: float, journal: bool = True
    ) -> int:
        """Size `task` now (the Sizer's simulation) and give it that k."""
        sizing = self.sizer.size(task, *self._remaining(pending, now))
        set_ranks(task, sizing.k)
        self.sized_at[task.id] = now
        if journal:
            self._journal("task_sized", **sizing.journal_fields())
        log.info(
            "%s: %d rank(s), predicted end %s (%.0f ms)",
            task.id,
            sizing.k,
            ", ".join(f"k={k}: {s:.1f}s" for k, s in sizing.predicted.items()) or "-",
            1000 * sizing.cost_s,
        )
        return sizing.k

    def _free_ranks(self, task: TaskSpec) -> int:
        """The most ranks of `task`'s choices whose devices are free now (else its least)."""
        choices = self.sizer.ranks_of(task)
        fit = [
            c
            for c in choices
            if c < task.gpus
            and sum(
                self.scheduler._eligible(d, per_device(resized(task, c)))
                for d in self.scheduler.devices
            )
            >= c
        ]
        return max(fit or choices[:1])

    def _remaining(
        self, pending: dict[str, TaskSpec], now: float
    ) -> tuple[dict[str, TaskSpec], dict[str, float]]:
        """The unfinished tasks (running ones first) and the seconds left of the running ones."""
        running = {t.id: t for t in self.running.values()}
        left = {}
        for tid, t in running.items():
            expected = self.sizer.seconds(t)
            left[tid] = max(0.05 * expected, expected - (now - self.started.get(tid, now)))
        return {**running, **pending}, left

    def _learn(self, task: TaskSpec, result: dict, pending: dict[str, TaskSpec]) -> None:
        """A measured peak arrived: re-estimate the tasks that have not started yet."""
        if self.estimator is None or not self.estimator.observe(task, result):
            return
        for t in pending.values():
            refined = self.estimator.refine(t)
            if refined is not None and refined[0] != t.mem_mb:
                log.info(
                    "memory estimate of %s: %.2f -> %.2f GB (%s)",
                    t.id,
                    t.mem_mb / 1024,
                    refined[0] / 1024,
                    refined[1],
                )
                t.mem_mb, t.mem_source = refined

    def _handle(self, fut: Future, pending: dict[str, TaskSpec]) -> None:
        task = self.running.pop(fut)
        self.scheduler.release(task.id)
        outcome = fut.result()
        if self.grower is not None and self.grower.handle(self, task, outcome, pending):
            return  # stopped at a checkpoint to grow (or a failed resize): dispatched again
        if outcome.ok:
            self.done.add(task.id)
            self.summary.done.append(task.id)
            result = outcome.result or {}
            measured = {  # the stage's start-up, the worker's CPU seconds (host_share.py)
                k: result[k]
                for k in ("first_step_s", "cpu_s")
                if isinstance(result.get(k), (int, float))
            }
            self._journal(
                "task_done",
                task=task.id,
                wall_s=outcome.wall_s,
                worker_pid=outcome.worker_pid,
                **measured,
            )
            self.on_event("done", task, outcome)
            if self.sizer is not None:
                self.sizer.observe(task, outcome.wall_s, outcome.result or {})
            self._learn(task, outcome.result or {}, pending)
            return
        attempt = self.attempts[task.id]
        if (outcome.message or "").startswith(RUN_FILE_PREFIX):  # every task would fail so
            self._journal("task_failed", task=task.id, failure="error", message=outcome.message)
            raise RunFileError(outcome.message.removeprefix(RUN_FILE_PREFIX))
        self._journal(
            "task_failed",
            task=task.id,
            failure=outcome.failure,
            message=outcome.message,
            attempt=attempt,
            worker_pid=outcome.worker_pid,
        )
        if outcome.failure == NODE_LOST:  # not the task's fault: its retries stay
            self.nodes_lost[task.id] = self.nodes_lost.get(task.id, 0) + 1
            self._journal("task_retry", task=task.id, attempt=attempt + 1, why=NODE_LOST)
            self.on_event("retry", task, outcome)
            pending[task.id] = task
            self._drop_lost_devices(pending)
            self._fit_devices_left(task, self.executor.lost_nodes_line())
            return
        own = attempt - self.nodes_lost.get(task.id, 0)  # attempts that ended in its own faults
        if outcome.failure in RETRYABLE and own <= self.max_retries:
            if outcome.failure == "oom":
                task.batch_scale /= 2  # same effective batch, half the micro-batch
            self._journal(
                "task_retry", task=task.id, attempt=attempt + 1, batch_scale=task.batch_scale
            )
            self.on_event("retry", task, outcome)
            pending[task.id] = task
            return
        self.summary.failed[task.id] = f"{outcome.failure}: {outcome.message}"
        self.on_event("failed", task, outcome)
        self._skip_dependants(task.id, pending)


def simulate_remaining(
    tasks: dict[str, TaskSpec],
    scheduler: Scheduler,
    seconds: dict[str, float],
    running: frozenset[str] | set[str] = frozenset(),
) -> float:
    """Seconds until the last of `tasks` (those not finished yet) would finish, by the same
    event simulation as the dry run: dependencies on finished tasks are met, `running` tasks
    are placed first (they hold their devices now) with what is left of their `seconds`.
    An estimate for the ETA: placement of the real run may differ."""
    return simulate_window(tasks, scheduler, seconds, running)[1]


def simulate_window(
    tasks: dict[str, TaskSpec],
    scheduler: Scheduler,
    seconds: dict[str, float],
    first: frozenset[str] | set[str] | list[str] = frozenset(),
    resize: Callable[[TaskSpec, float, dict[str, float], Scheduler], tuple[TaskSpec, float] | None]
    | None = None,
    ends: dict[str, float] | None = None,
) -> tuple[dict[str, float], float]:
    """(start of each task, makespan) of `tasks` simulated from now: dependencies outside
    `tasks` are met, the ids in `first` are placed before the others (running tasks hold
    their devices). `resize(task, now, ends, scheduler)`, called as each task becomes ready,
    may return the task on other ranks (a copy: `tasks` is not changed) and its seconds,
    which the rest of the simulation uses (pita/core/elastic.py sizes the later elastic tasks
    so). `ends` (if given) receives each task's simulated end (its start + its seconds unless
    the host's cores are shared: `simulate`). No task is copied otherwise: a sizing decision
    simulates its window once per rank choice, hundreds of times in a big dry run."""
    plan = Plan(tasks=dict(tasks))
    starts: dict[str, float] = {}
    hook = None
    if resize is not None:

        def hook(task: TaskSpec, now: float, ends: dict[str, float], _: set[str]) -> None:
            new = resize(task, now, ends, scheduler)
            if new is not None:
                plan.tasks[task.id], seconds[task.id] = new

    _, makespan = simulate(
        plan,
        scheduler,
        lambda t: seconds[t.id],
        starts=starts,
        ends=ends,
        on_ready=hook,
        first=frozenset(first),
    )
    return starts, makespan


def fresh_scheduler(scheduler: Scheduler) -> Scheduler:
    """A copy of `scheduler`'s devices and packing rule with nothing running (for the ETA's
    simulation: memory as simulated devices, total minus the simulated reservations)."""
    return Scheduler(
        [DeviceState(d.index, d.total_mb, d.free_mb) for d in scheduler.devices],
        max_tasks_per_device=scheduler.max_tasks,
        priority=scheduler.priority,
        simulated_memory=True,
        host=scheduler.host,
    )
