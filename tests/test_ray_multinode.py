"""executor=ray beyond one node (issue 41), on a simulated cluster as Ray's own tests do
(`ray.cluster_utils.Cluster`: a head with no CPUs, worker nodes of 2 CPUs each, every slot
a CPU, gloo between the ranks). Each test starts and stops its own cluster (20-30 s of a
busy 2-core machine); only the cheapest runs in the default suite."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.conftest import journal, only, run_cli, run_cli_later, session_lock, sleep_overrides

ray = pytest.importorskip("ray")

# A removed node is reported dead within ~2 s instead of Ray's default ~15-30 s.
FAST_HEALTH = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 500,
    "health_check_failure_threshold": 3,
}


@contextmanager
def simulated_cluster(nodes: int, env: dict | None = None, **node_args) -> Iterator:
    """A head without CPUs and `nodes` worker nodes of 2 CPUs (`env`: the raylets'
    environment, inherited by their workers); shut down whatever happens. One Ray cluster
    on the machine at a time (`auto` would find another test's). No token authentication:
    Ray >= 2.52 writes ~/.ray/auth_token on a local `ray.init()`, and a driver that found
    it would ask this token-less cluster for tokens (the CLI runs inherit the setting)."""
    from ray.cluster_utils import Cluster

    saved = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    _reread_ray_config()  # a local Ray earlier in this process left token mode cached
    with session_lock("ray"):
        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 0,
                "include_dashboard": False,
                "_system_config": FAST_HEALTH,
            },
        )
        try:
            for _ in range(nodes):
                cluster.add_node(num_cpus=2, env_vars=env, **node_args)
            cluster.wait_for_nodes()
            yield cluster
        finally:
            if ray.is_initialized():
                ray.shutdown()
            cluster.shutdown()
            if saved is None:
                os.environ.pop("RAY_AUTH_MODE", None)
            else:
                os.environ["RAY_AUTH_MODE"] = saved
            _reread_ray_config()


def _reread_ray_config() -> None:
    """Ray caches its config (the auth mode among it) and its token per process: read
    them again."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def _ray_args(cluster, *more: str) -> list[str]:
    return [
        "executor=ray",
        f"executor.ray_address={cluster.address}",
        "executor.progress=false",
        *more,
    ]


def test_slots_ray_cannot_place_are_one_line_within_the_deadline(tmp_path):
    """Another job holds one of the cluster's 2 CPUs: the run's reservation of every slot
    cannot be placed, and after executor.ray_placement_timeout_s the command says what it
    asked per bundle and what the node offers (exit 2), instead of waiting forever."""
    with simulated_cluster(1) as cluster:
        ray.init(address=cluster.address, log_to_driver=False)
        holder = ray.remote(num_cpus=1)(_Holder).remote()
        ray.get(holder.ready.remote())
        done = run_cli(
            _ray_args(cluster, "executor.ray_placement_timeout_s=3", *only("reference")),
            cwd=tmp_path,
            timeout=240,
        )
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr[-2000:]
    assert lines[0].startswith(
        "error: executor.ray_placement_timeout_s=3: Ray could not place 2 bundle(s) of "
        "{CPU 1, memory: not asked} (one per device slot) within 3 s; the cluster offers node "
    ), lines[0]
    assert "CPU 2, GPU 0" in lines[0] and "(free now: CPU 1, GPU 0)" in lines[0]


class _Holder:
    """Another job's actor, holding a CPU of the cluster."""

    def ready(self) -> bool:
        return True


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.cluster
def test_a_four_rank_fsdp_gang_over_two_nodes_matches_one_process(tmp_path):
    """Issue 41 item 1: pretrain on 4 FSDP ranks, 2 on each of 2 nodes (one rank actor per
    slot, c10d on rank 0's node), matches one process: loss curve and weights within 1e-5."""
    from omegaconf import OmegaConf

    from pita.core.ray_executor import RayExecutor
    from pita.runtime.ray_slot import SlotWorker
    from pita.runtime.worker import run_task_here
    from pita.stages.pretrain import pretrain
    from tests.test_gang_training import PRETRAIN, TOL, _context, _losses, _plan, _weights

    single, _ = _context(tmp_path / "single", "none", PRETRAIN, 1, "out")
    pretrain(single)
    cfg, plan = _plan("fsdp")
    task = plan.tasks[PRETRAIN]
    task.gpus, task.strategy = 4, "fsdp"
    run_dir = tmp_path / "gang"
    with simulated_cluster(2) as cluster:
        ray.init(address=cluster.address, log_to_driver=False)
        ex = RayExecutor(
            OmegaConf.create({"ray_address": cluster.address}), run_task_here, SlotWorker
        )
        ex.prepare(run_dir)
        nodes = ex.nodes_of([0, 1, 2, 3])
        cfg_dict = OmegaConf.to_container(cfg, resolve=True)
        outcome = ex.submit(task, [0, 1, 2, 3], cfg_dict, run_dir).result(timeout=600)
        ex.release()
    assert outcome.ok, outcome.message
    assert len(set(nodes)) == 2 and nodes[0] == nodes[1] and nodes[2] == nodes[3]
    assert outcome.result["effective_batch"] == 16
    folder = run_dir / "tasks" / PRETRAIN
    gang_losses = _csv_losses(run_dir, PRETRAIN)
    curve = _losses(single)
    assert len(curve) >= 2 and gang_losses == pytest.approx(curve, abs=TOL)
    a, b = (
        _weights(single.out_dir / "model/model.safetensors"),
        _weights(folder / "model/model.safetensors"),
    )
    assert a.keys() == b.keys()
    moved = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert moved <= TOL, f"4 ranks on 2 nodes differ from one process by {moved}"


def _csv_losses(run_dir: Path, task_id: str) -> list[float]:
    import csv

    [path] = (run_dir / "logs").rglob(f"{task_id}.csv")
    with open(path, newline="") as f:
        return [float(r["train/loss"]) for r in csv.DictReader(f)]


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.3)
    pytest.fail(f"{what} within {timeout:.0f} s")


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.cluster
def test_a_node_removed_while_its_task_runs(tmp_path):
    """Issue 41 item 4: the node under a running task dies (its raylet and workers killed);
    the task fails as `node_lost` (its own retries untouched: executor.max_retries=0), runs
    again on the node left, and the run ends exit 0 with every task done once."""
    slow = "QSharp.goal_walk.tiny.r0.collect.s01"
    markers = tmp_path / "markers"
    markers.mkdir()
    env = {"PITA_TEST_MARKERS": str(markers), "PITA_TEST_SLOW_TASK": slow, "PITA_TEST_SLOW_S": "6"}
    with simulated_cluster(2, env=env) as cluster:
        args = _ray_args(
            cluster,
            "experiment.name=lost",
            "executor.max_retries=0",
            *only("reference", "QSharp"),
            *sleep_overrides(),
        )
        run = run_cli_later(args, cwd=tmp_path, timeout=400)
        run_dir = _wait_for(
            lambda: next((tmp_path / "outputs" / "lost").glob("*/journal.jsonl"), None),
            180,
            "no journal",
        ).parent
        started = _wait_for(lambda: _running(run_dir, slow), 180, f"{slow} did not start")
        node = next(n for n in cluster.worker_nodes if n.node_id == started["nodes"][0])
        cluster.remove_node(node, allow_graceful=False)
        done = run.result()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    events = journal(run_dir)
    failed = [e for e in events if e["event"] == "task_failed"]
    assert failed and {e["failure"] for e in failed} == {"node_lost"}
    assert any(e["task"] == slow for e in failed)
    lost = [e for e in events if e["event"] == "node_lost"]
    assert lost and lost[0]["nodes"].startswith(started["nodes"][0][:8])
    runs = [e for e in events if e["event"] == "task_running" and e["task"] == slow]
    assert len(runs) == 2 and runs[1]["nodes"][0] != started["nodes"][0]
    done_ids = [e["task"] for e in events if e["event"] == "task_done"]
    assert len(done_ids) == len(set(done_ids)) == 17
    log = (run_dir / "run.log").read_text()
    assert f"Ray node(s) {started['nodes'][0][:8]}" in log and "lost" in log
    assert f"start {slow} on CPU {started['devices'][0]} @ {started['nodes'][0][:8]}" in log
    assert f"@ {started['nodes'][0][:8]}" in (run_dir / "results" / "time.md").read_text()


