"""My dataset: pita's goal walk, two steps long (the module pita imports by its full path)."""

from pita.datasets import goal_walk


def validate_cfg(cfg):
    return goal_walk.validate_cfg(cfg)


def build(cfg, tokenizer=None, **kw):
    return goal_walk.build({**dict(cfg), "walk_length": 2}, tokenizer, **kw)
