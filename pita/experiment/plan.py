"""Planner: experiment -> chains (algo × dataset × family) -> rounds -> stage tasks.

Only real dependencies become edges: round r's `collect` needs round r-1's `train`;
`train` needs its round's data (and the proxy reward model for -HF variants); `evaluate`
needs its round's `train`; shards of a stage are merged before their consumer runs. No
edge ever joins two chains (except the shared `pretrain` of a dataset+family), so there
is no global round barrier: chain A may be in round 2 while chain B is in round 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pita.algos.registry import ALGORITHMS, ANY, can_grow, is_importable, lookup, stage_outputs
from pita.core.dag import Plan, critical_path_priorities
from pita.core.elastic import rank_choices
from pita.core.errors import ConfigError
from pita.core.parallel import Gang, Strategy
from pita.core.schema import ModelConfig, settings
from pita.core.tasks import SHARDABLE, TaskSpec, task_id
from pita.experiment.cli_extras import conf_dir

CONF_DIR = conf_dir()  # conf/ of a checkout, pita/conf/ of an installed wheel

# Relative duration of each stage (critical-path priority and dry-run placement only).
STAGE_WORK = {"pretrain": 3.0, "collect": 4.0, "reward_model": 2.0, "train": 6.0, "evaluate": 2.0}
# Device memory of a stage relative to `model.memory_gb` (training holds optimizer states).
STAGE_MEMORY = {"pretrain": 3.0, "collect": 1.0, "reward_model": 3.0, "train": 3.0, "evaluate": 1.0}
MERGE_WORK = 0.1


def _container(cfg: Any) -> dict[str, Any]:
    out = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(out, dict)  # a group's config is a mapping
    return out  # type: ignore[return-value]


def _group_cfg(cfg: DictConfig, group: str, name: str) -> dict[str, Any]:
    """The config of a dataset/model group by name: the selected one carries the command
    line's overrides (a dataset by its file, pita/experiment/dataset_choice.py); any other
    listed one is composed from its file over the schema."""
    from pita.experiment.config import DatasetConfig, ModelConfig, dataset_keys
    from pita.experiment.dataset_choice import is_selected

    selected = cfg[group]
    clean: Callable[[Any], dict[str, Any]] = dataset_keys if group == "dataset" else _container
    if is_selected(cfg, name) if group == "dataset" else selected.name == name:
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


@dataclass
class ChainRound:
    """What the wiring rules of one round of a chain can read."""

    produced: dict[str, str] = field(default_factory=dict)  # stage -> task id, this round
    collected: list[str] = field(default_factory=list)  # collect ids of earlier rounds (DAgger)
    prev_train: str | None = None  # the previous round's train


# The wiring rules: input name -> (the stages that read it, where it comes from). A rule
# that yields None adds no input (round 0 has no guide; GRPO has no collected data).
INPUT_RULES: tuple[tuple[str, tuple[str, ...], Callable[[ChainRound], Any]], ...] = (
    # round r's roll-ins come from π_ref guided by round r-1's value model / policy
    ("guide", ("collect",), lambda c: c.prev_train),
    # every round trains on the data of all rounds so far
    (
        "data",
        ("reward_model", "train"),
        lambda c: c.collected + [c.produced["collect"]] if "collect" in c.produced else None,
    ),
    # warm start from the previous round
    ("previous", ("reward_model", "train"), lambda c: c.prev_train),
    # -HF variants: the proxy reward model trained in this round
    ("reward_model", ("train",), lambda c: c.produced.get("reward_model")),
    # evaluate this round's policy (the reference row evaluates π_ref: no train)
    ("policy", ("evaluate",), lambda c: c.produced.get("train")),
)


def stage_inputs(stage: str, chain: ChainRound, base: dict[str, Any]) -> dict[str, Any]:
    """The inputs of `stage` by logical name (what `ctx.input(name)` / `ctx.inputs(name)` return in the stage)."""
    inputs = dict(base)
    for name, readers, source in INPUT_RULES:
        if stage in readers and (value := source(chain)):
            inputs[name] = value
    return inputs


def _deps_of(inputs: dict[str, Any]) -> list[str]:
    return sorted({x for v in inputs.values() for x in (v if isinstance(v, list) else [v]) if x})


@dataclass
class Planner:
    """Builds the DAG of one experiment: chains (algo × dataset × family) of rounds of stages."""

    cfg: DictConfig
    n_devices: int
    shard_ranges: list[tuple[float, float]]
    largest_gang: int | None = None  # the most devices one task may hold (None: n_devices)
    plan: Plan = field(default_factory=Plan)
    _functions: dict[tuple[str, str], str] = field(default_factory=dict, init=False, repr=False)

    def function(self, algo: str, stage: str) -> str:
        """The dotted path of (algo, stage), checked to be importable (without importing it)
        once per plan: every round of every chain asks again."""
        if (algo, stage) not in self._functions:
            self._functions[(algo, stage)] = self._function(algo, stage)
        return self._functions[(algo, stage)]

    def _function(self, algo: str, stage: str) -> str:
        dotted = lookup(algo, stage, self.cfg.executor.stage_overrides or {})
        if dotted is None or not is_importable(dotted):
            key = (
                f"algos.{algo}.enabled=true"
                if algo in self.cfg.algos
                else f"executor.stage_overrides.{algo}"
            )
            raise ConfigError(
                f"{key}: stage {stage!r} of {algo} is not available "
                f"({dotted or 'no implementation registered'}); disable {algo} or provide it "
                f"with executor.stage_overrides"
            )
        return dotted

    def add_pretrain(self, common: dict[str, Any], mem_mb: int) -> str:
        """A family built in the run (model.name=tiny) is pretrained once per dataset."""
        tid = f"pretrain.{common['dataset']}.{common['family']}"
        self.plan.add(
            TaskSpec(
                id=tid,
                algo=ANY,
                round=0,
                stage="pretrain",
                fn=self.function(ANY, "pretrain"),
                gpus=self.fsdp_world(),
                gang=self.training_gang(self.fsdp_world()),
                ranks=self.elastic_ranks(),
                mem_mb=mem_mb,
                work=STAGE_WORK["pretrain"],
                **common,
            )
        )
        return tid

    def gang_strategy(self) -> Strategy:
        """training.parallel_strategy (never `auto`: `plan_experiment` resolved it), or
        none where a run has no gangs (cpu, single_gpu)."""
        if str(self.cfg.system.gpu_mode) in ("cpu", "single_gpu"):
            return Strategy.NONE
        return Strategy.of(str(self.cfg.training.parallel_strategy))

    def training_gang(self, world: int) -> Gang:
        """The gang of a training stage on `world` devices (the sizer may change it:
        pita/experiment/gangs.py); one plain process when the run has no gang strategy."""
        strategy = self.gang_strategy()
        return Gang(strategy, world) if strategy is not Strategy.NONE else Gang()

    def elastic_ranks(self) -> list[int]:
        """training.parallel_strategy=data_parallel: a training stage (pretrain, an
        algorithm's `gang_stages`) is planned on one device and gets 1, 2, 4, ... up to
        executor.max_ranks_per_task devices, one DDP rank each, its k chosen when it is
        dispatched by simulating the rest of the plan (pita/core/elastic.py). pita/experiment/
        gangs.py then drops the k a TRL stage's batch or the memory rules out. [] otherwise."""
        if self.gang_strategy() is not Strategy.DDP:
            return []
        top = min(self.n_devices, self.largest_gang or self.n_devices)
        ranks = rank_choices(int(self.cfg.executor.max_ranks_per_task), top)
        return ranks if len(ranks) > 1 else []

    def fsdp_world(self) -> int:
        """training.parallel_strategy=fsdp: the training stages get a gang of every device of
        the run, one rank per device (FSDP2 divides the model's states by k: not sized at
        dispatch); other stages, and every stage under data_parallel (`elastic_ranks`),
        keep one device (or model.gpus_per_task for sharding)."""
        if self.gang_strategy() is not Strategy.FSDP:
            return 1
        return max(1, min(self.n_devices, self.largest_gang or self.n_devices))

    def add_stage(self, stage: str, spec: dict[str, Any], deps: list[str]) -> str:
        """One stage task, or its shards plus their merge; returns the id consumers read."""
        algo, r = spec["algo"], spec["round"]
        tid = task_id(algo, spec["dataset"], spec["family"], r, stage)
        if stage not in SHARDABLE:
            self.plan.add(
                TaskSpec(
                    id=tid,
                    stage=stage,
                    fn=self.function(algo, stage),
                    deps=deps,
                    work=STAGE_WORK[stage],
                    **spec,
                )
            )
            return tid
        n = len(self.shard_ranges)
        shard_ids = [
            self.plan.add(
                TaskSpec(
                    id=task_id(algo, spec["dataset"], spec["family"], r, stage, s),
                    stage=stage,
                    fn=self.function(algo, stage),
                    deps=deps,
                    shard=s,
                    num_shards=n,
                    shard_range=(rng[0], rng[1]),
                    preferred_device=s % self.n_devices,
                    work=STAGE_WORK[stage] / n,
                    **spec,
                )
            ).id
            for s, rng in enumerate(self.shard_ranges)
        ]
        merge_spec = {
            **spec,
            "inputs": {**spec["inputs"], "shards": shard_ids},
            "mem_mb": 0,
            "gpus": 1,
        }
        self.plan.add(
            TaskSpec(
                id=tid,
                stage=f"{stage}_merge",
                fn=self.function(algo, f"{stage}_merge"),
                deps=shard_ids,
                work=MERGE_WORK,
                **merge_spec,
            )
        )
        return tid

    def add_chain(
        self,
        algo: str,
        common: dict[str, Any],
        base_inputs: dict[str, Any],
        mem_mb: Callable[[str], int],
        gpus: int,
    ) -> None:
        """Every round of one (algo, dataset, family) chain; no edge leaves the chain."""
        spec_algo = ALGORITHMS[algo]
        n_rounds = 1 if spec_algo.single_round else int(self.cfg.rounds_of_training)
        chain = ChainRound()
        for r in range(n_rounds):
            chain.produced = {}
            for stage in spec_algo.round_stages:
                inputs = stage_inputs(stage, chain, base_inputs)
                gang = stage in spec_algo.gang_stages
                k = max(gpus, self.fsdp_world()) if gang else gpus
                spec = dict(
                    algo=algo,
                    algo_schema=spec_algo.schema_path,
                    round=r,
                    inputs=inputs,
                    gpus=k,
                    mem_mb=mem_mb(stage),
                    **common,
                )
                spec["ranks"] = self.elastic_ranks() if gang and k == 1 else []
                if gang:
                    spec["gang"] = self.training_gang(k)
                chain.produced[stage] = self.add_stage(stage, spec, _deps_of(inputs))
            if "collect" in chain.produced:
                chain.collected.append(chain.produced["collect"])
            chain.prev_train = chain.produced.get("train", chain.prev_train)


def plan_experiment(
    cfg: DictConfig,
    n_devices: int,
    *,
    device_mb: list[int] | None = None,
    distribute=None,
    device_kind: str = "cpu",
    largest_gang: int | None = None,
) -> Plan:
    """Build the task DAG. `distribute(n_parts)` gives shard fractions weighted by device;
    `device_kind` ("cuda" | "fake" | "cpu") says whether a TRL stage can shard (FSDP);
    `largest_gang`: the most devices one task may hold (None: every device; on a Ray cluster
    every device too, since a gang's ranks may span nodes).
    `training.parallel_strategy=auto` is resolved for these devices first (a no-op in a
    run: `run()` resolved it already, for the workers too: pita/experiment/strategy.py)."""
    from pita.experiment.strategy import resolved_config

    cfg, _ = resolved_config(cfg, device_kind, n_devices)
    shard_ranges = _shard_ranges(cfg, n_devices, distribute)
    from pita.datasets import is_offline  # issue 23: a hub family is fine-tuned on offline tasks

    planner = Planner(cfg, n_devices, shard_ranges, largest_gang)
    algos = enabled_algos(cfg)
    for ds_name in list(cfg.experiment.datasets) or [cfg.dataset.name]:
        ds_cfg = _group_cfg(cfg, "dataset", ds_name)
        for fam_name in list(cfg.experiment.families) or [cfg.model.name]:
            fam_cfg = _group_cfg(cfg, "model", fam_name)
            common = dict(dataset=ds_name, family=fam_name, dataset_cfg=ds_cfg, family_cfg=fam_cfg)
            family = settings(ModelConfig, fam_cfg)
            mem_gb = family.memory_gb

            def mem_mb(stage: str, mem_gb: float = mem_gb) -> int:
                return int(mem_gb * STAGE_MEMORY.get(stage, 1.0) * 1024)

            base_inputs: dict[str, Any] = {}
            if _built_in_run(fam_name, fam_cfg) or is_offline(str(ds_cfg.get("name"))):
                base_inputs["reference"] = planner.add_pretrain(common, mem_mb("pretrain"))
            for algo in algos:
                planner.add_chain(algo, common, base_inputs, mem_mb, family.gpus_per_task)
    plan = planner.plan
    overrides = cfg.executor.stage_overrides or {}
    for t in plan.tasks.values():  # what its committed folder must hold (resume checks it)
        t.outputs = list(stage_outputs(t.algo, t.stage, overrides))
        t.growable = can_grow(t.algo, t.stage, t.fn)  # its registry row's growable_stages
    from pita.experiment.estimates import fill_estimates

    fill_estimates(plan, cfg, device_mb)  # measured peak > checkpoint size > model.memory_gb
    if device_mb:
        size_gangs(plan, device_mb)
        from pita.experiment.gangs import size_training_gangs

        size_training_gangs(plan, cfg, device_mb, device_kind, largest_gang)
    check_resources(plan, n_devices, device_mb, largest_gang)
    critical_path_priorities(plan)
    return plan


def _shard_ranges(cfg: DictConfig, n_devices: int, distribute: Any) -> list[tuple[float, float]]:
    """The fractions of a shardable stage's items each shard takes: one shard per device (at
    most `executor.max_shards`), weighted by `distribute(n)` when given, else equal."""
    most = cfg.executor.max_shards
    n_shards = max(1, n_devices if most == 0 else min(n_devices, most))
    if distribute:
        return [(r[0], r[1]) for r in distribute(n_shards)]
    return [(i / n_shards, (i + 1) / n_shards) for i in range(n_shards)]


def _built_in_run(name: str, family_cfg: dict[str, Any]) -> bool:
    """True for a family whose models are trained inside the run (the built-in `tiny`)."""
    from pita.models.catalog import resolve_family

    try:
        return resolve_family(name, family_cfg).is_builtin
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def size_gangs(plan: Plan, device_mb: list[int]) -> None:
    """With model.device_map=auto, a task too large for one device gets the k devices its
    size needs (a 70B reward model over 4 GPUs); its models are sharded over that gang.
    Read from each task's own family (a multi-family experiment may mix both)."""
    from pita.models.placement import gpus_needed

    for t in plan.tasks.values():
        if t.family_cfg.get("device_map") == "auto" and t.mem_mb > max(device_mb):
            try:
                t.gpus = max(t.gpus, gpus_needed(t.mem_mb, device_mb, overhead=1.0))
                t.ranks = t.ranks if t.gpus == 1 else []  # sharded over its gang: fixed
            except ValueError:
                pass  # not even the whole machine: check_resources reports it


def check_resources(
    plan: Plan, n_devices: int, device_mb: list[int] | None, largest_gang: int | None = None
) -> None:
    """Refuse, before anything starts, a task no set of devices could ever hold (on a Ray
    cluster: no node of it; `largest_gang`)."""
    for t in plan.tasks.values():
        if t.gpus > n_devices:
            raise ConfigError(
                f"model.gpus_per_task={t.gpus}: task {t.id} needs {t.gpus} devices but this run "
                f"has {n_devices}; lower it or add devices (system.devices)"
            )
        if largest_gang is not None and t.gpus > largest_gang:
            raise ConfigError(
                f"model.gpus_per_task={t.gpus}: task {t.id} needs {t.gpus} devices but a task "
                f"may hold at most {largest_gang}; lower it"
            )
        if device_mb:
            best = sum(sorted(device_mb, reverse=True)[: t.gpus])
            if t.mem_mb > best:
                raise ConfigError(
                    f"model.memory_gb: task {t.id} needs ~{t.mem_mb / 1024:.1f} GB on {t.gpus} device(s) but the "
                    f"largest {'gang' if t.gpus > 1 else 'device'} has {best / 1024:.1f} GB; raise "
                    f"model.gpus_per_task, use a quantized alias (-8bit/-4bit) or a smaller model"
                )
