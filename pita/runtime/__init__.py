"""The worker side of the flow: what runs inside one worker process.

rebuild config (`worker`) → `StageContext` (`context`: config, inputs, cached model
loader) → batch size (`batch_size`, `batching`: the probe for `auto`) → run the stage →
commit the task folder atomically (`worker.execute_task`); failures are classified
(`oom`) so the parent can retry by class. Torch is imported inside functions, never here.
"""
