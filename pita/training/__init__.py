"""The training stack every training stage shares (pretrain, value-model train, TRL trainers).

- `precision`: which dtype / autocast / GradScaler a task trains with (`choose_precision`),
  the matching TRL flags (`trl_precision_kwargs`) and the device `system.gpu_mode` picks.
- `loop`: a readable hand-written loop's parts: `accumulation_plan` (keep the effective
  batch), `TrainStep` (autocast, GradScaler, clipping, optimizer step, cache clearing,
  step timing), `compile_model`, `enable_gradient_checkpointing`, `dataloader_kwargs`.
- `report`: `training_metrics.png` and `performance_summary.txt` in the task folder
  (`trainer_metrics_callback` records a TRL / transformers Trainer for it).
- `ddp`: `training.parallel_strategy=data_parallel`, DDP over the task's gang
  (`run_data_parallel`, `run_stage`).

Importing this package imports no torch (the orchestrator may import it); the modules do.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "Precision": "precision",
    "choose_precision": "precision",
    "precision_for": "precision",
    "trl_precision_kwargs": "precision",
    "training_device": "precision",
    "accumulation_plan": "loop",
    "split_batch": "loop",
    "token_weights": "loop",
    "TrainStep": "loop",
    "StepResult": "loop",
    "TrainingMetrics": "loop",
    "CompileStatus": "loop",
    "compile_model": "loop",
    "enable_gradient_checkpointing": "loop",
    "dataloader_kwargs": "loop",
    "clear_cache": "loop",
    "write_training_report": "report",
    "trainer_metrics_callback": "report",
    "DistContext": "ddp",
    "run_data_parallel": "ddp",
    "run_stage": "ddp",
    "data_parallel_world_size": "ddp",
    "shard_indices": "ddp",
    "wrap_model": "ddp",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = importlib.import_module(f"pita.training.{_LAZY[name]}")
        return getattr(module, name)
    raise AttributeError(f"module 'pita.training' has no attribute {name!r}")
