"""A stand-in for pita.runtime.worker in tests/test_forked_workers.py: forked from the
forkserver exactly as a worker is (pita.core.forked_worker._forked_child), it writes what
the three global generators draw and leaves."""

from __future__ import annotations

import json
import os
import random
import sys


def main(argv: list[str], authkey: bytes | None = None) -> int:
    import numpy
    import torch

    draws = {
        "python": [random.random() for _ in range(4)],
        "numpy": numpy.random.rand(4).tolist(),
        "torch": torch.rand(4).tolist(),
    }
    with open(argv[0], "w") as f:
        json.dump(draws, f)
    return 0


def leave(code: int) -> None:
    sys.stdout.flush()
    os._exit(code)
