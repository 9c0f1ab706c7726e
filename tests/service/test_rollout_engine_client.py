"""The SGLang client survives a connection that breaks under it (a pooled keep-alive
connection closed by the server, an engine restarting), and the engine pool relays weight
updates to every engine with its rank offset; an engine that is down leaves the pool (no
generation, not in the weight group) and rejoins once it answers and has received the
weights: real HTTP on loopback."""

from __future__ import annotations

import asyncio
import json
import os

import httpx
import pytest

from rlmesh.common.errors import FailedPrecondition, InvalidArgument, Unavailable
from rlmesh.common.net import LOOPBACK_HOSTS, free_port, loopback_bypasses_proxy
from rlmesh.rollout import sglang_client
from rlmesh.rollout.engine_client import EngineBehind, EnginePool, EnginesBehind, SGLangClient, TensorMeta, WeightDelta
from rlmesh.rollout.sglang_client import GenerateHTTP

ANSWER = {
    "text": "x",
    "output_ids": [5],
    "meta_info": {
        "id": "r",
        "finish_reason": {"type": "stop", "matched": 1},
        "weight_version": "3",
        "output_token_logprobs": [[-0.1, 5, None]],
    },
}


async def flaky_engine(
    drop_first: int, tp_size: int = 1, port: int = 0, answers_its_version: bool = False, before_0_5_10: bool = False
):
    """An HTTP server that hangs up on the first `drop_first` /generate requests, then answers
    (and reports the weight version it was last given: in /model_info, and with
    answers_its_version in each /generate answer). `before_0_5_10`: as SGLang before 0.5.10,
    it knows the info routes only by their older names (/get_model_info, /get_server_info)."""
    seen: list[dict] = []
    version = {"weight_version": "default"}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        head = await reader.readuntil(b"\r\n\r\n")
        lengths = [
            int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
        ]
        body = json.loads(await reader.readexactly(lengths[0])) if lengths else {}
        target = head.split(b" ")[1].decode()
        path = "/" + target.split("://", 1)[1].split("/", 1)[1] if "://" in target else target
        seen.append({"path": path, **body, **({"proxied_to": target} if "://" in target else {})})
        if path == "/generate" and sum(s["path"] == "/generate" for s in seen) <= drop_first:
            writer.close()  # hang up without an answer
            return
        if body.get("weight_version"):
            version["weight_version"] = body["weight_version"]
        answer = ANSWER
        if answers_its_version:
            answer = {**ANSWER, "meta_info": {**ANSWER["meta_info"], **version}}
        answers = {"/generate": answer, "/server_info": {"tp_size": tp_size}, "/model_info": version}
        if before_0_5_10:
            answers = {
                "/get_server_info": answers.pop("/server_info"),
                "/get_model_info": answers.pop("/model_info"),
                **answers,
            }
        status = b"404 Not Found" if path in ("/model_info", "/server_info") and before_0_5_10 else b"200 OK"
        payload = json.dumps(answers.get(path, {})).encode()
        writer.write(
            b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (status, len(payload), payload)
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    return server, server.sockets[0].getsockname()[1], seen


async def generate_once(drop_first: int, input_ids: tuple[int, ...] = (1,), rid: str = "r"):
    """One client's generate against flaky_engine: its answer (or the error it raised), and
    the requests the engine saw."""
    server, port, seen = await flaky_engine(drop_first=drop_first)
    async with server, httpx.AsyncClient() as http, GenerateHTTP() as generate_http:
        client = SGLangClient(
            f"http://127.0.0.1:{port}", http, timeout=5, weight_timeout=5, generate_http=generate_http
        )
        try:
            return await client.generate(list(input_ids), {"max_new_tokens": 1}, rid=rid), seen
        except Unavailable as e:
            return e, seen


@pytest.mark.parametrize("drops", [1, 2])
def test_generate_retries_a_broken_connection_with_a_fresh_rid(drops):
    out, seen = asyncio.run(generate_once(drop_first=drops, input_ids=[1, 2], rid="abc"))
    assert out["output_ids"] == [5]
    generates = [s["rid"] for s in seen if s["path"] == "/generate"]
    assert generates == ["abc"] + [f"abc-retry{i}" for i in range(1, drops + 1)]
    # before each retry the broken request is aborted by the rid it was sent with
    assert [s["rid"] for s in seen if s["path"] == "/abort_request"] == ["abc"] + [
        f"abc-retry{i}" for i in range(1, drops)
    ]


def test_generate_gives_up_with_unavailable_after_bounded_retries():
    out, seen = asyncio.run(generate_once(drop_first=99))
    assert isinstance(out, Unavailable) and "failed 3 times" in str(out)
    assert sum(s["path"] == "/generate" for s in seen) == 3


def test_an_answer_past_the_size_bound_is_refused_and_not_sent_again(monkeypatch):
    monkeypatch.setattr(sglang_client, "MAX_GENERATE_ANSWER_BYTES", 64)  # (the engine's answer is ~150 bytes)
    out, seen = asyncio.run(generate_once(drop_first=0))
    assert isinstance(out, Unavailable) and "answered more than 64 bytes" in str(out)
    assert [s["path"] for s in seen] == ["/generate"]


async def server_info_then_generate(url: str, port: int) -> list[dict]:
    """A client's /server_info (through httpx) and /generate (through aiohttp) to `url`, with
    flaky_engine listening on `port`: what it saw."""
    server, _, seen = await flaky_engine(drop_first=0, port=port)
    async with server, httpx.AsyncClient() as http, GenerateHTTP() as generate_http:
        client = SGLangClient(url, http, timeout=5, weight_timeout=5, generate_http=generate_http)
        await client.server_info()
        assert (await client.generate([1], {"max_new_tokens": 1}, rid="r"))["output_ids"] == [5]
    return seen


def test_every_engine_call_takes_the_proxy_from_the_environment(monkeypatch):
    """/generate has its own HTTP client: it honours HTTP_PROXY and NO_PROXY as the others do."""
    proxy = free_port()  # flaky_engine answers as the proxy here
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{proxy}")
    monkeypatch.setenv("NO_PROXY", "")
    seen = asyncio.run(server_info_then_generate("http://engine.invalid:30000", proxy))
    assert [(s["path"], s.get("proxied_to")) for s in seen] == [
        ("/server_info", "http://engine.invalid:30000/server_info"),
        ("/generate", "http://engine.invalid:30000/generate"),
    ]


def test_with_a_proxy_in_the_environment_a_stacks_own_calls_stay_on_loopback(monkeypatch):
    """A corporate shell's HTTP_PROXY would take the rollout service's calls to its engine on
    127.0.0.1 to the proxy; `rlmesh` puts the loopback hosts in NO_PROXY first."""
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("NO_PROXY", "registry.example.com")
    monkeypatch.delenv("no_proxy", raising=False)
    loopback_bypasses_proxy()
    assert os.environ["NO_PROXY"].split(",") == ["registry.example.com", *LOOPBACK_HOSTS]
    port = free_port()
    seen = asyncio.run(server_info_then_generate(f"http://127.0.0.1:{port}", port))
    assert [(s["path"], s.get("proxied_to")) for s in seen] == [("/server_info", None), ("/generate", None)]


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
        (1, 4, "10.0.0.1"),
        (3, 4, "10.0.0.1"),
    ]
    for seen in (seen_a, seen_b):
        update = next(s for s in seen if s["path"] == "/update_weights_from_distributed")
        assert (update["names"], update["shapes"], update["weight_version"]) == (["w"], [[2, 3]], "7")


