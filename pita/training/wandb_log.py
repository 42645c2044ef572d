"""Read an offline W&B run's `.wandb` file: which history steps reached the disk.

A retried task's attempts share one W&B run id; `wandb sync` replays their folders in
start-time order into one run, and W&B drops a step at or below the run's last one. So a
retry must start after the last step its dead attempts *wrote* (a killed attempt loses
what wandb had not flushed yet; a ledger of what was logged would over-count). wandb
(0.2x+) ships no Python reader for its transaction log, hence this one: the log is
LevelDB's format (32 KiB blocks; each record a 7-byte header: crc32, length, type; FULL,
or FIRST / MIDDLE... / LAST fragments), each record a `wandb_internal_pb2.Record`.
A torn last record (a killed writer) ends the read.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BLOCK = 32768
HEADER = 7  # crc32 (4) + length (2) + type (1); the file itself opens with a 7-byte header
FULL, LAST = 1, 4


def records(path: Path) -> Iterator[Any]:
    """The protobuf records of a `.wandb` file, in order, up to a torn one."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, chunks = path.read_bytes(), HEADER, []  # the file header: ":W&B", magic, version
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + HEADER])
        if left < HEADER or (length == 0 and kind == 0):  # block padding
            pos += left
            continue
        if pos + HEADER + length > len(data):  # a killed writer's torn last record
            return
        chunks.append(data[pos + HEADER : pos + HEADER + length])
        pos += HEADER + length
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(b"".join(chunks))
            chunks = []
            yield record


def history_steps(path: Path) -> list[int]:
    """The step of every history row written to a `.wandb` file."""
    steps = []
    for record in records(path):
        if record.WhichOneof("record_type") != "history":
            continue
        if record.history.HasField("step"):
            steps.append(int(record.history.step.num))
            continue
        for item in record.history.item:  # a writer without `step`: the `_step` item
            if (item.key or "/".join(item.nested_key)) == "_step":
                steps.append(int(json.loads(item.value_json)))
    return steps


def last_written_step(wandb_dir: Path, run_id: str) -> int | None:
    """The largest step any earlier attempt of run `run_id` wrote under `wandb_dir`
    (`<dir>/wandb/{offline-,}run-*-<id>/run-<id>.wandb`); None when there is none."""
    steps = [
        s
        for path in wandb_dir.glob(f"wandb/*-{run_id}/run-{run_id}.wandb")
        for s in history_steps(path)
    ]
    return max(steps) if steps else None
