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

Import the modules themselves (`from pita.training.loop import TrainStep`); this package
imports nothing, so importing it costs no torch.
"""