def test_a_push_is_one_weight_update_session_and_deltas_go_only_to_engines_that_take_them():
    async def scenario():
        server, port, seen = await flaky_engine(0)
        async with server:
            pool = EnginePool([f"http://127.0.0.1:{port}"], "", 5, 5)
            try:
                for k, version in enumerate(["", "", "8"]):  # three buckets, the version with the last
                    await pool.update_weights([TensorMeta(f"w{k}", "bfloat16", (2,))], "g", version, bool(version), "")
                await pool.states()  # this engine's /server_info has no rlmesh_weight_delta
                with pytest.raises(FailedPrecondition, match="not every engine accepts rlmesh-delta-v1"):
                    await pool.update_weights(
                        [TensorMeta("w", "bfloat16", (2,))],
                        "g",
                        "9",
                        True,
                        "",
                        WeightDelta(count=1, index_dtype="int32", base_version="8"),
                    )
            finally:
                await pool.close()
        return seen

    paths = [s["path"] for s in asyncio.run(scenario()) if "weight" in s["path"]]
    assert paths == ["/begin_weight_update"] + ["/update_weights_from_distributed"] * 3 + ["/end_weight_update"]


def test_an_engine_that_is_down_leaves_the_pool_and_rejoins_once_it_has_the_weights():
    async def scenario():
        a, port_a, seen_a = await flaky_engine(0)
        port_b = free_port()  # b is down: nothing listens there yet
        url_a, url_b = f"http://127.0.0.1:{port_a}", f"http://127.0.0.1:{port_b}"
        pool = EnginePool([url_a, url_b], "", 5, 5)
        try:
            async with a:
                states = await pool.states()
                assert [s.healthy for s in states] == [True, False]
                assert {pool.for_generation().url for _ in range(4)} == {url_a}
                await pool.pause("abort")  # b does not answer: tolerated, a is paused
                await pool.resume()
                # the weight group holds the engines that answer: the trainer and a
                assert await pool.init_weight_group("10.0.0.1", 29500, 2, "g1", "gloo") == 1
                await pool.update_weights([TensorMeta("w", "float32", (2,))], "g1", "7", True, "")

                b, _, seen_b = await flaky_engine(0, port=port_b)  # b is back, on its base weights
                async with b:
                    await pool.states()
                    assert {pool.for_generation().url for _ in range(4)} == {url_a}  # not before it has them
                    assert await pool.init_weight_group("10.0.0.1", 29501, 3, "g2", "gloo") == 2
                    await pool.update_weights([TensorMeta("w", "float32", (2,))], "g2", "8", True, "")
                    assert {pool.for_generation().url for _ in range(4)} == {url_a, url_b}
                # b is gone again; a call that broke on it takes it out at once (the rollout does this)
                pool.mark_down(next(e for e in pool.engines if e.url == url_b))
                assert {pool.for_generation().url for _ in range(4)} == {url_a}
        finally:
            await pool.close()
        return seen_a, seen_b

    seen_a, seen_b = asyncio.run(scenario())
    assert [s["path"] for s in seen_a].count("/pause_generation") == 1
    assert [s.get("rank_offset") for s in seen_b if s["path"] == "/init_weights_update_group"] == [2]
    assert not any(s["path"] == "/update_weights_from_distributed" and s["group_name"] == "g1" for s in seen_b)


