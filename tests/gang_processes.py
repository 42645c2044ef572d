"""Processes for tests/test_ddp.py's launcher tests: `python -m tests.gang_processes MODE DIR`.

- `ports DIR`: launch 2 ranks that all-reduce and report the rendezvous port; print JSON.
- `hang DIR`: launch 2 ranks that write `rank<r>.pid` into DIR and sleep (a worker to SIGKILL).
- `value DIR STRATEGY`: tests/test_gang_training.py's value-training task on 2 ranks,
  checkpointing every 2 steps, in the run folder DIR (a task to SIGKILL mid-way).
- `startup_fault DIR`: launch 2 ranks (forked from this process) of which rank 1 dies
  before its process group forms, the first time only (a marker in DIR); print the notes
  the launcher logged and the ranks' results as JSON.
- `orchestrator DIR`: start a child `hang` process that dies with this one as a pool worker
  does (PR_SET_PDEATHSIG SIGTERM), write `worker.pid`, and wait (an orchestrator to SIGKILL).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path


def _ports(dist) -> dict:
    import torch
    import torch.distributed as tdist

    t = torch.ones(1) * (dist.rank + 1)
    tdist.all_reduce(t)
    return {"port": int(os.environ["MASTER_PORT"]), "sum": float(t)}


def _hang(dist, folder: str) -> None:
    Path(folder, f"rank{dist.rank}.pid").write_text(str(os.getpid()))
    time.sleep(600)


def _startup_fault(folder: str) -> None:
    """Rank 1's process exits inside its first init_process_group (the ranks fork from this
    process, so they run this wrapper): its peer's rendezvous fails for real."""
    import torch.distributed as tdist

    from pita.training.ddp import launch_ranks

    real = tdist.init_process_group

    def dies_once(*args, **kwargs):
        marker = Path(folder, "rank1-died")
        if os.environ.get("RANK") == "1" and not marker.exists():
            marker.write_text(str(os.getpid()))
            os._exit(1)
        return real(*args, **kwargs)

    tdist.init_process_group = dies_once
    notes: list[str] = []

    def on_message(kind, rank, payload):
        if kind == "log":
            notes.append(payload[1])

    out = launch_ranks(_ports, 2, device_type="cpu", start_method="fork", on_message=on_message)
    print(json.dumps({"notes": notes, "ranks": out}), flush=True)


def main(mode: str, folder: str) -> None:
    from pita.training.ddp import launch_ranks

    if mode == "ports":
        # forked ranks: what is tested is the ports, not the forkserver's warm-up (which
        # imports the training stack: most of this test's 28 s before)
        out = launch_ranks(_ports, 2, device_type="cpu", start_method="fork")
        print(json.dumps(out), flush=True)
    elif mode == "hang":
        launch_ranks(_hang, 2, args=(folder,), device_type="cpu")
    elif mode == "value":  # a 2-rank value-training task that checkpoints (to SIGKILL)
        from tests.test_gang_training import CHECKPOINTED, value_train_in

        value_train_in(Path(folder), sys.argv[3], 2, *CHECKPOINTED)
    elif mode == "startup_fault":
        _startup_fault(folder)
    elif mode == "orchestrator":
        code = (
            "from pita.runtime.worker import _die_with_parent; _die_with_parent(); "
            f"from tests.gang_processes import main; main('hang', {folder!r})"
        )
        worker = subprocess.Popen([sys.executable, "-c", code])
        Path(folder, "worker.pid").write_text(str(worker.pid))
        worker.wait()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
