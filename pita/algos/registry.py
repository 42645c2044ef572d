"""The one table of algorithms: their names, the stages of a round, and each stage's function,
outputs and models.

Everything that needs to know "which algorithms exist" reads `ALGORITHMS`: the config
schema (`algos.<NAME>` must be a row), the planner (stages of a round, which function
runs each, what each leaves in its task folder), the memory estimates (which models each
stage holds), evaluate (which rows are guided decoding, which is π_ref itself), the report
(row order) and the tests. Nothing outside `pita/algos/` branches on an algorithm's name
(tests/test_registry.py checks): a decision that depends on the algorithm reads a field of
its row. Adding an algorithm to pita = one row here + `conf/algo/<name>.yaml` + its defaults
line in `conf/config.yaml` (a test checks the two agree); adding one from your own package
= an entry point `pita_algorithms` (below, and docs/extending.md), no edit here.

Functions are dotted paths, imported only in workers: this module imports nothing
heavy, so the orchestrator can plan without torch. `executor.stage_overrides` replaces
any entry from the config (`<ALGO>.<stage>` or `any.<stage>` -> "pkg.mod:function").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pita.core.paths import Artifact
from pita.core.schema import (
    GRPOConfig,
    GRPOHFConfig,
    PreferenceConfig,
    ReferenceConfig,
    ValueGuidedConfig,
    ValueGuidedHFConfig,
)

# The wildcard algorithm name: stage_overrides.any.<stage>, and shared tasks (pretrain).
ANY = "any"

# The models a stage can hold (`Held.model`). The estimate sizes each from a checkpoint of
# the family (pita/experiment/estimates.py CHECKPOINT_OF): the policy and π_ref from the
# reference, the value model and the proxy reward model from the guide.
MODEL_ROLES = ("policy", "reference", "value", "reward")
# What the stage does with it: sample from it, score with it (no grad), train it (gradients
# + AdamW state), or only keep its weights resident.
MODEL_USES = ("generate", "forward", "train", "weights")


@dataclass(frozen=True)
class Held:
    """One model a stage holds and what it does with it: what its memory estimate counts."""

    model: str  # one of MODEL_ROLES
    use: str  # one of MODEL_USES
    from_round: int = 0  # held from this round on (round 0's roll-ins have no guide yet)
    atoms_head: bool = False  # its head has `algos.<NAME>.num_atoms` outputs, not the vocabulary
    sequences: int = 1  # sequences per example of a training micro-batch (2: a preference pair)

    def __post_init__(self) -> None:
        if self.model not in MODEL_ROLES or self.use not in MODEL_USES:
            raise ValueError(
                f"Held({self.model!r}, {self.use!r}): model must be one of {MODEL_ROLES}, "
                f"use one of {MODEL_USES}"
            )


@dataclass(frozen=True)
class Algorithm:
    name: str  # as in config (`algos.<NAME>`) and in the results' `algo` column
    round_stages: tuple[str, ...]  # the stages of one round, in order
    functions: Mapping[str, str] = field(default_factory=dict)  # stage -> "module:function"
    guided: bool = False  # evaluated as π_ref guided by the round's value model, at every η
    single_round: bool = False  # planned once, whatever rounds_of_training says (reference)
    # What each of its own functions leaves in its task folder besides result.json and
    # log.txt (stage -> Artifact names; a name is a file, or a folder holding at least one
    # file). Shared stages declare theirs in SHARED_OUTPUTS.
    outputs: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # The models each stage of a round holds (stage -> Held...): what the memory estimate of
    # its tasks counts. A stage without an entry gets no size-based estimate.
    models: Mapping[str, tuple[Held, ...]] = field(default_factory=dict)
    is_reference: bool = False  # evaluates π_ref itself, once per sampling rule (no training)
    schema: type = ReferenceConfig  # its `algos.<NAME>` keys (pita/core/schema.py)
    # Stages that train on a gang through `pita.runtime.gang.run_stage` (pita's own loops,
    # and the TRL stages whose ranks are accelerate's processes): with
    # `training.parallel_strategy` data_parallel / fsdp the planner gives them a gang.
    gang_stages: tuple[str, ...] = ()
    # Of `gang_stages`, those that train with a TRL Trainer (their ranks are accelerate's
    # processes): no FSDP off CUDA, and the gang's k divides the batch (pita/experiment/gangs.py).
    trl_stages: tuple[str, ...] = ()
    # Of `gang_stages`, those whose checkpoints resume on any k with the numbers of an
    # uninterrupted run: growth may restart them on more ranks (pita/core/growth.py; why
    # each row's are, or are not, at `GROWTH` below).
    growable_stages: tuple[str, ...] = ()

    @property
    def schema_path(self) -> str:
        """ "module:Class" of `schema`: how a task names it to its worker (`ctx.algo`)."""
        return f"{self.schema.__module__}:{self.schema.__qualname__}"


# GROWTH: the stages whose checkpoints resume on any k with the numbers of an uninterrupted run.
# - pita's own loops (pretrain, the value trainer): full-state checkpoints (pita/training/ddp.py
#   `FullState`; tests/test_growth.py);
# - DPO / RPO training, GRPO / GRPO-HF training and the proxy reward model of the -HF
#   variants, from the Trainer's own checkpoint (`resume_from_checkpoint`: model, optimizer,
#   step). accelerate's seedable sampler deals the same batches at any k (whole global batches
#   only: `trl_common.whole_batches`; GRPO's sampler takes whole groups) and the Trainer skips
#   the seen ones; they draw no random numbers of the process (TRL's `disable_dropout`; GRPO
#   samples each completion from its own seed of prompt, step and place in its group,
#   `grpo._row_seeds`, not from the rank's stream seeded seed + rank), so the per-rank RNG
#   files a checkpoint of another k lacks do not matter. pita adds the gang's loss sums and
#   TRL's unlogged metrics to the checkpoint and logs the last step (pita/algos/trl_common.py).
#   Measured (DPO and the reward model, 1 rank stopped, resumed on 2 and stopped, resumed on
#   2): every logged value, the result and the weights within 1.2e-7 of one process' run;
#   without those additions DPO's first log after a stop was off (loss by 2.6e-3, TRL's reward
#   accuracy by 0.25) and so was train_loss (1.4e-3):
#   tests/test_trl_gang.py::test_trl_stages_stopped_and_resumed_on_other_ranks_match_an_uninterrupted_run
#   (GRPO in the same test; RPO is DPO's stage with an SFT term, GRPO-HF's train GRPO's with
#   another reward: not run separately). Before GRPO's completions were seeded per row, 2 of
#   4 steps on 1 rank and the rest on 2 ended with weights 0.026 apart and the last logged KL
#   1.49 against 1.14 (issue 45).

# Stages every chain shares unless an algorithm names its own function.
SHARED_FUNCTIONS: dict[str, str] = {
    "pretrain": "pita.stages.pretrain:pretrain",
    "evaluate": "pita.stages.evaluate:evaluate_shard",
    "evaluate_merge": "pita.stages.evaluate:evaluate_merge",
    "collect_merge": "pita.stages.collect:collect_merge",
}

# What the shared functions leave in their folders (as Algorithm.outputs).
SHARED_OUTPUTS: dict[str, tuple[str, ...]] = {
    "pretrain": (Artifact.MODEL,),
    "evaluate": (Artifact.SAMPLES,),
    "evaluate_merge": (Artifact.METRICS,),
    "collect_merge": (Artifact.STATS,),
}
# The models of the shared stages outside any round (as Algorithm.models).
SHARED_MODELS: dict[str, tuple[Held, ...]] = {"pretrain": (Held("reference", "train"),)}
# The shared stages that grow (as Algorithm.growable_stages; pretrain is pita's own loop).
SHARED_GROWABLE: tuple[str, ...] = ("pretrain",)

_VALUE_ROUND = ("collect", "train", "evaluate")
_HF_ROUND = ("collect", "reward_model", "train", "evaluate")
_REWARD_MODEL = "pita.algos.reward_model:train_reward_model"

_VALUE_OUTPUTS = {"collect": (Artifact.RECORDS,), "train": (Artifact.VALUE_MODEL,)}
_POLICY_OUTPUTS = {"collect": (Artifact.PAIRS,), "train": (Artifact.MODEL,)}
_REWARD_OUTPUTS = {"reward_model": (Artifact.REWARD_MODEL,)}

# Value-guided rows: roll-ins from π_ref (guided by the previous round's value model from
# round 1 on), a value model trained beside π_ref's resident weights, evaluation of π_ref
# guided by the value model.
_VALUE_MODELS: dict[str, tuple[Held, ...]] = {
    "collect": (Held("reference", "generate"), Held("value", "forward", from_round=1)),
    "train": (Held("reference", "weights"), Held("value", "train", atoms_head=True)),
    "evaluate": (Held("reference", "generate"), Held("value", "forward")),
}
# Policy-optimisation rows: roll-ins from π_ref, the policy trained on preference pairs
# against a frozen π_ref, evaluation of the trained policy.
_POLICY_MODELS: dict[str, tuple[Held, ...]] = {
    "collect": (Held("reference", "generate"),),
    "train": (Held("policy", "train", sequences=2), Held("reference", "forward", sequences=2)),
    "evaluate": (Held("policy", "generate"),),
}
# GRPO's train also samples its groups from the policy.
_GRPO_TRAIN = (*_POLICY_MODELS["train"], Held("policy", "generate"))


def _value_guided(name: str, module: str) -> Algorithm:
    """A value-guided row (PITA, Q#): `module`'s collect and train, its value model trained
    on a gang (pita's own loop: grows at a checkpoint)."""
    return Algorithm(
        name,
        _VALUE_ROUND,
        {"collect": f"{module}:collect", "train": f"{module}:train"},
        guided=True,
        outputs=_VALUE_OUTPUTS,
        models=_VALUE_MODELS,
        schema=ValueGuidedConfig,
        gang_stages=("train",),
        growable_stages=("train",),
    )


def _preference(name: str) -> Algorithm:
    """A row of DPO's stages (DPO, RPO: the same trainer; `sft_weight` tells them apart)."""
    return Algorithm(
        name,
        _VALUE_ROUND,
        {"collect": "pita.algos.dpo:collect", "train": "pita.algos.dpo:train"},
        outputs=_POLICY_OUTPUTS,
        models=_POLICY_MODELS,
        schema=PreferenceConfig,
        gang_stages=("train",),
        trl_stages=("train",),
        growable_stages=("train",),
    )


# Insertion order is the report's row order.
ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        Algorithm(
            "reference",
            ("evaluate",),
            single_round=True,
            models={"evaluate": (Held("reference", "generate"),)},
            is_reference=True,
            schema=ReferenceConfig,
        ),
        # value-guided decoding (pita/algos/qsharp.py, pita_algo.py, qsharp_hf.py)
        _value_guided("PITA", "pita.algos.pita_algo"),
        _value_guided("QSharp", "pita.algos.qsharp"),
        Algorithm(
            "QSharp-HF",
            _HF_ROUND,
            {
                "collect": "pita.algos.qsharp_hf:collect",
                "reward_model": _REWARD_MODEL,
                "train": "pita.algos.qsharp_hf:train",
            },
            guided=True,
            outputs={
                **_VALUE_OUTPUTS,
                **_REWARD_OUTPUTS,
                "collect": (Artifact.RECORDS, Artifact.PAIRS),
            },
            # the reward model counted as the estimate always counted it here (a value-sized
            # head, one sequence per example); GRPO-HF's row counts the same reward model
            # with the vocabulary and pairs. Kept apart so that no plan changes.
            models={**_VALUE_MODELS, "reward_model": (Held("reward", "train", atoms_head=True),)},
            schema=ValueGuidedHFConfig,
            gang_stages=("reward_model", "train"),
            trl_stages=("reward_model",),
            growable_stages=("reward_model", "train"),
        ),
        # policy-optimisation baselines with TRL (pita/algos/dpo.py, grpo.py)
        # DPO is plain DPO (`sft_weight: 0`, as the papers ran it); RPO is the same trainer with
        # an SFT term on the chosen responses (`sft_weight: 1`, TRL's sigmoid+sft): two rows so
        # that neither is reported under the other's name
        _preference("DPO"),
        _preference("RPO"),
        Algorithm(
            "GRPO",
            ("train", "evaluate"),
            {"train": "pita.algos.grpo:train"},
            outputs={"train": (Artifact.MODEL,)},
            models={"train": _GRPO_TRAIN, "evaluate": _POLICY_MODELS["evaluate"]},
            schema=GRPOConfig,
            gang_stages=("train",),
            trl_stages=("train",),
            growable_stages=("train",),
        ),
        Algorithm(
            "GRPO-HF",
            _HF_ROUND,
            {
                "collect": "pita.algos.dpo:collect",
                "reward_model": _REWARD_MODEL,
                "train": "pita.algos.grpo:train_hf",
            },
            outputs={**_POLICY_OUTPUTS, **_REWARD_OUTPUTS},
            models={
                **_POLICY_MODELS,
                "reward_model": (Held("reward", "train", sequences=2),),
                # GRPO's, plus the proxy reward model scoring the groups
                "train": (*_GRPO_TRAIN, Held("reward", "forward", sequences=2)),
            },
            schema=GRPOHFConfig,
            gang_stages=("reward_model", "train"),
            trl_stages=("reward_model", "train"),
            growable_stages=("reward_model", "train"),
        ),
    )
}


