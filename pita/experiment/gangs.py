"""Gangs of training tasks: how many devices a training task gets and how its ranks share them.

`training.parallel_strategy` says how a training stage (pretrain, the proxy reward model, a
round's train) uses several devices: `data_parallel` (DDP: every rank holds the whole model,
optimizer state included, and takes 1/k of the batch) or `fsdp` (FSDP2: parameters, gradients
and optimizer state sharded over the ranks). Under `fsdp` a training task gets a gang of
every device of the run, one rank per device; under `data_parallel` its k is chosen at
dispatch (below); under `none` it gets one device. The default `auto` is one of those by
the time a plan is built (pita/experiment/strategy.py: data_parallel on several CUDA GPUs,
none on CPU and `fake:` devices).

Whatever the key says, a training task whose estimate does not fit one device gets the
smallest FSDP gang that fits (`pita.experiment.estimates.TrainingMemory.per_rank_mb`), and a
task no gang of this run can hold is refused before anything starts: one line naming the
task, its estimate, the largest gang and the strategy (exit 2).

What CPU cannot do: accelerate has no FSDP off CUDA, so a TRL stage (DPO / RPO / GRPO /
GRPO-HF / the reward model: the registry rows' `trl_stages`) on CPU or `fake:` devices runs
DDP under `fsdp` (its gang says DDP, asked FSDP; the dry run and the task's log say so in one
line), and a TRL task that only FSDP could fit is refused. pita's own loops (value trainer, pretrain) shard on CPU with gloo.

A TRL task's gang is the largest (or, when too large for one device, the smallest fitting)
number of ranks that divides its `algos.<NAME>.batch_size`: every rank takes an equal share,
so the global batch does not depend on k.

The decision is stored on the task (its `Gang`, pita/core/parallel.py, and `mem_mb` = the
gang's total, i.e. per-rank × k, which the scheduler divides back per device).

Under `data_parallel` the training stages are elastic instead (pita/experiment/plan.py
`Planner.elastic_ranks`, pita/core/elastic.py): planned on one device, their k chosen at
dispatch among `task.ranks`, which this module trims to the k whose ranks fit and share the
batch. A task too large for one device keeps the smallest FSDP gang that fits as its least
k (and may be given more at dispatch).
"""

from __future__ import annotations

from typing import Any

from pita.algos.registry import runs_trl
from pita.core.errors import ConfigError
from pita.core.parallel import Gang, Strategy

TRAINING_STAGES = ("pretrain", "reward_model", "train")
GB = 1024.0


def is_training(task: Any) -> bool:
    return task.stage in TRAINING_STAGES


def is_trl(task: Any) -> bool:
    """A training task whose stage is a TRL Trainer (its ranks are accelerate's processes):
    its registry row's `trl_stages`."""
    return is_training(task) and runs_trl(task.algo, task.stage, task.fn)


def computes_on_cpu(device_kind: str) -> bool:
    """CPU slots, and `fake:` GPUs (workers compute on the CPU): no NCCL, no TRL FSDP."""
    return device_kind in ("cpu", "fake")


def _shares_batch(task: Any, cfg: Any, k: int) -> bool:
    """Whether k ranks can each take an equal share of a TRL task's `algos.<NAME>.batch_size`
    (the global batch does not depend on k; pita's own loops pad a rank's share instead)."""
    if k <= 1 or not is_trl(task):
        return True
    batch = ((cfg.get("algos") or {}).get(task.algo) or {}).get("batch_size")
    return not isinstance(batch, int) or batch % k == 0


