"""`ParallelDataGenerator`: splits a stage's examples across the devices (the seed guide's name;
docs/guides/gpu_execution.txt).

Data generation (`collect`) and evaluation are sharded: the planner gives each shard a
contiguous fraction of the stage's prompts, weighted by device capacity, and prefers to
run shard i on device i. Each shard task then runs in its own worker, pinned to its GPU
with `CUDA_VISIBLE_DEVICES`, which rebuilds the config, loads the model on its GPU and
processes its part (`ctx.shard_slice(n)` in the stage); a `*_merge` task joins them.

What one shard runs — the batched roll-in / cut / roll-out of Q#, PITA and Q#-HF — is
algorithm code and lives in pita/algos/collector.py. This module is parent-side and
torch-free.
"""

from __future__ import annotations

from pita.core.gpu_manager import GPUManager

_RESOLUTION = 10_000  # fractions are exact to 1e-4 of the examples


class ParallelDataGenerator:
    """Splits examples over the devices of a `GPUManager`, in proportion to their capacity."""

    def __init__(self, gpu_manager: GPUManager):
        self.gpu = gpu_manager

    def split(self, n_examples: int, n_parts: int | None = None) -> list[tuple[int, int]]:
        """Contiguous [start, end) ranges covering every example once; part i is for device i."""
        return self.gpu.distribute_work(n_examples, n_parts)

    def shard_fractions(self, n_parts: int) -> list[tuple[float, float]]:
        """The same split as fractions of the examples (a plan is made before the stage
        knows how many examples it has)."""
        return [(a / _RESOLUTION, b / _RESOLUTION) for a, b in self.split(_RESOLUTION, n_parts)]
