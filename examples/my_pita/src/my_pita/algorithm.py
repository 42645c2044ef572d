"""Copycat, my own algorithm for pita: π_ref copied as the round's trained policy (a
baseline whose rows must read like the reference's, KL ≈ 0).

The row is what pita's own algorithms have in pita/algos/registry.py. This module imports
only pita's registry-level names, never its stages: pita reads it while building its
table, in every process (docs/extending.md)."""

from pita.algos.registry import Algorithm, Held
from pita.core.paths import Artifact
from pita.core.schema import ReferenceConfig

COPYCAT = Algorithm(
    name="Copycat",
    round_stages=("train", "evaluate"),  # evaluate: pita's shared stage, on the train's model
    functions={"train": "my_pita.stages:copy_reference"},
    outputs={"train": (Artifact.MODEL,)},  # what the worker checks before it commits
    models={"train": (Held("reference", "weights"),), "evaluate": (Held("policy", "generate"),)},
    schema=ReferenceConfig,  # its algos.Copycat keys: enabled, ... (conf/algo/copycat.yaml)
)
