"""Buffer filters: which queued groups a training lease gets, and in what order.

A filter is named by import path in the buffer's own settings (`buffer_filter`, e.g.
"rlmesh.buffer.filters:highest_reward_variance_first"), never by a request. It is a
plain function

    def my_filter(groups: list[QueuedGroup]) -> list[QueuedGroup]

that receives the queued groups (oldest first, up to the `filter_window` setting) and
returns those a lease may take, best first; the buffer takes from the front until the
batch is full (whole groups, by the lease's num_groups or num_samples). Groups it leaves
out stay queued. The filter sees summaries, not the sample arrays (the buffer never
decodes those). The default, `fifo` (first in, first out), is served by a faster path.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass

from rlmesh.common.errors import InvalidArgument
from rlmesh.common.plugins import load_plugin

BufferFilter = Callable[[list["QueuedGroup"]], list["QueuedGroup"]]
# Bounds of a lease's min_groups_by_dataset (a run's environments: at most 4096 of them).
MAX_MINIMUMS, MAX_DATASET_NAME = 4096, 256


@dataclass(frozen=True)
class QueuedGroup:
    group_id: str
    group_index: int
    dataset: str
    num_samples: int
    oldest_weight_version: int  # -1 when its samples carry no weight versions
    rewards: tuple[float, ...]
    position: int  # 0 = oldest in the queue


def encode_meta(
    num_samples: int, oldest_weight_version: int, group_index: int, dataset: str, rewards: list[float]
) -> str:
    """The per-group summary stored beside the bytes (see rlmesh.buffer.scripts)."""
    # formatted by hand: json.dumps of a whole dict costs more than the rest of a write
    extra = f'{{"i":{group_index},"d":{json.dumps(dataset)},"r":{json.dumps(rewards)}}}'
    return f"{num_samples} {oldest_weight_version} {extra}"


def decode_meta(group_id: str, raw: bytes | None, position: int) -> QueuedGroup:
    if raw is None:
        return QueuedGroup(group_id, -1, "", 1, -1, (), position)
    n, v, extra = raw.decode().split(" ", 2)
    d = json.loads(extra)
    return QueuedGroup(group_id, d["i"], d["d"], int(n), int(v), tuple(d["r"]), position)


def fifo(groups: list[QueuedGroup]) -> list[QueuedGroup]:
    """First in, first out (the default)."""
    return groups


def highest_reward_variance_first(groups: list[QueuedGroup]) -> list[QueuedGroup]:
    """Groups whose rewards vary most first (they carry the most learning signal for
    group-relative advantages; an all-equal group gives none); ties oldest first."""

    def priority(g: QueuedGroup) -> float:
        if not g.rewards:
            return 0.0
        mean = sum(g.rewards) / len(g.rewards)
        variance = sum((r - mean) ** 2 for r in g.rewards) / len(g.rewards)
        return -variance if math.isfinite(variance) else math.inf  # a NaN reward: last

    return sorted(groups, key=lambda g: (priority(g), g.position))


def with_minimums(groups: list[QueuedGroup], minimums: dict[str, int]) -> list[QueuedGroup]:
    """Atropos's batch with minimum allocations: the first `minimums[d]` groups of each named
    dataset d (in the given order), then the rest in the given order; [] (no batch yet) while
    some dataset has fewer groups queued than its minimum. The lease takes from the front, so
    with num_groups >= sum(minimums) every minimum is in the batch."""
    chosen: set[str] = set()
    for dataset, least in minimums.items():
        own = [g.group_id for g in groups if g.dataset == dataset][: max(least, 0)]
        if len(own) < least:
            return []
        chosen.update(own)
    # (the minimums first, each part in the given order)
    return [g for g in groups if g.group_id in chosen] + [g for g in groups if g.group_id not in chosen]


def check_minimums(minimums: dict[str, int], num_groups: int) -> dict[str, int]:
    """A lease's minimums checked (InvalidArgument naming what is wrong), the zeros left out."""
    if not minimums:
        return {}
    if not num_groups:
        raise InvalidArgument("min_groups_by_dataset needs num_groups (a batch counted in groups)")
    if len(minimums) > MAX_MINIMUMS or any(len(name) > MAX_DATASET_NAME for name in minimums):
        raise InvalidArgument(
            f"min_groups_by_dataset: at most {MAX_MINIMUMS} datasets, names of at most {MAX_DATASET_NAME} characters"
        )
    if any(n < 0 for n in minimums.values()) or sum(minimums.values()) > num_groups:
        raise InvalidArgument(
            f"min_groups_by_dataset: each minimum must be >= 0 and they must add up to at most num_groups "
            f"({num_groups}); got {sum(minimums.values())}"
        )
    return {name: n for name, n in minimums.items() if n > 0}


def load_filter(path: str) -> BufferFilter | None:
    """The filter a `buffer_filter` setting names; None for `fifo` (the store's fast path)."""
    fn = load_plugin(path)
    return None if fn is fifo else fn
