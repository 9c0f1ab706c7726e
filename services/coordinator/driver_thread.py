"""The run driver on an event loop of its own, in its own thread. Sharing the API's loop, a
burst of requests queued the run's own callbacks (its gRPC replies, its Redis writes)
behind hundreds of request handlers, and the active run slowed with every reader of the
page; on its own loop it is scheduled as a thread, whatever the API is doing. The routes
call it through the same methods as RunDriver."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from rlmesh.common.run_config import RunConfig
from rlmesh.coordinator.calls import Clients
from rlmesh.coordinator.config import Settings
from rlmesh.coordinator.runs import RunDriver
from rlmesh.coordinator.store import Created

T = TypeVar("T")


class DriverThread:
    """A RunDriver built and run on a loop in a thread of its own. `clients` are the API
    loop's own stubs (the routes relay calls to the services with them): gRPC channels, like
    Redis clients, belong to the loop that made them."""

    def __init__(self, settings: Settings, clients: Clients, build: Callable[[], Awaitable[RunDriver]]) -> None:
        self.settings = settings
        self.clients = clients
        self._build = build
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="run-driver", daemon=True)
        self._driver: RunDriver | None = None

    @property
    def tasks(self) -> dict[str, asyncio.Task]:
        return self.driver.tasks

    @property
    def driver(self) -> RunDriver:
        assert self._driver is not None, "DriverThread.start() first"
        return self._driver

    async def _on_driver_loop(self, call: Awaitable[T]) -> T:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(call, self._loop))

    async def start(self) -> None:
        """Build the driver on its loop and carry on with the runs that were active."""
        self._thread.start()

        async def build() -> None:
            self._driver = await self._build()
            await self._driver.resume_active()

        await self._on_driver_loop(build())

    async def submit(self, config: RunConfig) -> Created:
        return await self._on_driver_loop(self.driver.submit(config))

    async def move(self, run_id: str, position: int) -> int:
        return await self._on_driver_loop(self.driver.move(run_id, position))

    async def stop(self, run_id: str) -> str:
        return await self._on_driver_loop(self.driver.stop(run_id))

    async def pause(self, run_id: str) -> str:
        return await self._on_driver_loop(self.driver.pause(run_id))

    async def resume(self, run_id: str) -> str:
        return await self._on_driver_loop(self.driver.resume(run_id))

    async def delete(self, run_id: str) -> None:
        await self._on_driver_loop(self.driver.delete(run_id))

    async def close(self, after: Callable[[], Awaitable[None]] | None = None) -> None:
        """Let the runs go (they resume on restart), then `after` on the driver's loop (closing
        what it made there), then stop the loop."""
        if self._driver is not None:

            async def close() -> None:
                await self.driver.close()
                if after is not None:
                    await after()

            await self._on_driver_loop(close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        await asyncio.to_thread(self._thread.join)
        self._loop.close()


async def close_channels(channels: dict[str, grpc.aio.Channel]) -> None:
    for channel in channels.values():
        await channel.close()
