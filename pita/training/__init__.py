"""The training stack every training stage shares (pretrain, value-model train, TRL trainers).

- `precision`: which dtype / autocast / GradScaler a task trains with (`choose_precision`),
  the matching TRL flags (`trl_precision_kwargs`) and the device `system.gpu_mode` picks.
- `loop`: a readable hand-written loop's parts: `accumulation_plan` (keep the effective
  batch), `TrainStep` (autocast, GradScaler, clipping, optimizer step, cache clearing,
  step timing), `compile_model`, `enable_gradient_checkpointing`, `dataloader_kwargs`.
- `report`: `training_metrics.png` and `performance_summary.txt` in the task folder
  (`trainer_metrics_callback` records a TRL / transformers Trainer for it).
- `ddp`: `training.parallel_strategy=data_parallel | fsdp`: k local ranks through torch's elastic_launch
  (`launch_ranks`, `apply_gang`: DDP or FSDP2, `FullState` for checkpoints).
- `checkpoint`: in-task checkpoints in a folder (`Checkpointer`, the TRL Trainer's).
- `tracking`: the `logger` group's backends (`open_tracker`, `trl_callback`).

These modules take values (a model, a folder, a logger config, a run dir, a name, a
`training.*` settings instance, a `CheckpointPlan`) and know no task: a stage unpacks its
context into those values (`pita/runtime/kit.py`: the checkpoint plan, the tracker); the
per-rank DDP glue is `pita/runtime/gang.py` (the layer test keeps training below runtime).

Import the modules themselves (`from pita.training.loop import TrainStep`); this package
imports nothing, so importing it costs no torch.
"""
