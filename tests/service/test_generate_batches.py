"""A prompt's samples reach the engine as one batched /generate, each with its own rid,
sampling parameters and answer; one request the engine refuses fails alone; a request whose
caller stops waiting is aborted while the others finish: the real reference engine over
HTTP on loopback."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from rlmesh.common.auth import client_headers
from rlmesh.common.errors import InvalidArgument
from rlmesh.rollout.sglang_client import GenerateHTTP, SGLangClient

PROMPT = [1, 5, 9, 13]


class CountingHTTP(GenerateHTTP):
    """GenerateHTTP that remembers how many requests each /generate POST carried."""

    def __init__(self) -> None:
        super().__init__(client_headers())
        self.posts: list[int] = []

    async def post(self, url: str, body: dict, timeout: float, answers: int = 1) -> tuple[int, bytes]:
        self.posts.append(len(body["rid"]) if isinstance(body["rid"], list) else 1)
        return await super().post(url, body, timeout, answers)


async def with_client(engine_url: str, work):
    async with httpx.AsyncClient(headers=client_headers()) as http, CountingHTTP() as generate_http:
        client = SGLangClient(engine_url, http, timeout=30, weight_timeout=30, generate_http=generate_http)
        return await work(client), generate_http.posts


def params(tokens: int, **more) -> dict:
    return {"max_new_tokens": tokens, "ignore_eos": True, "temperature": 1.0, **more}


def test_a_prompts_samples_travel_as_one_request_each_with_its_own_answer(engine):
    async def work(client: SGLangClient):
        calls = [client.generate(PROMPT, params(2 + i), rid=f"s{i}", batch_key=("g", 0)) for i in range(4)]
        alone = client.generate(PROMPT, params(3), rid="other")  # no key: its own request
        return await asyncio.gather(*calls, alone)

    answers, posts = asyncio.run(with_client(engine.url, work))
    assert sorted(posts) == [1, 4]
    assert [len(a["output_ids"]) for a in answers] == [2, 3, 4, 5, 3]
    assert [a["meta_info"]["id"] for a in answers] == ["s0", "s1", "s2", "s3", "other"]
    assert all(len(a["meta_info"]["output_token_logprobs"]) == len(a["output_ids"]) for a in answers)


def test_a_request_the_engine_refuses_fails_alone(engine):
    async def work(client: SGLangClient):
        calls = [
            client.generate(PROMPT, params(2, temperature=-1.0 if i == 1 else 1.0), rid=f"s{i}", batch_key="g")
            for i in range(3)
        ]
        return await asyncio.gather(*calls, return_exceptions=True)

    answers, posts = asyncio.run(with_client(engine.url, work))
    assert posts == [3, 1, 1, 1]  # the batch, refused as a whole; then each on its own
    assert isinstance(answers[1], InvalidArgument) and "temperature" in str(answers[1])
    assert [len(answers[i]["output_ids"]) for i in (0, 2)] == [2, 2]


def test_a_request_whose_caller_stops_waiting_is_aborted_and_the_others_finish(engine):
    aborted: list[str] = []

    async def work(client: SGLangClient):
        abort = client.abort

        async def noting_abort(rid: str = "", abort_all: bool = False) -> None:
            aborted.append(rid)
            await abort(rid, abort_all)

        client.abort = noting_abort
        # (the engine caps it at the tiny model's context: ~250 tokens, far more than "short")
        long = asyncio.ensure_future(client.generate(PROMPT, params(10_000), rid="long", batch_key="g"))
        short = asyncio.ensure_future(client.generate(PROMPT, params(2), rid="short", batch_key="g"))
        await asyncio.sleep(0.05)
        long.cancel()
        with pytest.raises(asyncio.CancelledError):
            await long
        return await asyncio.wait_for(short, 60)  # (the batch ends once the engine aborted "long")

    answer, posts = asyncio.run(with_client(engine.url, work))
    assert posts == [2]
    assert aborted == ["long"]
    assert len(answer["output_ids"]) == 2