# --- algorithms and datasets of your own package, without editing pita ---------------------
# A package declares entry points (docs/extending.md): `pita_algorithms` entries load to an
# `Algorithm` row (or a list of them); `pita_datasets` entries (read by pita/datasets) name a
# module with `validate_cfg` and `build`. Algorithms are read here, once, while this table is
# built, so every list derived from it below (names, guided rows, schemas) and
# every process that imports it (the orchestrator, each worker, a Ray or SLURM node with the
# package installed) sees the same algorithms.
PLUGIN_ALGORITHMS = "pita_algorithms"


def _plugins() -> None:
    """Add the rows of every `pita_algorithms` entry point; one that fails to import, or
    gives something else than Algorithm rows with new names, is one WARNING and skipped
    (pita/core/plugins.py): an installed package never breaks pita's other commands."""
    from importlib.metadata import entry_points

    from pita.core import plugins
    from pita.core.schema import ALGO_SCHEMAS

    for ep in entry_points(group=PLUGIN_ALGORITHMS):
        rows = plugins.load(PLUGIN_ALGORITHMS, ep)
        rows = [] if rows is None else rows if isinstance(rows, (list, tuple)) else [rows]
        bad = [
            r for r in rows if not isinstance(r, Algorithm) or r.name in ALGORITHMS or r.name == ANY
        ]
        if bad:
            plugins.skip(
                PLUGIN_ALGORITHMS,
                ep,
                f"must give Algorithm rows with new names (taken: {', '.join(ALGORITHMS)})",
            )
            continue
        for row in rows:
            assert isinstance(row, Algorithm)  # `bad` refused every other kind
            ALGORITHMS[row.name] = row
            if row.schema not in ALGO_SCHEMAS.values():  # conf/algo yaml: defaults [<name>]
                ALGO_SCHEMAS[f"{row.name}_schema"] = row.schema


