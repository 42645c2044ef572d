#!/usr/bin/env python
"""Run a pita experiment on every device of this machine.

    python run_parallel.py                                  # default: goal-walk, CPU is enough
    python run_parallel.py experiment=star_graph system.devices=fake:4
    python run_parallel.py dry_run=true                     # print the task DAG, start nothing
    python run_parallel.py resume_from=outputs/<name>/<timestamp>

Exit codes: 0 all tasks succeeded, 1 some failed, 2 bad config, 130 interrupted.
A Hydra app (@hydra.main in pita/experiment/cli.py): -m, -cn, --config-dir, --cfg job,
tab completion with `eval "$(python run_parallel.py -sc install=bash)"`, --help.
"""

from pita.experiment.cli import main

if __name__ == "__main__":
    main()
