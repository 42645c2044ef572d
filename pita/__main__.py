"""`python -m pita ...`: the same command line as run_parallel.py (and the `pita` command)."""

from pita.experiment.cli import main

if __name__ == "__main__":
    main()