class _PerRank:
    """Per-rank MB of a task under (strategy, k): the analytic split when the estimate came
    from the checkpoint's size, else the estimate assumed to divide evenly under FSDP."""

    def __init__(self, task: Any, memory: Any):
        self.task, self.memory = task, memory

    def __call__(self, strategy: Strategy, k: int) -> int:
        if self.memory is not None:
            return self.memory.per_rank_mb(strategy, k)
        mb = self.task.mem_mb
        return -(-mb // k) if strategy is Strategy.FSDP else mb


def _elastic_ranks(task: Any, cfg: Any, per_rank: _PerRank, best: list[int]) -> list[int]:
    """The rank counts an elastic task may be given at dispatch: those of `task.ranks` whose
    DDP ranks each fit a device of the k largest and that share a TRL stage's batch (one
    count left: not elastic)."""
    ranks = [
        k
        for k in task.ranks
        if k <= len(best)
        and per_rank(Gang(Strategy.DDP, k).runs, k) <= best[k - 1]
        and _shares_batch(task, cfg, k)
    ]
    return ranks if len(ranks) > 1 else []


def _refusal(task: Any, one_mb: int, kind: str, largest: int, per_rank: int, why: str) -> str:
    lora = f" or a LoRA adapter (algos.{task.algo}.peft)" if task.stage != "pretrain" else ""
    return (
        f"training.parallel_strategy: task {task.id} needs ~{one_mb / GB:.1f} GB to train on one "
        f"device ({task.mem_source}); the largest gang, {largest} {kind} device(s), {why} "
        f"~{per_rank / GB:.1f} GB per rank; add devices or train a smaller model{lora}"
    )


def planned_gang(task: Any, cfg: Any, device_kind: str) -> Gang:
    """The planner's gang of a training task, where it can run: a TRL stage under FSDP on
    CPU runs DDP (accelerate cannot shard there), and the gang shrinks to the largest k
    that shares a TRL stage's batch."""
    gang = task.gang
    if gang.strategy is Strategy.FSDP and is_trl(task) and computes_on_cpu(device_kind):
        gang = Gang(Strategy.DDP, gang.world, gang.nodes, asked=Strategy.FSDP)
    world = gang.world
    while gang.ranked and not _shares_batch(task, cfg, world):
        world -= 1
    return gang.resized(world)


def _forced_fsdp(t: Any, cfg: Any, per_rank: _PerRank, best: list[int], kind: str) -> None:
    """A task too large for its planned gang: the smallest FSDP gang that fits (from which
    an elastic task may be given more at dispatch), else one line (ConfigError)."""
    one = per_rank(Strategy.NONE, 1)
    if is_trl(t) and computes_on_cpu(kind):  # only FSDP could fit it: not on CPU
        ddp = per_rank(Strategy.DDP, len(best))
        why = "runs a TRL stage with DDP (accelerate has no FSDP on CPU) and needs"
        raise ConfigError(_refusal(t, one, kind, len(best), ddp, why))
    for k in range(2, len(best) + 1):
        if per_rank(Strategy.FSDP, k) <= best[k - 1] and _shares_batch(t, cfg, k):
            asked = t.gang.asked or t.gang.strategy
            t.set_gang(Gang(Strategy.FSDP, k, t.gang.nodes, asked=asked))
            t.mem_mb = per_rank(Strategy.FSDP, k) * k
            t.mem_source += f"; too large for one device: FSDP over {k}"
            # elastic: sized at dispatch from this gang up (FSDP: the states divide by k)
            larger = [r for r in t.ranks if r > k and per_rank(Strategy.FSDP, r) <= best[r - 1]]
            t.ranks = [k, *larger] if larger else []
            return
    fsdp = per_rank(Strategy.FSDP, len(best))
    raise ConfigError(_refusal(t, one, kind, len(best), fsdp, "under FSDP, still needs"))


def size_training_gangs(
    plan: Any, cfg: Any, device_mb: list[int], device_kind: str, largest_gang: int | None = None
) -> None:
    """Set the gang (`TaskSpec.set_gang`) and `mem_mb` of every training task of `plan`
    (see the module docstring), from the gang the planner gave it; no gang is larger than
    `largest_gang` (the most devices a task may hold). Raises ConfigError when a task fits no
    gang of this run."""
    from pita.experiment.estimates import ModelSizes, _plain, training_memory

    plain = _plain(cfg)
    sizes = ModelSizes()
    # a gang of k gets the k largest devices at best
    best = sorted(device_mb, reverse=True)[: largest_gang or None]
    for t in plan.tasks.values():
        if not is_training(t):
            continue
        analytic = t.mem_source.startswith("size:")
        per_rank = _PerRank(t, training_memory(t, plain, sizes) if analytic else None)
        if t.ranks:  # elastic (data_parallel): the k its batch and the devices allow
            t.ranks = _elastic_ranks(t, plain, per_rank, best)
        gang = planned_gang(t, plain, device_kind)
        k = gang.world if gang.ranked else t.gpus  # one process over k devices: each holds it
        need = per_rank(gang.runs, k)
        if need <= best[min(k, len(best)) - 1]:
            t.set_gang(gang)
            t.mem_mb = need * k
            continue
        _forced_fsdp(t, plain, per_rank, best, device_kind)