def test_an_engine_on_older_weights_than_the_request_needs_takes_none_of_its_samples():
    """A restarted engine is back on its base weights: until it receives the run's weights it
    generates nothing for a request that needs them, whether the pool learns it from a probe
    or from the engine's own answer (it restarted between two requests, no call broke);
    with every engine behind, the request fails with ABORTED for the caller to push first."""

    async def scenario():
        engine, port, _ = await flaky_engine(0, answers_its_version=True)
        url = f"http://127.0.0.1:{port}"
        pool = EnginePool([url], "", 5, 5)
        try:
            async with engine:
                with pytest.raises(EnginesBehind, match=r"older than version 3 .*holds version default.*push"):
                    await pool.engine_for(3)
                assert (await pool.engine_for(0)).url == url  # (a request that needs no version)
                assert await pool.init_weight_group("10.0.0.1", 29500, 2, "g", "gloo") == 1
                await pool.update_weights([TensorMeta("w", "float32", (2,))], "g", "3", True, "")
                chosen = await pool.engine_for(3)
                await chosen.generate([1, 2], {"max_new_tokens": 1}, rid="a")
                pool.check_answer(chosen, 3)  # it holds version 3: the sample stands
            restarted, _, _ = await flaky_engine(0, port=port, answers_its_version=True)
            async with restarted:
                chosen = await pool.engine_for(3)  # nothing broke: the pool still thinks it holds 3
                await chosen.generate([1, 2], {"max_new_tokens": 1}, rid="b")
                with pytest.raises(EngineBehind, match="answered with weight version 0, older than 3"):
                    pool.check_answer(chosen, 3)
                with pytest.raises(EnginesBehind):
                    await pool.engine_for(3)
        finally:
            await pool.close()

    asyncio.run(scenario())


