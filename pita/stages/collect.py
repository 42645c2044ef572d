"""collect_merge: concatenate the record files of a sharded collect stage.

Every `*.jsonl` file a collect shard writes (e.g. `records.jsonl`, `pairs.jsonl`) is
concatenated, shard by shard in order, into a file of the same name; numbers from each
shard's `result.json` are summed into `stats.json`.
"""

from __future__ import annotations

import json

from pita.core.paths import Artifact
from pita.runtime.context import StageContext


def collect_merge(ctx: StageContext) -> dict:
    """Merge the shards of a collect stage.

    Reads: every `*.jsonl` file and `result.json` of the `shards` inputs. Writes: each
    jsonl concatenated shard by shard in order, and `stats.json` with the shards'
    numbers summed. Assumes shards write the same file names.
    """
    counts: dict[str, int] = {}
    totals: dict[str, float] = {}
    handles = {}
    try:
        for shard in ctx.inputs("shards"):
            for src in sorted(shard.glob("*.jsonl")):
                if src.name not in handles:
                    handles[src.name] = open(ctx.out_dir / src.name, "w")
                with open(src) as f:
                    for line in f:
                        handles[src.name].write(line)
                        counts[src.name] = counts.get(src.name, 0) + 1
            result = json.loads((shard / Artifact.RESULT).read_text())
            for key, value in result.items():
                if (
                    isinstance(value, (int, float))
                    and not isinstance(value, bool)
                    and key != "attempt"
                ):
                    totals[key] = totals.get(key, 0) + value
    finally:
        for h in handles.values():
            h.close()
    (ctx.out_dir / Artifact.STATS).write_text(json.dumps({"records": counts, **totals}, indent=2))
    ctx.logger.info("merged %d shards: %s", len(ctx.inputs("shards")), counts)
    return {"records": counts}
