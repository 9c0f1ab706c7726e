"""The buffer's wake-ups: a notify between a waiter's watch and its wait still wakes it,
and no run's entry outlives its waiters (the map stays as small as the waiting calls)."""

from __future__ import annotations

import asyncio

from rlmesh.buffer.wakeups import Wakeups


def test_a_notify_after_watch_wakes_the_waiter_and_nothing_is_left_behind():
    async def scenario():
        wakeups = Wakeups()
        with wakeups.watch("r1") as first, wakeups.watch("r1") as second, wakeups.watch("r2") as other:
            wakeups.notify("r1")  # before anyone waits: not lost
            await asyncio.wait_for(asyncio.gather(first, second), 1)
            assert not other.done()
            wakeups.notify("r1")  # nobody watching r1 any more: a no-op
        assert wakeups._waiters == {}

    asyncio.run(scenario())


def test_a_waiter_that_fails_or_times_out_is_forgotten():
    async def scenario():
        wakeups = Wakeups()
        try:
            with wakeups.watch("r1"):
                raise ValueError("the lease script failed")
        except ValueError:
            pass
        with wakeups.watch("r1") as future:
            await asyncio.wait({future}, timeout=0.01)
        assert wakeups._waiters == {}

    asyncio.run(scenario())
