"""A bounded in-process copy of the group bytes this replica stored, so a training lease
can answer without reading them back from Redis.

Redis stays the only state: the lease itself is decided there, and a group missing from
here (written through another replica, evicted, or after a restart) is read from Redis.
The copy can never be stale: a group's bytes never change under its id (writes are
idempotent, and an acknowledged or discarded id is never stored again), and entries are
keyed by the run's incarnation token, which changes when a run is deleted and created
again."""

from __future__ import annotations

from collections import OrderedDict


class GroupCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[str, str], bytes | memoryview] = OrderedDict()
        self._bytes = 0

    def put(self, token: str, group_id: str, data: bytes | memoryview) -> None:
        if self.max_bytes <= 0 or len(data) > self.max_bytes:
            return
        # A slice of a request's buffer would keep the whole request alive: copy it.
        data = bytes(data)
        key = (token, group_id)
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= len(old)
        self._entries[key] = data
        self._bytes += len(data)
        while self._bytes > self.max_bytes:  # oldest first: the queue is consumed in order
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= len(evicted)

    def pop(self, token: str, group_id: str) -> bytes | memoryview | None:
        data = self._entries.pop((token, group_id), None)
        if data is not None:
            self._bytes -= len(data)
        return data

    def __len__(self) -> int:
        return len(self._entries)
