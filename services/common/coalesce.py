"""One call for many callers: items submitted while a call is under way go out together in
the next one. fully_async's generation scores and writes each group as it finishes; groups
finish a few at a time, and one gRPC call per group cost the reward service and the buffer
twice the CPU that a sync step spends on the same samples."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from rlmesh.common.tasks import cancel_and_wait

Item = TypeVar("Item")
Result = TypeVar("Result")


class Coalescer(Generic[Item, Result]):
    """`submit(item)` answers with `call(items)`'s result for its item. One call at a time:
    the items submitted meanwhile (at most `max_items` a call) wait for it and go out together
    in the next. When a call of several items fails with an error `alone_if` accepts (one
    that may be an item's own fault), each item is sent again alone, so that a bad item
    fails only its own caller; any other failure fails every caller of that call."""

    def __init__(
        self,
        call: Callable[[list[Item]], Awaitable[list[Result]]],
        max_items: int,
        alone_if: Callable[[Exception], bool] = lambda _: False,
    ) -> None:
        if max_items < 1:
            raise ValueError("max_items must be at least 1")
        self.call = call
        self.max_items = max_items
        self.alone_if = alone_if
        self._queue: list[tuple[Item, asyncio.Future]] = []
        self._sender: asyncio.Task | None = None
        self._closed = False

    async def submit(self, item: Item) -> Result:
        if self._closed:
            raise RuntimeError("no longer sending: its owner has closed it")
        answer = asyncio.get_running_loop().create_future()
        self._queue.append((item, answer))
        if self._sender is None or self._sender.done():
            self._sender = asyncio.create_task(self._send_queued())
        return await answer

    async def _send_queued(self) -> None:
        batch: list[tuple[Item, asyncio.Future]] = []
        try:
            while self._queue:
                taken, self._queue = self._queue[: self.max_items], self._queue[self.max_items :]
                batch = [(item, answer) for item, answer in taken if not answer.done()]  # (callers gone: left out)
                await self._send(batch)
        except Exception as e:  # an internal error (alone_if's, say): nobody may wait for ever
            self._fail_all(batch, e)
        except BaseException:
            self._fail_all(batch, RuntimeError("no longer sending: its owner is closing"))
            raise

    async def _send(self, batch: list[tuple[Item, asyncio.Future]]) -> None:
        if not batch:
            return
        try:
            results = await self.call([item for item, _ in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"{len(results)} results for {len(batch)} items")
        except Exception as e:
            if len(batch) > 1 and self.alone_if(e):
                for one in batch:
                    if not one[1].done():
                        await self._send([one])
            else:
                _fail(batch, e)
            return
        for (_, answer), result in zip(batch, results):
            if not answer.done():
                answer.set_result(result)

    def _fail_all(self, batch: list[tuple[Item, asyncio.Future]], error: BaseException) -> None:
        _fail(batch, error)
        _fail(self._queue, error)
        self._queue.clear()

    async def close(self) -> None:
        """Stop sending; the callers still waiting fail, and so does a later submit."""
        self._closed = True
        if self._sender is not None:
            await cancel_and_wait(self._sender)  # (again and again: a gRPC call can swallow a cancel)
        self._fail_all([], RuntimeError("no longer sending: its owner is closing"))


def _fail(batch: list[tuple[object, asyncio.Future]], error: BaseException) -> None:
    for _, answer in batch:
        if not answer.done():
            answer.set_exception(error)
