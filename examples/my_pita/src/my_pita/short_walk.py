"""My dataset: pita's goal walk, `length` steps long (default 2), the module pita imports by
its full path. `SCHEMA` declares the key pita's DatasetConfig lacks (`dataset.length`): a
dataclass subclassing DatasetConfig, its fields made with pita's `spec` (help, default,
range), registered as `dataset_schema/short_walk` for conf/dataset/short_walk.yaml's defaults."""

from dataclasses import dataclass

from pita.core.schema import DatasetConfig, spec
from pita.datasets import goal_walk
from pita.datasets.base import cfg_error


@dataclass
class ShortWalkConfig(DatasetConfig):
    length: int | None = spec("Steps of the walk (short_walk).", 2, ge=1, le=8)


SCHEMA = ShortWalkConfig


def validate_cfg(cfg):
    length = cfg.get("length", 2)
    errors = (
        []
        if isinstance(length, int) and 1 <= length <= 8
        else [cfg_error("length", length, "an integer in [1, 8]")]
    )
    rest = {k: v for k, v in cfg.items() if k != "length"}
    return errors + goal_walk.validate_cfg({**rest, "walk_length": length})


def build(cfg, tokenizer=None, **kw):
    rest = {k: v for k, v in dict(cfg).items() if k != "length"}
    return goal_walk.build({**rest, "walk_length": cfg.get("length", 2)}, tokenizer, **kw)
