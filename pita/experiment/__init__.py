"""The parent side of the flow, from the command line to the results table.

validate (`config`: schema + checks, exit 2) → plan (`plan`: chains × rounds × stages as
a task DAG) → run (`run`: devices, scheduler, executor, journal, monitor from pita.core)
→ report (`report`: summary.csv/md and plots). `cli` is the Hydra entry point of
run_parallel.py. Nothing here imports torch.
"""
