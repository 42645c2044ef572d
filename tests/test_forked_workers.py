"""CPU and fake-device workers fork from a forkserver that imported torch once
(pita/core/forked_worker.py); CUDA workers and workers that import nothing up front start
as fresh processes. That a forked worker runs tasks, is retried after a SIGKILL and dies
with a SIGKILLed orchestrator: tests/test_faults.py (the `forked` case) and the kill tests
of tests/test_checkpoints.py, whose real stages run in forked workers."""

from __future__ import annotations

import os

from pita.core.forked_worker import PRELOAD, WORKER_MODULE, forks_workers


def test_only_preimporting_workers_off_cuda_fork():
    assert forks_workers("cpu", True) and forks_workers("fake", True)
    assert not forks_workers("cuda", True)  # CUDA_VISIBLE_DEVICES must hold from the start
    assert not forks_workers("cpu", False) and not forks_workers("fake", False)


def test_a_run_with_no_task_left_forks_from_no_forkserver(tmp_path):
    """A resume of a finished run (it only writes the report) starts no forkserver: it would
    import torch and transformers (5 s of CPU) for no worker."""
    from pita.experiment.cli import compose_config
    from pita.experiment.run import make_executor, make_gpu_manager

    assert not forks_workers("fake", True, pending=0) and forks_workers("fake", True, pending=1)
    cfg = compose_config(["system.devices=fake:1"])
    pool = make_executor(cfg, make_gpu_manager(cfg), tmp_path, pending=0)
    try:
        assert pool.fork_workers is False  # type: ignore[attr-defined]
    finally:
        pool.shutdown()


def test_the_forkserver_preloads_the_worker_and_what_gang_ranks_fork_with():
    """One list for both, and really imported: a child forked from the forkserver a gang's
    ranks fork from (pita.training.ddp.warm_forkserver, the pool's starter) holds every
    `PRELOAD` module, the worker's included, before it imports anything itself. Run in a
    fresh interpreter, so this test process's own imports and forkserver do not count."""
    import json
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


_TWO_FORKED = """
import json, multiprocessing, os, sys
from pita.core.forked_worker import start_forked_worker
ctx = multiprocessing.get_context("forkserver")
ctx.set_forkserver_preload(["numpy", "torch", "random", "tests.forked_draws"])
out = sys.argv[1]
workers = [
    start_forked_worker([f"{out}/{i}.json"], dict(os.environ), os.getcwd(), None, b"k",
                        module="tests.forked_draws")
    for i in range(2)
]
sys.exit(max(w.wait(60) for w in workers))
"""


def test_two_forked_workers_draw_different_streams(tmp_path):
    """Two workers forked from one forkserver (which imported numpy and torch, so each child
    starts with its generator states) draw different numbers from Python's, numpy's and
    torch's global generators (pita.core.forked_worker.reseed_globals); before, all three
    streams were the same in every worker."""
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT, pythonpath_with_root

    env = {**os.environ, "PYTHONPATH": pythonpath_with_root()}
    proc = subprocess.run(
        [sys.executable, "-c", _TWO_FORKED, str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    a, b = (json.loads((tmp_path / f"{i}.json").read_text()) for i in range(2))
    for generator in ("python", "numpy", "torch"):
        assert a[generator] != b[generator], generator


def test_each_task_seeds_the_global_generators_from_its_id():
    """Per task: the same task id draws the same stream on any worker (a retry, in-process),
    two tasks draw different ones (pita.runtime.worker.seed_task_globals)."""
    import random

    import numpy
    import torch

    from pita.runtime.worker import seed_task_globals
    from tests.conftest import task_spec

    cfg = {"experiment": {"seed": 3}}

    def draws(task_id: str) -> tuple:
        seed_task_globals(cfg, task_spec(task_id))
        return random.random(), float(numpy.random.rand()), float(torch.rand(1))

    first, other = draws("QSharp.a.b.r0.train"), draws("DPO.a.b.r0.train")
    again = draws("QSharp.a.b.r0.train")
    assert first == again
    assert all(x != y for x, y in zip(first, other))


def test_a_trl_gangs_ranks_fork_with_its_trainer_imported():
    """The run names its gang tasks' stage modules (PITA_GANG_STAGES); a worker's forkserver
    preloads them and their WARM_IMPORTS, so a DPO gang's ranks fork with TRL's DPO trainer
    imported instead of importing it each (15-19 s to the first step without)."""
    from pita.core.dag import Plan
    from pita.core.forked_worker import gang_preload
    from pita.experiment.run import stage_modules
    from tests.conftest import task_spec

    plan = Plan()
    plan.add(task_spec("dpo.train", algo="DPO", fn="pita.algos.dpo:train", gpus=2))
    plan.add(task_spec("dpo.collect", algo="DPO", stage="collect", fn="pita.algos.dpo:collect"))
    plan.add(task_spec("eval", stage="evaluate", fn="pita.stages.evaluate:evaluate"))
    modules = stage_modules(plan, set(), gangs_only=True)
    assert modules == "pita.algos.dpo"  # only a gang's stage: one-device tasks add nothing
    assert gang_preload(modules) == ["pita.algos.dpo", "trl.trainer.dpo_trainer"]
    assert stage_modules(plan, {"dpo.train"}, gangs_only=True) == ""  # done: nothing to preload
    assert gang_preload("pita.no_such_module") == []  # a head start only: never an error


def test_a_stage_reports_its_first_step():
    """dispatch -> first optimizer step: the first `step n/N` line a stage reports (a gang's
    rank 0 forwards its own), not a generation's `prompts` line."""
    from pita.runtime.worker import FirstStep

    seen: list[str] = []
    first = FirstStep(0.0, seen.append)
    first.heartbeat("prompts 3/10 sampling")
    assert first.seconds is None
    first.heartbeat("step 1/104 loss=0.71")
    at = first.seconds
    first.heartbeat("step 6/104 loss=0.70")
    assert at is not None and first.seconds == at
    assert seen == ["prompts 3/10 sampling", "step 1/104 loss=0.71", "step 6/104 loss=0.70"]
