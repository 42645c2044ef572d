"""Planner: experiment -> chains (algo × dataset × family) -> rounds -> stage tasks.

Only real dependencies become edges: round r's `collect` needs round r-1's `train`;
`train` needs its round's data (and the proxy reward model for -HF variants); `evaluate`
needs its round's `train`; shards of a stage are merged before their consumer runs. No
edge ever joins two chains (except the shared `pretrain` of a dataset+family), so there
is no global round barrier: chain A may be in round 2 while chain B is in round 0.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pita.core.errors import ConfigError
from pita.core.tasks import SHARDABLE, TaskSpec, task_id
from pita.stages.registry import ROUND_STAGES, is_importable, lookup

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"

# Relative duration of each stage (critical-path priority and dry-run placement only).
STAGE_WORK = {"pretrain": 3.0, "collect": 4.0, "reward_model": 2.0, "train": 6.0, "evaluate": 2.0}
# Device memory of a stage relative to `model.memory_gb` (training holds optimizer states).
STAGE_MEMORY = {"pretrain": 3.0, "collect": 1.0, "reward_model": 3.0, "train": 3.0, "evaluate": 1.0}
MERGE_WORK = 0.1


@dataclass
class Plan:
    tasks: dict[str, TaskSpec] = field(default_factory=dict)  # insertion order is topological

    def add(self, task: TaskSpec) -> TaskSpec:
        if task.id in self.tasks:
            raise ValueError(f"duplicate task id {task.id}")
        missing = [d for d in task.deps if d not in self.tasks]
        assert not missing, f"{task.id} depends on unplanned {missing}"
        self.tasks[task.id] = task
        return task

    def dependants(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {tid: [] for tid in self.tasks}
        for t in self.tasks.values():
            for d in t.deps:
                out[d].append(t.id)
        return out

    def to_json(self) -> dict[str, Any]:
        return {"tasks": [t.to_dict() for t in self.tasks.values()]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Plan:
        plan = cls()
        for d in data["tasks"]:
            plan.add(TaskSpec.from_dict(d))
        return plan

    @classmethod
    def load(cls, path: Path) -> Plan:
        return cls.from_json(json.loads(Path(path).read_text()))


def _group_cfg(cfg: DictConfig, group: str, name: str) -> dict[str, Any]:
    """The config of a dataset/model group by name: the selected one carries the command
    line's overrides; any other listed one is composed from its file over the schema."""
    from pita.core.config import DatasetConfig, ModelConfig, dataset_keys

    selected = cfg[group]
    clean = dataset_keys if group == "dataset" else (lambda c: OmegaConf.to_container(c, resolve=True))
    if selected.name == name:
        return clean(selected)
    path = CONF_DIR / group / f"{name}.yaml"
    if not path.is_file():
        options = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
        key = "experiment.datasets" if group == "dataset" else "experiment.families"
        raise ConfigError(f"{key}: no {group} config {name!r}; available: {', '.join(options)}")
    schema = OmegaConf.structured(DatasetConfig if group == "dataset" else ModelConfig)
    try:
        loaded = clean(OmegaConf.merge(schema, OmegaConf.load(path)))
        if group == "dataset":
            from pita.datasets import validate_dataset_cfg

            validate_dataset_cfg(loaded)
    except Exception as exc:  # a bad value in a listed group file
        raise ConfigError(f"{group} config {path.name}: {str(exc).splitlines()[0]}") from None
    return loaded


def enabled_algos(cfg: DictConfig) -> list[str]:
    return [name for name, algo in cfg.algos.items() if algo.enabled]


def critical_path_priorities(plan: Plan) -> None:
    """priority = the longest chain of work from a task to the end of the DAG."""
    dependants = plan.dependants()
    for tid in reversed(list(plan.tasks)):
        t = plan.tasks[tid]
        t.priority = t.work + max((plan.tasks[d].priority for d in dependants[tid]), default=0.0)


