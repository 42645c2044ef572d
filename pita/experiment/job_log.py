"""The Hydra job's `run.log` handler (conf/hydra/job_logging/pita.yaml), which takes the
run folder's lock before the job writes anything there.

Hydra's `run_job` creates a job's folder, configures job logging, and only then writes
`.hydra/` and calls pita's `run()`. A single local run is locked by the command line before
Hydra starts (pita/experiment/cli.py); a multirun's jobs (and a remote launcher's, in their
own processes) get their folders from Hydra one at a time. Opening `run.log` is the first
thing Hydra does in a job's folder, so this handler locks the folder first (`RunLock`,
shared with the `run()` it nests in, which checks the folder's owner and mode with the job's
config) and holds the lock until logging is configured again (the next job) or the process
ends. A folder in use is one line and exit 2, before `.hydra/` is written
(`tests/test_run_lock.py::test_multirun_job_takes_the_lock_before_hydra_writes_its_folder`).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path


class LockedRunLog(logging.FileHandler):
    """A `FileHandler` on `<run>/run.log` that holds `<run>/.lock` while it is open."""

    def __init__(self, filename: str, mode: str = "a", encoding: str | None = None) -> None:
        from pita.core.errors import ConfigError
        from pita.core.run_lock import RunLock

        try:
            self.run_lock: RunLock | None = RunLock(Path(filename).parent).acquire(share=True)
        except ConfigError as exc:
            for line in exc.messages:
                print(f"error: {line}", file=sys.stderr)
            raise SystemExit(2) from None  # not an Exception: logging.config lets it through
        super().__init__(filename, mode=mode, encoding=encoding)

    def close(self) -> None:
        super().close()
        # not `self.lock`: logging.Handler keeps its own thread lock under that name
        lock, self.run_lock = getattr(self, "run_lock", None), None
        if lock is not None:
            lock.release()
