"""Per-example seeds: what an example draws never depends on the shard or batch it lands in.

A sharded stage (collect, evaluate) splits its examples over as many shards as the run has
devices. One random stream per shard would give example 7 different draws on 1 device than
on 4 (another seed, another position in the stream, other rows in its batch consuming
draws before it), so results would change with the device count. Instead every random
choice about one example (its sampled tokens, its roll-in cut, its Bradley–Terry draw) is
seeded by `example_seed(stage_seed, what, example, sample)`: the stage's seed
(`StageContext.seed`, shared by its shards) and the example's *global* index, never the
shard's. `pita.models.generation.generate(row_seeds=...)` gives each row its own stream.
"""

from __future__ import annotations

import hashlib


def example_seed(base: int, *key: int | str) -> int:
    """A seed in [0, 2**63) for the draws `key` names (e.g. `"roll-in", example, sample`)
    under the stage seed `base`: a hash, so neighbouring keys give unrelated streams and
    the value is the same in every process (unlike Python's `hash`)."""
    data = ":".join(str(part) for part in (base, *key)).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1
