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
    """One list for both: a worker's gang forks its ranks from a forkserver started the
    same way, with the same modules (pita.training.ddp.warm_forkserver)."""
    from pita.core.forked_worker import start_forkserver
    from pita.training import ddp

    assert WORKER_MODULE in PRELOAD and "torch" in PRELOAD
    assert ddp.start_forkserver is start_forkserver
