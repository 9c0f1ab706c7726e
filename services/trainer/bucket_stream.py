"""The order of a distributed weight push, bucket by bucket: each bucket's UpdateWeights
call (through the rollout service, to every engine) and rank 0's broadcast of it, the
buckets prepared (converted, flattened, delta-coded) in threads beside the broadcasts.

Over gloo, bucket k+1's call goes out as soon as bucket k's first broadcast has left rank
0: gloo's root finishes a broadcast only once every rank has posted its receive, so every
engine is inside bucket k's update then, and takes k+1's next (the engine's weight lock
queues it), its receive posted the moment k's ends: no trainer -> rollout -> engine round
trip between buckets. NCCL's root may finish first, so there each bucket is answered
before the next is requested. The answers are collected as they come, all of them before
the push returns.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from rlmesh.common import errors
from rlmesh.common.faults import fault_point
from rlmesh.v1 import rollout_pb2


@dataclass
class OutgoingBucket:
    """One bucket ready to go: its UpdateWeights request and the broadcast that goes with it."""

    request: rollout_pb2.UpdateWeightsRequest
    send: Callable[[Callable[[], None]], int]  # broadcasts; calls its argument once the first tensor left
    is_delta: bool


@dataclass
class BucketTiming:
    """When one bucket's broadcast started, its first tensor had left and all of it had
    left, in seconds since the push began."""

    index: int
    started: float
    first_sent: float
    finished: float


@dataclass
class BucketStream:
    buckets: int
    prepare: Callable[[int], OutgoingBucket | None]  # (in a thread) None: unchanged, skipped
    call: Callable[[str, rollout_pb2.UpdateWeightsRequest], Awaitable]
    abandon: Callable[[asyncio.Future | None], None]  # our broadcast may never complete: give up the group
    early: bool  # request bucket k+1 once bucket k's first tensor left (gloo)
    pending: list[asyncio.Future] = field(default_factory=list)  # calls not answered yet, oldest first
    ready: dict[int, asyncio.Future] = field(default_factory=dict)  # buckets being prepared
    sent_bytes: int = 0
    delta_buckets: int = 0  # sent as deltas or skipped unchanged
    timings: list[BucketTiming] = field(default_factory=list)
    sending: asyncio.Future | None = None  # our broadcast of the latest bucket

    async def run(self) -> None:
        try:
            await self._run()
        except BaseException:
            # Stopped part way, the group's ranks are out of step (an engine may be waiting
            # for a bucket never sent): it is not used again.
            self.abandon(self.sending)
            raise

    async def _run(self) -> None:
        origin = time.monotonic()
        # Two buckets are prepared ahead at most: bucket k+2 reuses bucket k's staging
        # buffer, so it is prepared only once bucket k has left rank 0.
        self._start(0)
        self._start(1)
        upcoming = await self._take(0)
        if upcoming is not None:
            self._request(*upcoming)
        while upcoming is not None:
            k, item = upcoming
            what = self._what(k)
            loop = asyncio.get_running_loop()
            began = time.monotonic()
            first: asyncio.Future = loop.create_future()

            def first_sent(first: asyncio.Future = first, loop: asyncio.AbstractEventLoop = loop) -> None:
                loop.call_soon_threadsafe(lambda: first.done() or first.set_result(time.monotonic()))

            mine = self.sending = asyncio.ensure_future(asyncio.to_thread(item.send, first_sent))
            upcoming = None
            if self.early:
                await self._watch(what, first, mine)
                upcoming = await self._take(k + 1)  # prepared meanwhile
                if upcoming is not None:
                    self._request(*upcoming)
                    await fault_point("trainer.mid_push")  # (bucket k on its way, k+1 asked for, not sent)
            self.sent_bytes += await self._watch(what, mine, mine)
            finished = time.monotonic()
            if not self.early:
                await self.all_answered()
                upcoming = await self._take(k + 1)
                if upcoming is not None:
                    self._request(*upcoming)
            self._start((upcoming[0] if upcoming else self.buckets) + 1)  # bucket k's staging is free
            sent_first = first.result() if first.done() else finished
            self.timings.append(BucketTiming(k, began - origin, sent_first - origin, finished - origin))
        await self.all_answered()

    async def all_answered(self) -> None:
        """Wait for every call not answered yet, oldest first (a failure is raised)."""
        for answer in self.pending:
            await answer
        self.pending.clear()

    def _what(self, k: int) -> str:
        return f"UpdateWeights bucket {k + 1}/{self.buckets}"

    def _start(self, k: int) -> None:
        if k < self.buckets and k not in self.ready:
            self.ready[k] = asyncio.ensure_future(asyncio.to_thread(self.prepare, k))

    async def _take(self, k: int) -> tuple[int, OutgoingBucket] | None:
        """The first bucket from k on that travels (an unchanged delta bucket is skipped)."""
        while k < self.buckets:
            self._start(k)  # (only after a skipped delta bucket, which uses no staging buffer)
            item = await self.ready.pop(k)
            if item is None or item.is_delta:
                self.delta_buckets += 1
            if item is not None:
                return k, item
            k += 1
        return None

    def _request(self, k: int, item: OutgoingBucket) -> None:
        self.pending.append(asyncio.ensure_future(self.call(self._what(k), item.request)))

    async def _watch(self, what: str, until: asyncio.Future, mine: asyncio.Future) -> object:
        """Wait for `until` (our broadcast, `mine`, or a point of it), dropping the calls
        answered meanwhile. A call that fails first, or our broadcast failing, abandons
        the group (our broadcast may never complete)."""
        while not until.done():
            if until is not mine and mine.done() and mine.exception() is None:
                return None  # (it finished without passing the point: nothing to wait for)
            await asyncio.wait({until, mine, *self.pending}, return_when=asyncio.FIRST_COMPLETED)
            for answer in [a for a in self.pending if a.done()]:
                if answer.exception() is not None:
                    self.abandon(mine)
                    raise answer.exception()
                self.pending.remove(answer)
            if mine.done() and mine.exception() is not None:
                self.abandon(mine)
                e = mine.exception()
                raise errors.Unavailable(
                    f"weight transfer ({what}) failed on the trainer side: {type(e).__name__}: {e}"
                )
        return until.result()
