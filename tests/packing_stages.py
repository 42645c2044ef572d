"""Stages for the packing tests: they report what the worker was given (threads, env)."""

from __future__ import annotations

import os
import time

from pita.runtime.context import StageContext, write_stand_in_outputs


def threads_stage(ctx: StageContext) -> dict:
    """Report the torch thread count and the budget env the pool started this worker with."""
    import torch

    time.sleep(float(os.environ.get("PITA_TEST_SLEEP", "0.3")))
    write_stand_in_outputs(ctx)
    return {
        "torch_threads": torch.get_num_threads(),
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "dataloader_workers": os.environ.get("PITA_DATALOADER_WORKERS"),
        "pid": os.getpid(),
    }
