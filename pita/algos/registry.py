"""The one table of algorithms: their names, the stages of a round, and the function of each.

Everything that needs to know "which algorithms exist" reads `ALGORITHMS`: the config
schema (`algos.<NAME>` must be a row), the planner (stages of a round, which function
runs each), evaluate (which rows are guided decoding), the report (row order) and the
tests. Adding an algorithm = one row here + `conf/algo/<name>.yaml` + its defaults line
in `conf/config.yaml` (a test checks the two agree).

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


@dataclass(frozen=True)
class Algorithm:
    name: str  # as in config (`algos.<NAME>`) and in the results' `algo` column
    round_stages: tuple[str, ...]  # the stages of one round, in order
    functions: Mapping[str, str] = field(default_factory=dict)  # stage -> "module:function"
    guided: bool = False  # evaluated as π_ref guided by the round's value model, at every η
    single_round: bool = False  # planned once, whatever rounds_of_training says (reference)
    schema: type = ReferenceConfig  # its `algos.<NAME>` keys (pita/core/schema.py)


# Stages every chain shares unless an algorithm names its own function.
SHARED_FUNCTIONS: dict[str, str] = {
    "pretrain": "pita.stages.pretrain:pretrain",
    "evaluate": "pita.stages.evaluate:evaluate_shard",
    "evaluate_merge": "pita.stages.evaluate:evaluate_merge",
    "collect_merge": "pita.stages.collect:collect_merge",
}

_VALUE_ROUND = ("collect", "train", "evaluate")
_HF_ROUND = ("collect", "reward_model", "train", "evaluate")
_REWARD_MODEL = "pita.algos.reward_model:train_reward_model"

# Insertion order is the report's row order.
ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        Algorithm("reference", ("evaluate",), single_round=True, schema=ReferenceConfig),
        # value-guided decoding (pita/algos/qsharp.py, pita_algo.py, qsharp_hf.py)
        Algorithm(
            "PITA",
            _VALUE_ROUND,
            {"collect": "pita.algos.pita_algo:collect", "train": "pita.algos.pita_algo:train"},
            guided=True,
            schema=ValueGuidedConfig,
        ),
        Algorithm(
            "QSharp",
            _VALUE_ROUND,
            {"collect": "pita.algos.qsharp:collect", "train": "pita.algos.qsharp:train"},
            guided=True,
            schema=ValueGuidedConfig,
        ),
        Algorithm(
            "QSharp-HF",
            _HF_ROUND,
            {
                "collect": "pita.algos.qsharp_hf:collect",
                "reward_model": _REWARD_MODEL,
                "train": "pita.algos.qsharp_hf:train",
            },
            guided=True,
            schema=ValueGuidedHFConfig,
        ),
        # policy-optimisation baselines with TRL (pita/algos/dpo.py, grpo.py)
        # DPO is plain DPO (`sft_weight: 0`, as the papers ran it); RPO is the same trainer with
        # an SFT term on the chosen responses (`sft_weight: 1`, TRL's sigmoid+sft): two rows so
        # that neither is reported under the other's name
        Algorithm(
            "DPO",
            _VALUE_ROUND,
            {"collect": "pita.algos.dpo:collect", "train": "pita.algos.dpo:train"},
            schema=PreferenceConfig,
        ),
        Algorithm(
            "RPO",
            _VALUE_ROUND,
            {"collect": "pita.algos.dpo:collect", "train": "pita.algos.dpo:train"},
            schema=PreferenceConfig,
        ),
        Algorithm(
            "GRPO", ("train", "evaluate"), {"train": "pita.algos.grpo:train"}, schema=GRPOConfig
        ),
        Algorithm(
            "GRPO-HF",
            _HF_ROUND,
            {
                "collect": "pita.algos.dpo:collect",
                "reward_model": _REWARD_MODEL,
                "train": "pita.algos.grpo:train_hf",
            },
            schema=GRPOHFConfig,
        ),
    )
}
ALGO_NAMES: tuple[str, ...] = tuple(ALGORITHMS)
GUIDED: tuple[str, ...] = tuple(name for name, a in ALGORITHMS.items() if a.guided)

# Tasks outside any algorithm's chain (test_parallel_setup.py's device check).
EXTRA_FUNCTIONS: dict[tuple[str, str], str] = {
    ("diagnostic", "device_check"): "pita.stages.diagnostic:device_check",
}

# What each stage function leaves in its task folder besides result.json and log.txt (a
# name is a file, or a folder holding at least one file). The worker refuses to commit a
# folder without them and resume redoes a folder whose manifest lacks one. A function
# plugged in with executor.stage_overrides declares nothing.
STAGE_OUTPUTS: dict[str, tuple[str, ...]] = {
    "pita.stages.pretrain:pretrain": (Artifact.MODEL,),
    "pita.stages.evaluate:evaluate_shard": (Artifact.SAMPLES,),
    "pita.stages.evaluate:evaluate_merge": (Artifact.METRICS,),
    "pita.stages.collect:collect_merge": (Artifact.STATS,),
    "pita.algos.qsharp:collect": (Artifact.RECORDS,),
    "pita.algos.qsharp:train": (Artifact.VALUE_MODEL,),
    "pita.algos.pita_algo:collect": (Artifact.RECORDS,),
    "pita.algos.pita_algo:train": (Artifact.VALUE_MODEL,),
    "pita.algos.qsharp_hf:collect": (Artifact.RECORDS, Artifact.PAIRS),
    "pita.algos.qsharp_hf:train": (Artifact.VALUE_MODEL,),
    _REWARD_MODEL: (Artifact.REWARD_MODEL,),
    "pita.algos.dpo:collect": (Artifact.PAIRS,),
    "pita.algos.dpo:train": (Artifact.MODEL,),
    "pita.algos.grpo:train": (Artifact.MODEL,),
    "pita.algos.grpo:train_hf": (Artifact.MODEL,),
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


def is_importable(dotted: str) -> bool:
    """True when the module of 'module:function' can be found, without running any of its
    packages' code (find_spec on `pkg.mod` would import `pkg`: config is code)."""
    from pita.core.tasks import module_exists

    return module_exists(dotted.partition(":")[0])
