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

from rlmesh.common.plugins import load_plugin

BufferFilter = Callable[[list["QueuedGroup"]], list["QueuedGroup"]]


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


def load_filter(path: str) -> BufferFilter | None:
    """The filter a `buffer_filter` setting names; None for `fifo` (the store's fast path)."""
    fn = load_plugin(path)
    return None if fn is fifo else fn