def test_colocated_calls_reach_every_engine_in_sglangs_shapes():
    """Release and resume (SGLang's tags; none = null, all of them) and the in-place update
    (/update_weights_from_tensor, inside a weight-update session) go to every engine; a tag
    SGLang does not have, or too many serialized entries, are refused before any engine is asked."""
    from rlmesh.rollout import colocated

    async def scenario():
        (a, port_a, seen_a), (b, port_b, seen_b) = await flaky_engine(0), await flaky_engine(0)
        async with a, b:
            pool = EnginePool([f"http://127.0.0.1:{port_a}", f"http://127.0.0.1:{port_b}"], "", 5, 5)
            try:
                with pytest.raises(InvalidArgument, match="unknown memory tag"):
                    await colocated.release_memory(pool, ["gpu"])
                with pytest.raises(InvalidArgument, match="1 to 64 entries"):
                    await colocated.update_weights_from_tensor(pool, ["p"] * 65, "rlmesh_weight_file", "3", True)
                assert await colocated.release_memory(pool, []) == ["all"]
                assert await colocated.resume_memory(pool, ["weights", "weights"]) == ["weights"]
                await colocated.update_weights_from_tensor(
                    pool, ["/dev/shm/rlmesh/r.rlmw"], "rlmesh_weight_file", "3", True
                )
                assert [e.url for e in pool.in_rotation()] == [e.url for e in pool.engines]
            finally:
                await pool.close()
        return seen_a, seen_b

    for seen in asyncio.run(scenario()):
        calls = [(s["path"], s.get("tags", "-")) for s in seen if "memory" in s["path"]]
        assert calls == [("/release_memory_occupation", None), ("/resume_memory_occupation", ["weights"])]
        paths = [s["path"] for s in seen if "weight" in s["path"]]
        assert paths == ["/begin_weight_update", "/update_weights_from_tensor", "/end_weight_update"]
        update = next(s for s in seen if s["path"] == "/update_weights_from_tensor")
        assert update["serialized_named_tensors"] == ["/dev/shm/rlmesh/r.rlmw"]
        assert (update["load_format"], update["weight_version"], update["flush_cache"]) == (
            "rlmesh_weight_file",
            "3",
            True,
        )


def test_an_engine_older_than_sglang_0_5_10_is_asked_by_the_older_info_names():
    """SGLang 0.5.10 renamed /get_model_info and /get_server_info (0.5.23 deprecates the old
    names): the pool asks by the new names and, after a 404, by the old ones from then on."""

    async def scenario():
        engine, port, seen = await flaky_engine(0, tp_size=2, before_0_5_10=True)
        async with engine:
            pool = EnginePool([f"http://127.0.0.1:{port}"], "", 5, 5)
            try:
                await pool.update_weights([TensorMeta("w", "float32", (2,))], "g", "4", True, "")
                first, second = await pool.states(), await pool.states()
            finally:
                await pool.close()
        return first, second, [s["path"] for s in seen if "info" in s["path"]]

    first, second, asked = asyncio.run(scenario())
    assert [(s.healthy, s.tp_size, s.weight_version) for s in first + second] == [(True, 2, "4")] * 2
    assert asked.count("/model_info") + asked.count("/server_info") <= 2  # asked once, then never again
    assert asked.count("/get_model_info") == 2 and asked.count("/get_server_info") == 2


def test_an_engine_without_the_batch_form_gets_a_prompts_samples_one_by_one():
    """flaky_engine answers a batch with one answer, as an engine that takes no batches
    might: each request is sent again on its own and answered."""

    async def run():
        server, port, seen = await flaky_engine(drop_first=0)
        async with server, httpx.AsyncClient() as http, GenerateHTTP() as generate_http:
            client = SGLangClient(
                f"http://127.0.0.1:{port}", http, timeout=5, weight_timeout=5, generate_http=generate_http
            )
            calls = [client.generate([1], {"max_new_tokens": 1}, rid=f"s{i}", batch_key="g") for i in range(3)]
            return await asyncio.gather(*calls), seen

    answers, seen = asyncio.run(run())
    assert [a["output_ids"] for a in answers] == [[5]] * 3
    assert [s["rid"] for s in seen if s["path"] == "/generate"] == [["s0", "s1", "s2"], "s0", "s1", "s2"]
