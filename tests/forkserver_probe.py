"""What a process forked from pita's forkserver holds before it imports anything itself
(tests/test_forked_workers.py). Imports nothing heavy: what it finds loaded, the server
loaded."""

from __future__ import annotations

import sys


def loaded(names: list[str]) -> list[str]:
    """The modules of `names` this process already holds."""
    return [n for n in names if n in sys.modules]
