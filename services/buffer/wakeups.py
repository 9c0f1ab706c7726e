"""Waking a waiting LeaseBatch when this replica queues groups for its run, so a trainer
gets its batch as soon as it is complete rather than at the next poll (up to 20 ms later).
Writes through another replica, and leases that expire, are still found by the poll."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator


class Wakeups:
    """Futures per run, resolved by notify(run_id). A waiter watches before it looks at the
    queue, so a write between its look and its wait still wakes it."""

    def __init__(self) -> None:
        self._waiters: dict[str, set[asyncio.Future]] = {}

    @contextlib.contextmanager
    def watch(self, run_id: str) -> Iterator[asyncio.Future]:
        """A future that notify(run_id) resolves, forgotten when the block ends."""
        future = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(run_id, set()).add(future)
        try:
            yield future
        finally:
            waiters = self._waiters.get(run_id)  # (a notify since took the set away)
            if waiters is not None:
                waiters.discard(future)
                if not waiters:
                    del self._waiters[run_id]

    def notify(self, run_id: str) -> None:
        for future in self._waiters.pop(run_id, ()):
            if not future.done():
                future.set_result(None)