BUILTIN_NAMES: tuple[str, ...] = tuple(ALGORITHMS)  # pita's own: conf/config.yaml has each
_plugins()
ALGO_NAMES: tuple[str, ...] = tuple(ALGORITHMS)
GUIDED: tuple[str, ...] = tuple(name for name, a in ALGORITHMS.items() if a.guided)
REFERENCE: tuple[str, ...] = tuple(name for name, a in ALGORITHMS.items() if a.is_reference)

# Tasks outside any algorithm's chain (test_parallel_setup.py's device check).
EXTRA_FUNCTIONS: dict[tuple[str, str], str] = {
    ("diagnostic", "device_check"): "pita.stages.diagnostic:device_check",
}


def lookup(
    algo: str, stage: str, overrides: Mapping[str, Mapping[str, str]] | None = None
) -> str | None:
    """The dotted path for (algo, stage), or None if no implementation is registered.

    Precedence: an override for this algorithm, an override for `any`, the algorithm's
    own function, the shared function of the stage."""
    overrides = overrides or {}
    for key in (algo, ANY):
        if stage in overrides.get(key, {}):
            return overrides[key][stage]
    if (algo, stage) in EXTRA_FUNCTIONS:
        return EXTRA_FUNCTIONS[(algo, stage)]
    own = ALGORITHMS[algo].functions.get(stage) if algo in ALGORITHMS else None
    return own or SHARED_FUNCTIONS.get(stage)


