"""The planner: chains × rounds × stages, shards and merges, per-chain dependencies only."""

from __future__ import annotations

import pytest

from pita.core.errors import ConfigError
from pita.experiment.cli import compose_config
from pita.experiment.plan import plan_experiment
from tests.conftest import only, sleep_overrides


def _plan(overrides, n_devices=2, device_mb=None):
    cfg = compose_config(overrides)
    return cfg, plan_experiment(cfg, n_devices, device_mb=device_mb)


def test_dag_2_algos_2_datasets_2_families_3_rounds():
    cfg, plan = _plan(
        [
            *only("QSharp", "DPO"),
            "experiment.datasets=[goal_walk,star_graph]",
            "experiment.families=[tiny,gpt2]",
            "rounds_of_training=3",
            *sleep_overrides(),
        ]
    )
    tasks = plan.tasks
    chains = {t.chain for t in tasks.values() if t.stage != "pretrain"}
    assert len(chains) == 2 * 2 * 2
    # per round: collect (2 shards + merge), train, evaluate (2 shards + merge) = 7 tasks
    per_chain = {c: [t for t in tasks.values() if t.chain == c] for c in chains}
    assert all(len(ts) == 3 * 7 for ts in per_chain.values())
    # pretrain once per (offline dataset, family): tiny is built in the run, gpt2 is
    # fine-tuned on the task (issue 23)
    assert sorted(t.id for t in tasks.values() if t.stage == "pretrain") == [
        "pretrain.goal_walk.gpt2",
        "pretrain.goal_walk.tiny",
        "pretrain.star_graph.gpt2",
        "pretrain.star_graph.tiny",
    ]
    # no edge between chains: every dependency is in the same chain or a shared pretrain
    for t in tasks.values():
        for d in t.deps:
            dep = tasks[d]
            assert dep.chain == t.chain or dep.stage == "pretrain", (t.id, d)
    # round r collect depends on round r-1 train of its own chain
    c = "QSharp.star_graph.gpt2"
    collect_r1 = tasks[f"{c}.r1.collect.s00"]
    assert f"{c}.r0.train" in collect_r1.deps and collect_r1.inputs["guide"] == f"{c}.r0.train"
    # train aggregates the data of every round so far (DAgger)
    assert tasks[f"{c}.r2.train"].inputs["data"] == [
        f"{c}.r0.collect",
        f"{c}.r1.collect",
        f"{c}.r2.collect",
    ]
    # the merge depends on its shards; evaluate depends on its round's train
    assert tasks[f"{c}.r1.evaluate"].deps == [f"{c}.r1.evaluate.s00", f"{c}.r1.evaluate.s01"]
    assert tasks[f"{c}.r1.evaluate.s00"].inputs["policy"] == f"{c}.r1.train"
    # insertion order is topological
    seen = set()
    for tid, t in tasks.items():
        assert all(d in seen for d in t.deps), tid
        seen.add(tid)


def test_critical_path_priority_prefers_long_chains():
    _, plan = _plan(["algos.QSharp.enabled=true", "rounds_of_training=3", *sleep_overrides()])
    t = plan.tasks
    assert (
        t["QSharp.goal_walk.tiny.r0.collect.s00"].priority
        > t["reference.goal_walk.tiny.r0.evaluate.s00"].priority
    )
    assert t["pretrain.goal_walk.tiny"].priority >= max(
        x.priority for x in t.values() if x.stage != "pretrain"
    )


def test_shard_ranges_weighted_and_cover_everything():
    from pita.core.gpu_manager import GPUManager

    gpu = GPUManager("fake:[80GB,40GB,40GB]")
    assert gpu.distribute_work(100) == [(0, 50), (50, 75), (75, 100)]
    assert gpu.distribute_work(2) == [
        (0, 1),
        (1, 2),
    ]  # fewer items than devices: empty parts dropped
    cfg = compose_config(["algos.QSharp.enabled=true", *sleep_overrides()])
    plan = plan_experiment(
        cfg, 3, distribute=lambda n: [(a / 100, b / 100) for a, b in gpu.distribute_work(100, n)]
    )
    shards = [plan.tasks[f"QSharp.goal_walk.tiny.r0.collect.s0{i}"].shard_range for i in range(3)]
    assert shards == [(0.0, 0.5), (0.5, 0.75), (0.75, 1.0)]


