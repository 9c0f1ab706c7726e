"""/generate requests for the samples of one prompt, sent to one engine in the same turn of
the event loop, travel as one batched /generate (SGLang's batch form: each field a list, one
entry per request; the answer a list in the same order).

A GRPO group is n requests for one prompt, started together: batched, the rollout service
and the engine each handle one HTTP request instead of n (that handling was a third of the
engine's CPU and a fifth of the rollout service's in a fully_async profile). Nothing is lost
by waiting: the engine answers a batch when its last request ends, and a group is complete
only then anyway.

Each request keeps its own rid (abort by rid works as before), its own sampling parameters
and its own answer. A batch that fails as a whole other than by timing out (a connection
broken by a restarting engine, one request the engine refuses) is sent again one request
at a time, so each request meets its own retry or its own error."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field

# A batch never holds more requests than this (a larger group goes in several).
MAX_BATCH_REQUESTS = 64


@dataclass
class _Waiting:
    body: dict
    rid: str
    timeout: float
    answer: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class BatchFailed(Exception):
    """The batch as a whole got no usable answer: its requests are sent one at a time."""


class GenerateBatches:
    """Collects the /generate requests of one engine by key until the loop's next turn."""

    def __init__(
        self,
        send_one: Callable[[dict, str, float], Awaitable[dict]],
        send_batch: Callable[[dict, list[str], float, int], Awaitable[list[dict]]],
        abort: Callable[[str], Awaitable[None]],
    ) -> None:
        self._send_one = send_one  # (body, rid, timeout) -> answer: the single request's path
        self._send_batch = send_batch  # (batched body, rids, timeout, count) -> answers; BatchFailed
        self._abort = abort  # a request whose caller stopped waiting, by rid
        self._waiting: dict[Hashable, list[_Waiting]] = {}
        self._tasks: set[asyncio.Task] = set()

    async def generate(self, key: Hashable, body: dict, rid: str, timeout: float) -> dict:
        waiting = self._waiting.setdefault(key, [])
        if not waiting:
            asyncio.get_running_loop().call_soon(self._send, key)
        request = _Waiting(body, rid, timeout)
        waiting.append(request)
        try:
            return await request.answer
        except asyncio.CancelledError:
            # The caller stopped waiting (its sample timed out, the rollout was stopped): the
            # batch goes on for the others, so this request is aborted on its own.
            self._spawn(self._abort_quietly(rid))
            raise

    def _send(self, key: Hashable) -> None:
        waiting = self._waiting.pop(key, [])
        for start in range(0, len(waiting), MAX_BATCH_REQUESTS):
            self._spawn(self._deliver(waiting[start : start + MAX_BATCH_REQUESTS]))

    async def _deliver(self, requests: list[_Waiting]) -> None:
        if len(requests) == 1:
            await self._settle(requests[0], self._send_one(requests[0].body, requests[0].rid, requests[0].timeout))
            return
        try:
            answers = await self._send_batch(
                batched_body([r.body for r in requests]),
                [r.rid for r in requests],
                max(r.timeout for r in requests),
                len(requests),
            )
        except BatchFailed:
            alone = [r for r in requests if not r.answer.done()]  # (not those whose caller stopped waiting)
            await asyncio.gather(*(self._settle(r, self._send_one(r.body, r.rid, r.timeout)) for r in alone))
            return
        except Exception as e:  # (a timeout: each request would wait as long again)
            for r in requests:
                _set(r.answer, exception=e)
            return
        for r, answer in zip(requests, answers, strict=True):
            _set(r.answer, result=answer)

    async def _settle(self, request: _Waiting, sending: Awaitable[dict]) -> None:
        try:
            _set(request.answer, result=await sending)
        except Exception as e:
            _set(request.answer, exception=e)

    async def _abort_quietly(self, rid: str) -> None:
        with contextlib.suppress(Exception):
            await self._abort(rid)

    def _spawn(self, work: Awaitable) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def batched_body(bodies: list[dict]) -> dict:
    """SGLang's batch form of single /generate bodies that share their keys: each field a
    list with one entry per request."""
    return {name: [b[name] for b in bodies] for name in bodies[0]}


def _set(future: asyncio.Future, result: object = None, exception: BaseException | None = None) -> None:
    if future.done():  # (its caller was cancelled meanwhile)
        return
    if exception is not None:
        future.set_exception(exception)
    else:
        future.set_result(result)
