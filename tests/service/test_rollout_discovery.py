"""The engine pool's membership follows discovery without a restart, over real HTTP on
loopback: a new engine takes no generation until it holds the run's weights; one that
leaves takes no new request while the ones it has in flight finish; the rollout service
reads a router's worker list again and again, and keeps its engines while the list fails."""

from __future__ import annotations

import asyncio
import json

import pytest

from rlmesh.rollout.discovery import DiscoveryConfig, EngineDiscovery
from rlmesh.rollout.engine_client import EngineError, EnginePool
from rlmesh.rollout.server import start_discovery


async def fake_engine(hold: asyncio.Event | None = None, worker_list: dict | None = None):
    """An engine that reports the weight version it was last given (in /model_info and in
    each /generate answer); with `hold`, /generate answers only once it is set. With
    `worker_list`, it is a router whose GET /list_workers answers worker_list["body"] (and
    worker_list["status"])."""
    seen: list[str] = []
    version = {"weight_version": "default"}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        head = await reader.readuntil(b"\r\n\r\n")
        lengths = [int(x.split(b":")[1]) for x in head.split(b"\r\n") if x.lower().startswith(b"content-length")]
        body = json.loads(await reader.readexactly(lengths[0])) if lengths else {}
        path = head.split(b" ")[1].decode()
        seen.append(path)
        status = 200
        if body.get("weight_version"):
            version["weight_version"] = body["weight_version"]
        if path == "/generate" and hold is not None:
            await hold.wait()
        answer = {
            "/generate": {"text": "x", "output_ids": [5], "meta_info": {"finish_reason": {"type": "stop"}, **version}},
            "/model_info": version,
            "/server_info": {"tp_size": 1},
        }.get(path, {})
        if worker_list is not None and path == "/list_workers":
            answer, status = worker_list["body"], worker_list.get("status", 200)
        payload = json.dumps(answer).encode()
        writer.write(b"HTTP/1.1 %d OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (status, len(payload), payload))  # fmt: skip
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", seen


def pool(urls: list[str]) -> EnginePool:
    return EnginePool(urls, "", timeout=5, weight_timeout=5, dynamic=True)


def test_a_new_engine_generates_only_once_it_holds_the_runs_weights():
    async def scenario():
        (_, a, _), (_, b, b_seen) = await fake_engine(), await fake_engine()
        p = pool([])
        with pytest.raises(EngineError, match="discovery has found none yet"):
            await p.engine_for(3)
        p.set_members([a])
        await p.update_weights_from_disk("/models/m", "3")  # the run's weights, version 3
        p.set_members([a, b + "/"])
        assert [e.url for e in p.engines] == [a, b]
        assert [(await p.engine_for(3)).url for _ in range(4)] == [a] * 4
        states = {s.url: s.state for s in await p.states()}
        assert states == {a: "serving", b: "behind"}
        assert "/generate" not in b_seen
        await p.update_weights_from_disk("/models/m", "4")  # the next push reaches b too
        assert {(await p.engine_for(4)).url for _ in range(4)} == {a, b}
        assert {s.state for s in await p.states()} == {"serving"}
        await p.close()

    asyncio.run(scenario())


def test_an_engine_that_leaves_takes_no_new_request_and_finishes_those_in_flight():
    async def scenario():
        hold = asyncio.Event()
        (_, a, _), (_, b, b_seen) = await fake_engine(), await fake_engine(hold)
        p = pool([a, b])
        await p.update_weights_from_disk("/models/m", "2")
        engine_b = next(e for e in p.engines if e.url == b)
        in_flight = asyncio.create_task(engine_b.generate([1, 2], {"max_new_tokens": 1}, rid="r1"))
        while not engine_b.in_flight or "/generate" not in b_seen:
            await asyncio.sleep(0.01)
        p.set_members([a])
        assert [(s.url, s.state, s.in_flight) for s in p.leaving()] == [(b, "leaving", 1)]
        assert [s.url for s in await p.states()] == [a]
        assert {(await p.engine_for(2)).url for _ in range(4)} == {a}
        hold.set()
        answer = await in_flight  # not lost: it finished on b
        assert answer["meta_info"]["weight_version"] == "2"
        assert p.leaving() == [] and b_seen.count("/generate") == 1
        await p.close()

    asyncio.run(scenario())


def test_the_rollout_service_follows_a_routers_worker_list_and_keeps_its_engines_while_it_fails():
    async def scenario():
        (_, a, _), (_, b, _) = await fake_engine(), await fake_engine()
        router = {"body": {"urls": [a]}}
        _, router_url, _ = await fake_engine(worker_list=router)
        config = DiscoveryConfig(source="router", list_url=router_url + "/list_workers", interval_seconds=0.02)
        discovery = EngineDiscovery(config, [])
        p = pool([])
        task = await start_discovery(discovery, p)
        assert [e.url for e in p.engines] == [a]  # (the first lookup, before the service starts)

        async def until(condition):
            while not condition():
                await asyncio.sleep(0.01)

        router["body"] = {"workers": [{"url": a}, {"url": b}]}
        await until(lambda: [e.url for e in p.engines] == [a, b])
        router["status"] = 503
        await until(lambda: "answered 503" in discovery.status.error)
        assert [e.url for e in p.engines] == [a, b]  # kept through the failure
        router["status"], router["body"] = 200, {"urls": [b]}
        await until(lambda: [e.url for e in p.engines] == [b])
        assert discovery.status.error == ""
        task.cancel()
        await p.close()

    asyncio.run(scenario())