def test_task_larger_than_any_device_is_refused():
    # a training task is refused by the gang sizing (pita/experiment/gangs.py), the others by
    # check_resources
    with pytest.raises(ConfigError, match="training.parallel_strategy: task pretrain.* needs ~"):
        _plan(
            ["model.memory_gb=100", *sleep_overrides()],
            n_devices=2,
            device_mb=[80 * 1024, 80 * 1024],
        )
    with pytest.raises(ConfigError, match="model.gpus_per_task=4"):
        _plan(["model.gpus_per_task=4", *sleep_overrides()], n_devices=2)


def test_unimplemented_stage_is_a_config_error():
    with pytest.raises(ConfigError, match="algos.QSharp.enabled=true: stage 'collect' of QSharp"):
        _plan(
            [
                "algos.QSharp.enabled=true",
                *sleep_overrides(),
                "+executor.stage_overrides.QSharp.collect=nowhere.module:fn",
            ]
        )


def test_device_map_auto_sizes_gangs_for_large_models():
    # 70 GB of weights (x3 for training) on 40 GB devices: shards of evaluate need 2 GPUs,
    # training 6; nothing is refused because device_map=auto shards over a gang.
    _, plan = _plan(
        [
            "model.memory_gb=70",
            "model.device_map=auto",
            "algos.QSharp.enabled=true",
            *sleep_overrides(),
        ],
        n_devices=8,
        device_mb=[40 * 1024] * 8,
    )
    t = plan.tasks
    assert t["QSharp.goal_walk.tiny.r0.evaluate.s00"].gpus == 2
    assert t["QSharp.goal_walk.tiny.r0.train"].gpus == 6


def _dataset_cfgs(plan) -> dict[str, dict]:
    return {t.dataset: t.dataset_cfg for t in plan.tasks.values()}


def test_dataset_overrides_reach_a_listed_dataset():
    """issue 45: `dataset.*` reaches the selected dataset whether or not experiment.datasets
    lists its file; a key for a listed dataset that is not selected is refused in one line
    that says how to set it, and that way works."""
    from pita.experiment.config import validate

    listed = "experiment.datasets=[star_graph_d2_l5,star_graph_d5_l5]"
    base = [*only("QSharp"), *sleep_overrides()]
    _, plan = _plan([*base, "dataset=star_graph_d2_l5", listed, "dataset.num_nodes=30"])
    cfgs = _dataset_cfgs(plan)
    assert cfgs["star_graph_d2_l5"]["num_nodes"] == 30  # the selected one, listed
    assert cfgs["star_graph_d5_l5"]["num_nodes"] == 50  # another file: its own value
    _, plan = _plan([*base, "dataset=star_graph_d2_l5", "dataset.num_nodes=30"])
    assert _dataset_cfgs(plan)["star_graph"]["num_nodes"] == 30  # selected, not listed
    refused = compose_config([*base, listed, "dataset.num_nodes=30"])  # goal_walk selected
    with pytest.raises(ConfigError) as err:
        validate(refused)
    (line,) = err.value.messages
    assert "dataset.num_nodes=30: sets the selected dataset 'goal_walk'" in line
    how = line.split("select it: ")[1].split(" (")[0].split()  # the command it suggests
    assert how == ["dataset=star_graph_d2_l5", "dataset.num_nodes=30"]
    cfg = compose_config([*base, listed, *how])
    validate(cfg)
    assert _dataset_cfgs(plan_experiment(cfg, 2))["star_graph_d2_l5"]["num_nodes"] == 30
