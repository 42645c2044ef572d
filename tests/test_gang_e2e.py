"""Issue 31 item 3 end to end: a model larger than one device trains on an FSDP2 gang.

A local family (random-weight Llamas written with `save_pretrained`, tests/local_family.py)
whose value-training estimate exceeds one `fake:[<size>]` device while FSDP over two fits:
the planner gives PITA's and Q#'s train tasks a 2-device FSDP gang (whatever
`training.parallel_strategy` says), their ranks are 2 gloo processes sharding the value
model with `fully_shard` (pita/algos/value_training.py), and their rows reach the summary.
A DPO row with the same family is refused before the run, in one line: TRL cannot shard on
CPU and one device cannot hold it.
"""

from __future__ import annotations

import csv

import pytest

from tests.conftest import journal, only, run_cli, run_dirs

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def big_family(tmp_path_factory):
    """11M-parameter reference and guide (hidden 512, 4 layers): large enough for the
    estimate to tell one device from an FSDP gang, small enough to train on a CPU."""
    from tests.local_family import build_local_family

    return build_local_family(tmp_path_factory.mktemp("big_family"), hidden=512, layers=4)


def _args(family, *algos: str) -> list[str]:
    sizes = [
        "evaluation.num_samples=2",
        "evaluation.etas=[0.0,5.0]",
        "evaluation.batch_size=8",
        "generation.batch_size=8",
        "data_collection.samples_per_example=4",
        "data_collection.max_examples=8",
        "executor.progress=false",
        "experiment.name=fsdp_gang",
    ]
    per_algo = []
    for algo in ("PITA", "QSharp"):
        per_algo += [f"algos.{algo}.steps=2", f"algos.{algo}.batch_size=8"]
        per_algo += [f"algos.{algo}.samples_per_example=4"]
    per_algo += ["algos.DPO.epochs=1", "algos.DPO.batch_size=8", "algos.DPO.samples_per_example=4"]
    return [*family.overrides("gsm8k"), *sizes, *per_algo, *only(*algos)]


def _device_mb(family) -> int:
    """A device size between the train task's per-rank estimate under FSDP over 2 and on
    one device, and above every other task's (so only training needs the gang)."""
    from pita.experiment import cli
    from pita.experiment.estimates import ModelSizes, _plain, training_memory
    from pita.experiment.run import build_plan, make_gpu_manager

    cfg = cli.compose_config(
        [*_args(family, "reference", "PITA", "QSharp"), 'system.devices="fake:[80GB]"']
    )
    plan = build_plan(cfg, make_gpu_manager(cfg))
    train = plan.tasks["PITA.gsm8k.local.r0.train"]
    mem = training_memory(train, _plain(cfg), ModelSizes())
    assert mem is not None
    one, two = mem.per_rank_mb("none", 1), mem.per_rank_mb("fsdp", 2)
    device = (one + two) // 2
    others = max(t.mem_mb for t in plan.tasks.values() if t.stage != "train")
    assert two < device < one and others < device, (one, two, others)
    return device


@pytest.mark.long
@pytest.mark.slow
def test_a_value_model_larger_than_one_device_trains_with_fsdp2_on_two_ranks(big_family, tmp_path):
    device = _device_mb(big_family)
    devices = f'system.devices="fake:[{device}MB,{device}MB]"'
    proc = run_cli(
        [*_args(big_family, "reference", "PITA", "QSharp"), devices], tmp_path, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [run_dir] = run_dirs(tmp_path, "fsdp_gang")
    for algo in ("PITA", "QSharp"):
        tid = f"{algo}.gsm8k.local.r0.train"
        running = [
            e for e in journal(run_dir) if e.get("task") == tid and e["event"] == "task_running"
        ]
        assert running and running[0]["devices"] == [0, 1]
        log = (run_dir / "tasks" / tid / "log.txt").read_text()
        assert (
            "gang strategy fsdp (the planner's choice; training.parallel_strategy=none): "
            "FSDP2 (fully_shard) over 2 ranks"
        ) in log, log[-2000:]
    plan = (run_dir / "plan.json").read_text()
    assert '"strategy": "fsdp"' in plan
    with open(run_dir / "results" / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["algo"] for r in rows} == {"reference", "PITA", "QSharp"}
    # the gangs ran on the two warmed-up one-device workers (their ranks fork from them):
    # no 2-device worker, and no one-device worker started again after a gang
    assert len(list((run_dir / "workers").glob("worker-*.log"))) == 2


def test_a_dpo_row_with_the_same_family_is_refused_before_the_run(big_family, tmp_path):
    device = _device_mb(big_family)
    devices = f'system.devices="fake:[{device}MB,{device}MB]"'
    proc = run_cli([*_args(big_family, "reference", "PITA", "DPO"), devices], tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    [line] = proc.stderr.strip().splitlines()
    assert "task DPO.gsm8k.local.r0.train needs ~" in line
    assert "2 fake device(s)" in line and "accelerate has no FSDP on CPU" in line
    assert not run_dirs(tmp_path, "fsdp_gang") or not list((tmp_path / "outputs").rglob("tasks/*"))