def _running(run_dir: Path, task_id: str) -> dict | None:
    try:
        lines = (run_dir / "journal.jsonl").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e.get("event") == "task_running" and e.get("task") == task_id:
            return e
    return None


HIDE = """\
import ctypes, os
_hide = os.environ.get("PITA_TEST_HIDE")
if _hide:  # this node's own view of the filesystem: an empty folder where the runs are
    _libc = ctypes.CDLL(None, use_errno=True)
    if _libc.unshare(0x00020000) == 0:  # CLONE_NEWNS
        _libc.mount(b"none", b"/", None, 0x4000 | 0x40000, None)  # MS_REC | MS_PRIVATE
        _libc.mount(b"tmpfs", _hide.encode(), b"tmpfs", 0, None)
"""


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.cluster
def test_a_node_that_cannot_see_the_run_folder_is_one_line_before_any_task(tmp_path):
    """Issue 41 item 6: one node mounts its own empty folder where the run folder lives (a
    node-local disk: its processes run in a mount namespace of their own); before any task
    starts the command names that node in one line and exits 2."""
    if os.geteuid() != 0:
        pytest.skip("a mount namespace for the simulated node needs root")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HIDE)
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    with simulated_cluster(1) as cluster:
        blind = cluster.add_node(
            num_cpus=2,
            env_vars={
                "PYTHONPATH": f"{site}:{os.environ.get('PYTHONPATH', '')}",
                "PITA_TEST_HIDE": str(outputs),
            },
        )
        cluster.wait_for_nodes()
        done = run_cli(
            _ray_args(cluster, "experiment.name=blind", *only("reference"), *sleep_overrides()),
            cwd=tmp_path,
            timeout=300,
        )
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr[-2000:]
    assert (
        lines[0].startswith("error: the run folder ")
        and "is not shared with every Ray node" in lines[0]
    )
    assert f"node {blind.node_id[:8]}" in lines[0] and "cannot read" in lines[0]
    [run_dir] = (outputs / "blind").glob("*")
    assert not any(e["event"] == "task_running" for e in journal(run_dir))


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.cluster
def test_a_gang_that_loses_a_node_resumes_from_its_checkpoint_on_the_ranks_left(tmp_path):
    """Issue 41 item 4: a 4-rank FSDP pretrain over 2 nodes loses the node of ranks 2-3 once a
    checkpoint is committed; it restarts on the 2 devices left from that checkpoint (its own
    retries untouched), and the run ends exit 0."""
    pretrain = "pretrain.goal_walk.tiny"
    with simulated_cluster(2) as cluster:
        args = _ray_args(
            cluster,
            "experiment=smoke",
            "experiment.name=gang_lost",
            "training.parallel_strategy=fsdp",
            "training.checkpoint_every=5",
            "executor.max_retries=0",
            "executor.timeline_plot=false",
            *only("QSharp"),
        )
        run = run_cli_later(args, cwd=tmp_path, timeout=600)
        run_dir = _wait_for(
            lambda: next((tmp_path / "outputs" / "gang_lost").glob("*/journal.jsonl"), None),
            180,
            "no journal",
        ).parent
        started = _wait_for(lambda: _running(run_dir, pretrain), 180, "no pretrain gang")
        _wait_for(
            lambda: list((run_dir / "tasks").glob(f"{pretrain}.checkpoints/step-*/manifest.json")),
            300,
            "no committed checkpoint",
        )
        node = next(n for n in cluster.worker_nodes if n.node_id == started["nodes"][2])
        cluster.remove_node(node, allow_graceful=False)
        done = run.result()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert len(set(started["nodes"])) == 2 and len(started["devices"]) == 4
    events = [e for e in journal(run_dir) if e.get("task") in (pretrain, None)]
    failed = [e for e in events if e["event"] == "task_failed"]
    assert [e["failure"] for e in failed] == ["node_lost"]
    resized = [e for e in events if e["event"] == "task_resized"]
    assert resized and resized[0]["ranks"] == 2 and resized[0]["why"] == "node_lost"
    runs = [e for e in events if e["event"] == "task_running"]
    assert len(runs) == 2 and len(runs[1]["devices"]) == 2
    assert started["nodes"][2] not in runs[1]["nodes"]
    log = run_dir / "tasks" / pretrain / "log.txt"
    text = "\n".join(p.read_text() for p in run_dir.rglob("*.log*") if p.is_file())
    assert "resumed from checkpoint" in text + (log.read_text() if log.is_file() else "")


def test_the_slurm_script_outside_an_allocation_is_one_line_and_exit_2():
    """scripts/ray_on_slurm.sh starts Ray on the nodes of a SLURM allocation; outside one it
    says so (its run inside SLURM could not be tried here)."""
    import subprocess

    from tests.conftest import ROOT

    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "ray_on_slurm.sh")], env=env, capture_output=True, text=True
    )
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "error: scripts/ray_on_slurm.sh runs inside a SLURM allocation (sbatch or salloc)"
    ]
