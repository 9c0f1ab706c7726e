"""The SGLang client survives a connection that breaks under it (a pooled keep-alive
connection closed by the server, an engine restarting): real HTTP on loopback."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from rlmesh.common.errors import Unavailable
from rlmesh.rollout.engine_client import SGLangClient

ANSWER = {"text": "x", "output_ids": [5], "meta_info": {"id": "r", "finish_reason": {"type": "stop", "matched": 1},
                                                      "weight_version": "3", "output_token_logprobs": [[-0.1, 5, None]]}}


async def flaky_engine(drop_first: int):
    """An HTTP server that hangs up on the first `drop_first` requests, then answers."""
    seen: list[dict] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
        body = json.loads(await reader.readexactly(length))
        path = head.split(b" ")[1].decode()
        seen.append({"path": path, **body})
        if path == "/generate" and sum(s["path"] == "/generate" for s in seen) <= drop_first:
            writer.close()  # hang up without an answer
            return
        payload = json.dumps(ANSWER if path == "/generate" else {}).encode()
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
