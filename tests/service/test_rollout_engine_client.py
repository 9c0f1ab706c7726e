"""The SGLang client survives a connection that breaks under it (a pooled keep-alive
connection closed by the server, an engine restarting), and the engine pool relays weight
updates to every engine with its rank offset: real HTTP on loopback."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from rlmesh.common.errors import InvalidArgument, Unavailable
from rlmesh.rollout.engine_client import EnginePool, SGLangClient, TensorMeta

ANSWER = {"text": "x", "output_ids": [5], "meta_info": {"id": "r", "finish_reason": {"type": "stop", "matched": 1},
                                                      "weight_version": "3", "output_token_logprobs": [[-0.1, 5, None]]}}


async def flaky_engine(drop_first: int, tp_size: int = 1):
    """An HTTP server that hangs up on the first `drop_first` /generate requests, then answers."""
    seen: list[dict] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        head = await reader.readuntil(b"\r\n\r\n")
        lengths = [int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")]
        body = json.loads(await reader.readexactly(lengths[0])) if lengths else {}
        path = head.split(b" ")[1].decode()
        seen.append({"path": path, **body})
        if path == "/generate" and sum(s["path"] == "/generate" for s in seen) <= drop_first:
            writer.close()  # hang up without an answer
            return
        answers = {"/generate": ANSWER, "/get_server_info": {"tp_size": tp_size}}
        payload = json.dumps(answers.get(path, {})).encode()
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(payload), payload))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], seen


@pytest.mark.parametrize("drops", [1, 2])
def test_generate_retries_a_broken_connection_with_a_fresh_rid(drops):
    async def scenario():
        server, port, seen = await flaky_engine(drop_first=drops)
        async with server, httpx.AsyncClient() as http:
            client = SGLangClient(f"http://127.0.0.1:{port}", http, timeout=5, weight_timeout=5)
            out = await client.generate([1, 2], {"max_new_tokens": 1}, rid="abc")
        return out, seen

    out, seen = asyncio.run(scenario())
    assert out["output_ids"] == [5]
    generates = [s["rid"] for s in seen if s["path"] == "/generate"]
    assert generates == ["abc"] + [f"abc-retry{i}" for i in range(1, drops + 1)]
    # before each retry the broken request is aborted by the rid it was sent with
    assert [s["rid"] for s in seen if s["path"] == "/abort_request"] == ["abc"] + [f"abc-retry{i}" for i in range(1, drops)]


def test_generate_gives_up_with_unavailable_after_bounded_retries():
    async def scenario():
        server, port, seen = await flaky_engine(drop_first=99)
        async with server, httpx.AsyncClient() as http:
            client = SGLangClient(f"http://127.0.0.1:{port}", http, timeout=5, weight_timeout=5)
            with pytest.raises(Unavailable, match="failed 3 times"):
                await client.generate([1], {"max_new_tokens": 1}, rid="r")
        return seen

    assert sum(s["path"] == "/generate" for s in asyncio.run(scenario())) == 3


def test_the_pool_relays_weight_updates_to_every_engine_with_its_rank_offset():
    async def scenario():
        (a, port_a, seen_a), (b, port_b, seen_b) = await flaky_engine(0, tp_size=2), await flaky_engine(0)
        async with a, b:
            pool = EnginePool([f"http://127.0.0.1:{port_a}", f"http://127.0.0.1:{port_b}"], "", 5, 5)
            try:
                with pytest.raises(InvalidArgument, match="1 \\+ TP sizes = 4"):
                    await pool.init_weight_group("10.0.0.1", 29500, 5, "g", "gloo")
                # fewer ranks than the engines have: they changed since the caller counted, it asks again
                with pytest.raises(Unavailable, match="1 \\+ TP sizes = 4"):
                    await pool.init_weight_group("10.0.0.1", 29500, 3, "g", "gloo")
                assert await pool.init_weight_group("10.0.0.1", 29500, 4, "g", "gloo") == 2
                await pool.update_weights([TensorMeta("w", "float32", (2, 3))], "g", "7", True, "")
            finally:
                await pool.close()
        return seen_a, seen_b

    seen_a, seen_b = asyncio.run(scenario())
    joins = [s for seen in (seen_a, seen_b) for s in seen if s["path"] == "/init_weights_update_group"]
    # the trainer is rank 0; engine a holds ranks 1-2 (TP 2), engine b rank 3
    assert [(j["rank_offset"], j["world_size"], j["master_address"]) for j in joins] == [
        (1, 4, "10.0.0.1"), (3, 4, "10.0.0.1")]
    for seen in (seen_a, seen_b):
        update = next(s for s in seen if s["path"] == "/update_weights_from_distributed")
        assert (update["names"], update["shapes"], update["weight_version"]) == (["w"], [[2, 3]], "7")
