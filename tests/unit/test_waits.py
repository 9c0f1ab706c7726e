"""A service's current waits: what a caller holding a long call to it is told."""

from __future__ import annotations

import asyncio

from rlmesh.common.waits import FRESH_SECONDS, Waits


def test_a_wait_is_told_until_it_is_over_or_no_longer_renewed():
    now = [0.0]
    waits = Waits(clock=lambda: now[0])
    asyncio.run(waits.on_wait("the buffer")("waiting for the buffer (retry 1)"))
    now[0] = 1.0
    asyncio.run(waits.on_wait("the reward service")("waiting for the reward service (retry 1)"))
    assert waits.current() == ["waiting for the reward service (retry 1)", "waiting for the buffer (retry 1)"]
    waits.over("the reward service")
    assert waits.current() == ["waiting for the buffer (retry 1)"]
    now[0] = FRESH_SECONDS + 0.5  # the buffer's retries stopped renewing it (given up, say)
    assert waits.current() == []
