"""A test remote reward service with every failure mode (a real uvicorn HTTP server on
loopback), a reward service to call it, and the fixtures the remote-reward tests share."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict

import grpc
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from rlmesh.common.grpc_server import sync_channel
from rlmesh.common.sample import (
    Sample,
    SampleGroup,
    Status,
    group_from_proto,
    group_to_proto,
    sample_from_proto,
    sample_to_proto,
)
from rlmesh.reward.config import Settings
from rlmesh.reward.server import start as start_reward
from rlmesh.v1 import reward_pb2, reward_pb2_grpc

# ---------------------------------------------------------------- a test remote with every failure mode

SECRET = "AKIAIOSFODNN7EXAMPLE-very-secret"  # what a probed internal service might answer with
LOOPBACK = ["127.0.0.0/8", "::1"]  # the test remotes listen on loopback, which an operator must allow


class RemoteState:
    def __init__(self) -> None:
        self.batches: dict[str, list[list[int]]] = defaultdict(list)  # behaviour -> sample indices per request
        self.down = False  # for "switch"
        self.flaky_failures_left = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.requests = 0  # every request, the registration's probe included


def score_of(sample: dict) -> float:
    return float(sample["response"].strip() == sample["label"].strip())


def remote_app(state: RemoteState) -> FastAPI:
    app = FastAPI()

    @app.post("/{behaviour}")
    async def score(behaviour: str, request: Request):
        state.requests += 1
        if behaviour == "leaky":  # even the probe: its error page holds a secret
            return PlainTextResponse(f"Traceback ... {SECRET}", status_code=500)
        if behaviour == "authed" and request.headers.get("authorization") != "Bearer s3cret":
            return PlainTextResponse("who are you?", status_code=401)
        try:
            samples = json.loads(await request.body())["samples"]
            assert isinstance(samples, list)
        except (ValueError, KeyError, TypeError, AssertionError):
            if behaviour == "lenient":
                return {"scores": []}
            return PlainTextResponse('expected {"samples": [...]}', status_code=400)
        if all(s["metadata"].get("rlmesh_probe") for s in samples):
            return {"scores": [score_of(s) for s in samples]}  # registration always succeeds
        state.batches[behaviour].append([s["index"] for s in samples])
        state.in_flight += 1
        state.max_in_flight = max(state.max_in_flight, state.in_flight)
        try:
            return await _answer(behaviour, samples, state)
        finally:
            state.in_flight -= 1

    return app


def _raw(body) -> Response:
    return Response(json.dumps(body), media_type="application/json")  # allows NaN/Infinity


# Replies that depend only on the request: behaviour -> (samples, their right scores) -> reply.
_FIXED_REPLIES = {
    "named": lambda samples, scores: {
        "scores": [{"exact": x, "length": float(len(s["response"]))} for x, s in zip(scores, samples)]
    },
    "teapot": lambda samples, scores: PlainTextResponse("no", status_code=418),
    "garbage": lambda samples, scores: PlainTextResponse("<html>Bad gateway</html>"),
    "nan": lambda samples, scores: _raw({"scores": [float("nan")] + scores[1:]}),
    "overflow": lambda samples, scores: Response('{"scores": [1' + "0" * 400 + ", 1]}", media_type="application/json"),
    "inf": lambda samples, scores: _raw({"scores": [{"exact": float("inf")}] * len(samples)}),
    "string": lambda samples, scores: {"scores": ["0.5"] * len(samples)},
    "bool": lambda samples, scores: {"scores": [True] * len(samples)},
    "wrong_count": lambda samples, scores: {"scores": scores[:-1]},
    "huge": lambda samples, scores: {"scores": scores, "padding": "x" * 200_000},
    "null": lambda samples, scores: {"scores": [None] + scores[1:]},
    "reverse": lambda samples, scores: {"scores": scores[::-1]},
    "varying_names": lambda samples, scores: {"scores": [{f"k{s['index'] % 2}": 1.0} for s in samples]},
    "leaky_500": lambda samples, scores: PlainTextResponse(f"internal error, config: {SECRET}", status_code=500),
    "leaky_text": lambda samples, scores: PlainTextResponse(f"<html>{SECRET}</html>"),
    "leaky_json": lambda samples, scores: {"oops": SECRET},
    "leaky_scores": lambda samples, scores: {"scores": [SECRET] * len(samples)},
}


async def _answer(behaviour: str, samples: list[dict], state: RemoteState):
    scores = [score_of(s) for s in samples]
    if behaviour == "ok":
        await asyncio.sleep(0.01)  # long enough for concurrent calls to overlap
    if behaviour == "slow":
        await asyncio.sleep(2)
    if behaviour == "error" or (behaviour == "switch" and state.down):
        return PlainTextResponse("the judge model ran out of memory", status_code=500)
    if behaviour == "flaky" and state.flaky_failures_left > 0:
        state.flaky_failures_left -= 1
        return PlainTextResponse("try again", status_code=503)
    if behaviour == "crash_on_unlabeled" and any(not s["label"] for s in samples):
        return PlainTextResponse("KeyError: 'label'", status_code=500)
    reply = _FIXED_REPLIES.get(behaviour)
    return reply(samples, scores) if reply else {"scores": scores}


class HttpServer:
    """A uvicorn server in the test's loop; stop() waits until it has shut down (the
    start_in_loop fixture calls it at teardown)."""

    def __init__(self, server: uvicorn.Server, task: asyncio.Task) -> None:
        self.server, self.task = server, task

    async def stop(self, grace: float | None = None) -> None:
        self.server.should_exit = True
        await asyncio.wait_for(asyncio.shield(self.task), 10)


async def start_http(app: FastAPI, port: int = 0) -> tuple[HttpServer, int]:
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=1)
    )
    serving = asyncio.get_running_loop().create_task(server.serve())
    while not server.started:
        if serving.done():
            raise RuntimeError(f"test remote did not start on port {port}")
        await asyncio.sleep(0.01)
    return HttpServer(server, serving), server.servers[0].sockets[0].getsockname()[1]


# ---------------------------------------------------------------- helpers


FAST = dict(
    remote_max_retries=2,
    remote_backoff_seconds=0.01,
    remote_backoff_max_seconds=0.05,
    breaker_failure_threshold=3,
    breaker_cooldown_seconds=0.3,
    max_reply_bytes=64 * 1024,
)


def make_sample(index: int, response: str = "42", label: str = "42", group_index: int = 0, **kw) -> Sample:
    return Sample(
        index=index,
        group_index=group_index,
        prompt="What is 6 * 7?",
        tokens=[1, 2, 3, 4],
        response=response,
        response_length=2,
        label=label,
        loss_mask=[1, 1],
        rollout_log_probs=[-0.5, -0.25],
        status=Status.COMPLETED,
        **kw,
    )


class Reward:
    """A reward service on loopback, allowed to call loopback remotes, and a sync stub for it."""

    def __init__(self, start_in_loop, redis_url: str, **settings) -> None:
        settings = {**FAST, "remote_allowed_networks": LOOPBACK, **settings}
        self.server, self.port = start_in_loop(lambda: start_reward(Settings(port=0, redis_url=redis_url, **settings)))
        self.stub = reward_pb2_grpc.RewardStub(sync_channel(f"127.0.0.1:{self.port}"))

    def register(self, name: str, url: str, replace: bool = False, **kw) -> reward_pb2.RemoteService:
        return self.stub.RegisterService(
            reward_pb2.RegisterServiceRequest(
                service=reward_pb2.RemoteService(name=name, url=url, **kw), replace=replace
            ),
            timeout=30,
        )

    def score(self, samples: list[Sample], components: dict[str, float], **kw) -> list[Sample]:
        spec = reward_pb2.RewardSpec(components=components, **kw)
        reply = self.stub.Score(
            reward_pb2.ScoreRequest(samples=[sample_to_proto(s) for s in samples], spec=spec), timeout=30
        )
        return [sample_from_proto(m) for m in reply.samples]

    def score_groups(self, groups: list[SampleGroup], components: dict[str, float]) -> list[SampleGroup]:
        request = reward_pb2.ScoreGroupsRequest(
            groups=[group_to_proto(g) for g in groups], spec=reward_pb2.RewardSpec(components=components)
        )
        return [group_from_proto(g) for g in self.stub.ScoreGroups(request, timeout=30).groups]

    def stats(self, name: str) -> reward_pb2.RemoteServiceStats:
        return next(
            s for s in self.stub.GetStats(reward_pb2.GetRewardStatsRequest(), timeout=10).services if s.name == name
        )


def rpc_error(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


# ---------------------------------------------------------------- registration
