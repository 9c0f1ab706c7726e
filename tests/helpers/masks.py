"""Reading loss masks in tests."""

from __future__ import annotations

import itertools


def mask_runs(mask: list[int]) -> list[tuple[int, int]]:
    """(mask value, length) of each run: [1, 1, 0, 1] -> [(1, 2), (0, 1), (1, 1)]."""
    return [(value, len(list(run))) for value, run in itertools.groupby(mask)]
