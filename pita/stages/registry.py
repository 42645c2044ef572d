"""Which function runs each (algorithm, stage): dotted paths, imported only in workers.

The algorithm issues add rows here; the planner never imports these modules (they load
torch), it only checks that the module file exists. `executor.stage_overrides` replaces
any entry from the command line ("QSharp.train" or "*.evaluate" -> "pkg.mod:function").
"""

from __future__ import annotations

from collections.abc import Mapping

# Rounds of each algorithm: the stages of one round, in order. The reference policy is
# evaluated once (round 0). `pretrain` is planned once per (dataset, family) when the
# family's models are built in the run (model.name=tiny).
ROUND_STAGES: dict[str, tuple[str, ...]] = {
    "reference": ("evaluate",),
    "QSharp": ("collect", "train", "evaluate"),
    "PITA": ("collect", "train", "evaluate"),
    "QSharp-HF": ("collect", "reward_model", "train", "evaluate"),
    "DPO": ("collect", "train", "evaluate"),
    "GRPO": ("train", "evaluate"),
    "GRPO-HF": ("collect", "reward_model", "train", "evaluate"),
}

# (algo, stage) -> "module:function"; "*" matches every algorithm.
STAGE_FUNCTIONS: dict[tuple[str, str], str] = {
    ("*", "pretrain"): "pita.stages.pretrain:pretrain",
    ("*", "evaluate"): "pita.stages.evaluate:evaluate_shard",
    ("*", "evaluate_merge"): "pita.stages.evaluate:evaluate_merge",
    ("*", "collect_merge"): "pita.stages.collect:collect_merge",
    # value-guided decoding (pita/algos/qsharp.py, pita_algo.py, qsharp_hf.py)
    ("QSharp", "collect"): "pita.algos.qsharp:collect",
    ("QSharp", "train"): "pita.algos.qsharp:train",
    ("PITA", "collect"): "pita.algos.pita_algo:collect",
    ("PITA", "train"): "pita.algos.pita_algo:train",
    ("QSharp-HF", "collect"): "pita.algos.qsharp_hf:collect",
    ("QSharp-HF", "reward_model"): "pita.algos.reward_model:train_reward_model",
    ("QSharp-HF", "train"): "pita.algos.qsharp_hf:train",
    # policy-optimisation baselines with TRL (pita/algos/dpo.py, grpo.py)
    ("DPO", "collect"): "pita.algos.dpo:collect",
    ("DPO", "train"): "pita.algos.dpo:train",
    ("GRPO", "train"): "pita.algos.grpo:train",
    ("GRPO-HF", "collect"): "pita.algos.dpo:collect",
    ("GRPO-HF", "reward_model"): "pita.algos.reward_model:train_reward_model",
    ("GRPO-HF", "train"): "pita.algos.grpo:train_hf",
    ("diagnostic", "device_check"): "pita.stages.diagnostic:device_check",
}

# What each stage function leaves in its task folder besides result.json and log.txt (a
# name is a file, or a folder holding at least one file). The worker refuses to commit a
# folder without them and resume redoes a folder whose manifest lacks one. A function
# plugged in with executor.stage_overrides declares nothing.
STAGE_OUTPUTS: dict[str, tuple[str, ...]] = {
    "pita.stages.pretrain:pretrain": ("model",),
    "pita.stages.evaluate:evaluate_shard": ("samples.jsonl",),
    "pita.stages.evaluate:evaluate_merge": ("metrics.json",),
    "pita.stages.collect:collect_merge": ("stats.json",),
    "pita.algos.qsharp:collect": ("records.jsonl",),
    "pita.algos.qsharp:train": ("value_model",),
    "pita.algos.pita_algo:collect": ("records.jsonl",),
    "pita.algos.pita_algo:train": ("value_model",),
    "pita.algos.qsharp_hf:collect": ("records.jsonl", "pairs.jsonl"),
    "pita.algos.qsharp_hf:train": ("value_model",),
    "pita.algos.reward_model:train_reward_model": ("reward_model",),
    "pita.algos.dpo:collect": ("pairs.jsonl",),
    "pita.algos.dpo:train": ("model",),
    "pita.algos.grpo:train": ("model",),
    "pita.algos.grpo:train_hf": ("model",),
}


def lookup(algo: str, stage: str, overrides: Mapping[str, Mapping[str, str]] | None = None) -> str | None:
    """The dotted path for (algo, stage), or None if no implementation is registered."""
    overrides = overrides or {}
    for key in (algo, "any"):
        if stage in overrides.get(key, {}):
            return overrides[key][stage]
    return STAGE_FUNCTIONS.get((algo, stage)) or STAGE_FUNCTIONS.get(("*", stage))


def is_importable(dotted: str) -> bool:
    """True when the module of 'module:function' can be found, without running any of its
    packages' code (find_spec on `pkg.mod` would import `pkg`: config is code)."""
    from pita.core.tasks import module_exists

    return module_exists(dotted.partition(":")[0])