def stage_outputs(
    algo: str, stage: str, overrides: Mapping[str, Mapping[str, str]] | None = None
) -> tuple[str, ...]:
    """What the task folder of (algo, stage) must hold besides result.json and log.txt: the
    worker refuses to commit a folder without them and resume redoes a folder whose manifest
    lacks one. They are the stage's contract: a function plugged in with
    executor.stage_overrides must write them too (one that writes nothing fails its task
    instead of leaving a run without results)."""
    if lookup(algo, stage, overrides) is None or (algo, stage) in EXTRA_FUNCTIONS:
        return ()
    row = ALGORITHMS.get(algo)
    if row is not None and stage in row.functions:
        return tuple(row.outputs.get(stage, ()))
    return SHARED_OUTPUTS.get(stage, ())


def stage_models(algo: str, stage: str, round_idx: int) -> tuple[Held, ...]:
    """The models a task of (algo, stage) holds in round `round_idx` (the estimate's input)."""
    row = ALGORITHMS.get(algo)
    held = row.models.get(stage) if row is not None else None
    if held is None:
        held = SHARED_MODELS.get(stage, ())
    return tuple(h for h in held if round_idx >= h.from_round)


def _own_function(algo: str, stage: str, fn: str) -> Algorithm | None:
    """The row of `algo` when `fn` is its own (or the shared) function of `stage`: a
    function put in by executor.stage_overrides is none of the row's business."""
    row = ALGORITHMS.get(algo)
    own = row.functions.get(stage) if row is not None else None
    if fn != (own or SHARED_FUNCTIONS.get(stage)):
        return None
    return row if row is not None and own is not None else _SHARED_ROW


def runs_trl(algo: str, stage: str, fn: str) -> bool:
    """Whether the task (algo, stage, fn) trains with a TRL Trainer (its row's `trl_stages`)."""
    row = _own_function(algo, stage, fn)
    return row is not None and stage in row.trl_stages


def can_grow(algo: str, stage: str, fn: str) -> bool:
    """Whether its checkpoints resume on any k (its row's `growable_stages`; GROWTH above)."""
    row = _own_function(algo, stage, fn)
    return row is not None and stage in row.growable_stages


# the shared stages' columns, as a row (pretrain: pita's own loop, grows; no TRL stage)
_SHARED_ROW = Algorithm(ANY, (), growable_stages=SHARED_GROWABLE)


def is_importable(dotted: str) -> bool:
    """True when the module of 'module:function' can be found, without running any of its
    packages' code (find_spec on `pkg.mod` would import `pkg`: config is code)."""
    from pita.core.tasks import module_exists

    return module_exists(dotted.partition(":")[0])