def plan_experiment(cfg: DictConfig, n_devices: int, *, device_mb: list[int] | None = None,
                    distribute=None) -> Plan:
    """Build the task DAG. `distribute(n_parts)` gives shard fractions weighted by device."""
    overrides: Mapping[str, Mapping[str, str]] = cfg.executor.stage_overrides or {}
    datasets = list(cfg.experiment.datasets) or [cfg.dataset.name]
    families = list(cfg.experiment.families) or [cfg.model.name]
    algos = enabled_algos(cfg)
    rounds = int(cfg.rounds_of_training)
    n_shards = n_devices if cfg.executor.max_shards == 0 else min(n_devices, cfg.executor.max_shards)
    n_shards = max(1, n_shards)
    shard_ranges = distribute(n_shards) if distribute else [(i / n_shards, (i + 1) / n_shards) for i in range(n_shards)]

    def fn_for(algo: str, stage: str) -> str:
        dotted = lookup(algo, stage, overrides)
        if dotted is None or not is_importable(dotted):
            key = f"algos.{algo}.enabled=true" if algo in cfg.algos else "model.name=tiny"
            raise ConfigError(f"{key}: stage {stage!r} of {algo} is not available "
                              f"({dotted or 'no implementation registered'}); disable {algo} or provide it "
                              f"with executor.stage_overrides")
        return dotted

    plan = Plan()
    for ds_name in datasets:
        ds_cfg = _group_cfg(cfg, "dataset", ds_name)
        for fam_name in families:
            fam_cfg = _group_cfg(cfg, "model", fam_name)
            mem_gb = float(fam_cfg.get("memory_gb", 0.5))
            gpus = int(fam_cfg.get("gpus_per_task", 1))
            common = dict(dataset=ds_name, family=fam_name, dataset_cfg=ds_cfg, family_cfg=fam_cfg)

            def mem(stage: str, mem_gb: float = mem_gb) -> int:
                return int(mem_gb * STAGE_MEMORY.get(stage, 1.0) * 1024)

            pretrain_id = None
            if fam_name == "tiny":
                pretrain_id = f"pretrain.{ds_name}.{fam_name}"
                plan.add(TaskSpec(id=pretrain_id, algo="*", round=0, stage="pretrain",
                                  fn=fn_for("*", "pretrain"), gpus=1, mem_mb=mem("pretrain"),
                                  work=STAGE_WORK["pretrain"], **common))
            base_inputs = {"reference": pretrain_id} if pretrain_id else {}
            base_deps = [pretrain_id] if pretrain_id else []

            for algo in algos:
                stages = ROUND_STAGES[algo]
                n_rounds = 1 if algo == "reference" else rounds
                prev_train: str | None = None
                collected: list[str] = []
                for r in range(n_rounds):
                    produced: dict[str, str] = {}
                    for stage in stages:
                        inputs: dict[str, Any] = dict(base_inputs)
                        if stage == "collect" and prev_train:
                            inputs["guide"] = prev_train
                        if stage in ("reward_model", "train"):
                            if "collect" in produced:
                                inputs["data"] = collected + [produced["collect"]]
                            if prev_train:
                                inputs["previous"] = prev_train
                            if "reward_model" in produced:
                                inputs["reward_model"] = produced["reward_model"]
                        if stage == "evaluate" and "train" in produced:
                            inputs["policy"] = produced["train"]
                        deps = sorted({*base_deps, *(x for v in inputs.values()
                                                     for x in (v if isinstance(v, list) else [v]) if x)})
                        tid = task_id(algo, ds_name, fam_name, r, stage)
                        spec = dict(algo=algo, round=r, inputs=inputs, gpus=gpus, mem_mb=mem(stage), **common)
                        if stage in SHARDABLE:
                            shard_ids = []
                            for s, rng in enumerate(shard_ranges):
                                t = plan.add(TaskSpec(
                                    id=task_id(algo, ds_name, fam_name, r, stage, s), stage=stage,
                                    fn=fn_for(algo, stage), deps=deps, shard=s, num_shards=len(shard_ranges),
                                    shard_range=tuple(rng), preferred_device=s % n_devices,
                                    work=STAGE_WORK[stage] / len(shard_ranges), **spec))
                                shard_ids.append(t.id)
                            plan.add(TaskSpec(
                                id=tid, stage=f"{stage}_merge", fn=fn_for(algo, f"{stage}_merge"),
                                deps=shard_ids, work=MERGE_WORK,
                                **{**spec, "inputs": {**inputs, "shards": shard_ids}, "mem_mb": 0, "gpus": 1}))
                        else:
                            plan.add(TaskSpec(id=tid, stage=stage, fn=fn_for(algo, stage), deps=deps,
                                              work=STAGE_WORK[stage], **spec))
                        produced[stage] = tid
                    if "collect" in produced:
                        collected.append(produced["collect"])
                    prev_train = produced.get("train", prev_train)

    from pita.experiment.estimates import fill_estimates

    fill_estimates(plan, cfg, device_mb)  # measured peak > checkpoint size > model.memory_gb
    if device_mb and cfg.model.device_map == "auto":
        size_gangs(plan, device_mb)
    check_resources(plan, n_devices, device_mb)
    critical_path_priorities(plan)
    return plan


def size_gangs(plan: Plan, device_mb: list[int]) -> None:
    """With model.device_map=auto, a task too large for one device gets the k devices its
    size needs (a 70B reward model over 4 GPUs); its models are sharded over that gang."""
    from pita.models.placement import gpus_needed

    for t in plan.tasks.values():
        if t.mem_mb > max(device_mb):
            try:
                t.gpus = max(t.gpus, gpus_needed(t.mem_mb, device_mb, overhead=1.0))
            except ValueError:
                pass  # not even the whole machine: check_resources reports it


def check_resources(plan: Plan, n_devices: int, device_mb: list[int] | None) -> None:
    """Refuse, before anything starts, a task no set of devices could ever hold."""
    for t in plan.tasks.values():
        if t.gpus > n_devices:
            raise ConfigError(f"model.gpus_per_task={t.gpus}: task {t.id} needs {t.gpus} devices but this run "
                              f"has {n_devices}; lower it or add devices (system.devices)")
        if device_mb:
            best = sum(sorted(device_mb, reverse=True)[: t.gpus])
            if t.mem_mb > best:
                raise ConfigError(
                    f"model.memory_gb: task {t.id} needs ~{t.mem_mb / 1024:.1f} GB on {t.gpus} device(s) but the "
                    f"largest {'gang' if t.gpus > 1 else 'device'} has {best / 1024:.1f} GB; raise "
                    f"model.gpus_per_task, use a quantized alias (-8bit/-4bit) or a smaller model")
