"""Stopping a background task for sure."""

from __future__ import annotations

import asyncio

RECANCEL_SECONDS = 1.0


async def cancel_and_wait(task: asyncio.Future, recancel_seconds: float = RECANCEL_SECONDS) -> None:
    """Cancel `task` and wait until it has ended (how it ended is dropped).

    A cancellation can be lost: when the task awaits another task that catches it and returns
    (grpc.aio's calls do, when their answer arrives as the cancellation lands), the task gets
    that result instead of CancelledError, and a loop in it goes on. Awaited once, such a task
    is waited for forever (a fully_async run hung at its end so); here it is cancelled again
    every `recancel_seconds` until it ends."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=recancel_seconds)
    if not task.cancelled():
        task.exception()  # (retrieved, so asyncio does not log it as never retrieved)
