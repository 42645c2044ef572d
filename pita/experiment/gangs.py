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
GRPO-HF / the reward model) on CPU or `fake:` devices runs DDP under `fsdp` (`task.strategy`
says "ddp", the dry run and the task's log say so in one line), and a TRL task that only
FSDP could fit is refused. pita's own loops (value trainer, pretrain) shard on CPU with gloo.

A TRL task's gang is the largest (or, when too large for one device, the smallest fitting)
number of ranks that divides its `algos.<NAME>.batch_size`: every rank takes an equal share,
so the global batch does not depend on k.

The decision is stored on the task (`gpus`, `strategy`, `mem_mb` = the gang's total, i.e.
per-rank × k, which the scheduler divides back per device).

Under `data_parallel` the training stages are elastic instead (pita/experiment/plan.py
`Planner.elastic_ranks`, pita/core/elastic.py): planned on one device, their k chosen at
dispatch among `task.ranks`, which this module trims to the k whose ranks fit and share the
batch. A task too large for one device keeps the smallest FSDP gang that fits as its least
k (and may be given more at dispatch).
"""

from __future__ import annotations

from typing import Any

from pita.core.errors import ConfigError
from pita.core.tasks import TASK_STRATEGIES

TRAINING_STAGES = ("pretrain", "reward_model", "train")
# The stage functions that train with a TRL Trainer (accelerate's processes on a gang).
TRL_MODULES = ("pita.algos.dpo", "pita.algos.grpo", "pita.algos.reward_model")
# `training.parallel_strategy` -> TaskSpec.strategy (the inverse of TASK_STRATEGIES)
STRATEGY_OF_KEY = {"none": "none", **{key: task for task, key in TASK_STRATEGIES.items()}}
GB = 1024.0


def is_training(task: Any) -> bool:
    return task.stage in TRAINING_STAGES


def is_trl(task: Any) -> bool:
    """A training task whose stage is a TRL Trainer (its ranks are accelerate's processes)."""
    return is_training(task) and task.fn.partition(":")[0] in TRL_MODULES


def computes_on_cpu(device_kind: str) -> bool:
    """CPU slots, and `fake:` GPUs (workers compute on the CPU): no NCCL, no TRL FSDP."""
    return device_kind in ("cpu", "fake")


def ran_strategy(task: Any, key: str, device_kind: str) -> str:
    """The strategy a training task of a gang runs with under `training.parallel_strategy=key`:
    "ddp" for a TRL stage under fsdp on CPU (accelerate cannot shard there)."""
    strategy = STRATEGY_OF_KEY[key]
    if strategy == "fsdp" and is_trl(task) and computes_on_cpu(device_kind):
        return "ddp"
    return strategy


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

    def __call__(self, strategy: str, k: int) -> int:
        if self.memory is not None:
            return self.memory.per_rank_mb(strategy, k)
        mb = self.task.mem_mb
        return -(-mb // k) if strategy == "fsdp" else mb


def _elastic_ranks(task: Any, cfg: Any, per_rank: _PerRank, best: list[int]) -> list[int]:
    """The rank counts an elastic task may be given at dispatch: those of `task.ranks` whose
    DDP ranks each fit a device of the k largest and that share a TRL stage's batch (one
    count left: not elastic)."""
    ranks = [
        k
        for k in task.ranks
        if k <= len(best)
        and per_rank("ddp" if k > 1 else "none", k) <= best[k - 1]
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


def size_training_gangs(
    plan: Any, cfg: Any, device_mb: list[int], device_kind: str, largest_gang: int | None = None
) -> None:
    """Set `gpus`, `strategy` and `mem_mb` of every training task of `plan` (see the module
    docstring); no gang is larger than `largest_gang` (a Ray cluster's largest node). Raises
    ConfigError when a task fits no gang of this run."""
    from pita.experiment.estimates import ModelSizes, _plain, training_memory

    key = str(cfg.training.parallel_strategy)
    plain = _plain(cfg)
    sizes = ModelSizes()
    # a gang of k gets the k largest devices at best (on one node: a Ray task never spans two)
    best = sorted(device_mb, reverse=True)[: largest_gang or None]
    for t in plan.tasks.values():
        if not is_training(t):
            continue
        analytic = t.mem_source.startswith("size:")
        per_rank = _PerRank(t, training_memory(t, plain, sizes) if analytic else None)
        if t.ranks:  # elastic (data_parallel): the k its batch and the devices allow
            t.ranks = _elastic_ranks(t, plain, per_rank, best)
        strategy = ran_strategy(t, key, device_kind) if t.gpus > 1 else "none"
        while not _shares_batch(t, plain, t.gpus):  # the largest gang that shares the batch
            t.gpus -= 1
        strategy = strategy if t.gpus > 1 else "none"
        need = per_rank(strategy, t.gpus)
        if need <= best[min(t.gpus, len(best)) - 1]:
            t.strategy, t.mem_mb = strategy, need * t.gpus
            continue
        one = per_rank("none", 1)
        if is_trl(t) and computes_on_cpu(device_kind):  # only FSDP could fit it: not on CPU
            ddp = per_rank("ddp", len(best))
            raise ConfigError(
                _refusal(
                    t,
                    one,
                    device_kind,
                    len(best),
                    ddp,
                    "runs a TRL stage with DDP (accelerate has no FSDP on CPU) and needs",
                )
            )
        for k in range(2, len(best) + 1):
            if per_rank("fsdp", k) <= best[k - 1] and _shares_batch(t, plain, k):
                t.gpus, t.strategy, t.mem_mb = k, "fsdp", per_rank("fsdp", k) * k
                t.mem_source += f"; too large for one device: FSDP over {k}"
                # elastic: sized at dispatch from this gang up (FSDP: the states divide by k)
                larger = [r for r in t.ranks if r > k and per_rank("fsdp", r) <= best[r - 1]]
                t.ranks = [k, *larger] if larger else []
                break
        else:
            raise ConfigError(
                _refusal(
                    t,
                    one,
                    device_kind,
                    len(best),
                    per_rank("fsdp", len(best)),
                    "under FSDP, still needs",
                )
            )
