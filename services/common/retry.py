"""Riding out a peer's outage: a call retried with exponential backoff and jitter while
its failures are transient (a peer restarting, frozen or briefly unreachable), for at
most an outage budget; then it fails naming the service. One helper for every caller."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc

from rlmesh.common.errors import Unavailable

T = TypeVar("T")

# What a restarted, frozen or unreachable peer answers. CANCELLED reaches a client as an
# AioRpcError only when the server side cancelled (a peer shutting down); our own
# cancellation is asyncio.CancelledError and is never retried.
TRANSIENT_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED})


class OutageTooLong(Unavailable):
    """A service stayed unreachable longer than the caller's outage budget."""


@dataclass(frozen=True)
class Backoff:
    base_seconds: float = 0.5
    max_seconds: float = 10.0

    def ceiling(self, retry: int) -> float:
        """The longest delay before retry number `retry` (1, 2, ...): doubling, capped."""
        return min(self.max_seconds, self.base_seconds * 2 ** (retry - 1))

    def delay(self, retry: int, uniform: Callable[[float, float], float] = random.uniform) -> float:
        """Jittered in [ceiling / 2, ceiling], so many callers do not retry in lockstep."""
        ceiling = self.ceiling(retry)
        return uniform(ceiling / 2, ceiling)


def transient_grpc_error(e: BaseException) -> str | None:
    """'CODE: details' when `e` is a gRPC failure worth retrying, else None."""
    if isinstance(e, grpc.aio.AioRpcError) and e.code() in TRANSIENT_CODES:
        return f"{e.code().name}: {e.details()}"
    return None


async def retry(
    call: Callable[[], Awaitable[T]],
    *,
    service: str,
    budget_seconds: float,
    transient: Callable[[BaseException], str | None] = transient_grpc_error,
    on_wait: Callable[[str], Awaitable[None]] | None = None,
    backoff: Backoff = Backoff(),
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    uniform: Callable[[float, float], float] = random.uniform,
) -> T:
    """`call()`, again after each transient failure (`transient(e)` says why, or None for
    an error to raise at once) until `budget_seconds` have passed since the first failure;
    then OutageTooLong naming `service`. `on_wait(reason)` runs before each backoff sleep
    (e.g. to show what a run waits for; it may raise to give up)."""
    first_failure: float | None = None
    retries = 0
    while True:
        try:
            return await call()
        except Exception as e:
            reason = transient(e)
            if reason is None:
                raise
            now = clock()
            first_failure = now if first_failure is None else first_failure
            retries += 1
            delay = backoff.delay(retries, uniform)
            waited = now - first_failure
            if waited + delay > budget_seconds:
                raise OutageTooLong(
                    f"{service} did not recover within the outage budget of {budget_seconds:g} s "
                    f"({retries} tries over {waited:.0f} s); last error: {reason}"
                ) from None
            if on_wait is not None:
                await on_wait(f"waiting for {service}: {reason} (retry {retries}, {waited:.0f} s so far)")
            await sleep(delay)
