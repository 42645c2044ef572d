"""The worker side of the flow: what runs inside one worker process.

rebuild config (`worker`) → `StageContext` (`context`: config, inputs, cached model
loader) → batch size (`batch_size`, `batching`: the probe for `auto`) → run the stage →
commit the task folder atomically (`worker.execute_task`); failures are classified
(`oom`) so the parent can retry by class. `kit` builds training objects (checkpointer,
tracker, precision, TRL arguments) from the context and `gang` runs a stage on every rank
of a DDP gang: `pita/training` itself takes plain values and knows no task. Torch is imported inside functions, never here.
"""
