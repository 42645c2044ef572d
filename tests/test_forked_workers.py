"""CPU and fake-device workers fork from a forkserver that imported torch once
(pita/core/forked_worker.py); CUDA workers and workers that import nothing up front start
as fresh processes. That a forked worker runs tasks, is retried after a SIGKILL and dies
with a SIGKILLed orchestrator: tests/test_faults.py (the `forked` case) and the kill tests
of tests/test_checkpoints.py, whose real stages run in forked workers."""

from __future__ import annotations

from pita.core.forked_worker import PRELOAD, WORKER_MODULE, forks_workers


def test_only_preimporting_workers_off_cuda_fork():
    assert forks_workers("cpu", True) and forks_workers("fake", True)
    assert not forks_workers("cuda", True)  # CUDA_VISIBLE_DEVICES must hold from the start
    assert not forks_workers("cpu", False) and not forks_workers("fake", False)


def test_the_forkserver_preloads_the_worker_and_what_gang_ranks_fork_with():
    """One list for both, and really imported: a child forked from the forkserver a gang's
    ranks fork from (pita.training.ddp.warm_forkserver, the pool's starter) holds every
    `PRELOAD` module, the worker's included, before it imports anything itself. Run in a
    fresh interpreter, so this test process's own imports and forkserver do not count."""
    import json
    import os
    import subprocess
    import sys

    from pita.core.forked_worker import start_forkserver
    from pita.training import ddp
    from tests.conftest import ROOT, pythonpath_with_root

    assert ddp.start_forkserver is start_forkserver  # the pool and the gangs: one starter
    assert WORKER_MODULE in PRELOAD and "torch" in PRELOAD
    probe = (
        "import json, multiprocessing as mp, xml.dom.minidom\n"
        "from pita.core.forked_worker import PRELOAD\n"
        "from pita.training.ddp import warm_forkserver\n"
        "from tests.forkserver_probe import loaded\n"
        "if __name__ == '__main__':\n"
        "    warm_forkserver()\n"
        "    with mp.get_context('forkserver').Pool(1) as pool:\n"
        "        print(json.dumps(pool.apply(loaded, (['xml.dom.minidom', *PRELOAD],))))\n"
    )
    env = {**os.environ, "PYTHONPATH": pythonpath_with_root()}
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    held = json.loads(out.stdout.strip().splitlines()[-1])
    # every preloaded module; not what only the starting process imported (the child is a
    # fork of the server, not of it: what the check sees comes from the server)
    assert held == list(PRELOAD)
