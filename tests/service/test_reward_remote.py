"""Remote reward services registered by URL: real HTTP servers (uvicorn) and real gRPC
servers on loopback, the reward service over gRPC, registrations in a real Redis.
Misbehaving remotes (slow, 500, garbage, NaN, wrong counts, dying) must give FAILED
samples with the reason (never quoting the remote's reply), open and close the circuit
breaker, and never stop scoring. Where remotes may live (the URL policy), replacing a
name, and the coordinator guarding the names the active run uses."""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict

import grpc
import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from rlmesh.common import auth
from rlmesh.common.auth import client_headers
from rlmesh.common.errors import FailedPrecondition
from rlmesh.common.grpc_server import ServiceBinding, start_server, sync_channel
from rlmesh.common.net import free_port
from rlmesh.common.run_config import RunConfig
from rlmesh.common.sample import (
    Sample,
    SampleGroup,
    Status,
    group_from_proto,
    group_to_proto,
    sample_from_proto,
    sample_to_proto,
)
from rlmesh.coordinator.app import start as start_coordinator
from rlmesh.coordinator.config import Settings as CoordinatorSettings
from rlmesh.coordinator.routes_reward_services import check_reward_service_change
from rlmesh.reward import check
from rlmesh.reward.config import Settings
from rlmesh.reward.remote import CallFailed, RemoteScore, Unit, parse_scores_reply
from rlmesh.reward.resilience import CLOSED, HALF_OPEN, OPEN, BreakerOpen, CallPolicy, CircuitBreaker, pack_batches
from rlmesh.reward.server import start as start_reward
from rlmesh.v1 import reward_pb2, reward_pb2_grpc
from tests.helpers.dns import fake_dns

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


@pytest.fixture
def remote(start_in_loop):
    state = RemoteState()
    _, port = start_in_loop(lambda: start_http(remote_app(state)))
    return state, f"http://127.0.0.1:{port}"


@pytest.fixture
def reward(start_in_loop, redis_url):
    return Reward(start_in_loop, redis_url)


def rpc_error(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


# ---------------------------------------------------------------- registration


def test_register_list_unregister(reward, remote):
    _, url = remote
    registered = reward.register("judge", f"{url}/ok", timeout_seconds=5, weight=0.5)
    assert (registered.protocol, registered.timeout_seconds, registered.weight) == ("http-json", 5.0, 0.5)
    assert registered.max_concurrency == 8 and registered.max_batch_size == 32  # the service's defaults filled in
    listed = reward.stub.ListServices(reward_pb2.ListServicesRequest(), timeout=10).services
    assert [(s.name, s.url) for s in listed] == [("judge", f"{url}/ok")]

    # a taken name is replaced only when the registration says so
    code, message = rpc_error(lambda: reward.register("judge", f"{url}/named", timeout_seconds=5))
    assert code == grpc.StatusCode.ALREADY_EXISTS and "register with replace=true" in message
    assert [s.url for s in reward.stub.ListServices(reward_pb2.ListServicesRequest()).services] == [f"{url}/ok"]
    reward.register("judge", f"{url}/named", timeout_seconds=5, replace=True)
    assert [s.url for s in reward.stub.ListServices(reward_pb2.ListServicesRequest()).services] == [f"{url}/named"]

    assert reward.stub.UnregisterService(reward_pb2.UnregisterServiceRequest(name="judge")).removed
    assert not reward.stub.UnregisterService(reward_pb2.UnregisterServiceRequest(name="judge")).removed
    code, message = rpc_error(lambda: reward.score([make_sample(0)], {"judge": 1.0}))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "unknown reward component 'judge'" in message


def test_a_remote_with_its_own_credential(reward, remote):
    _, url = remote
    code, message = rpc_error(lambda: reward.register("judge", f"{url}/authed", timeout_seconds=5))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "HTTP 401" in message
    reward.register("judge", f"{url}/authed", timeout_seconds=5, bearer_token="s3cret")
    [scored] = reward.score([make_sample(0)], {"judge": 1.0})
    assert scored.status == Status.COMPLETED and scored.reward == 1.0
    # never in clear text over the network, never in the URL, and only a token's characters
    for bad_url, token, why in (
        ("http://judge.example/score", "s3cret", "only over https://"),
        ("http://user:pw@127.0.0.1:9/score", "", "user name or password"),
        (f"{url}/authed", "s3cr\u00e9t", "RFC 6750"),
    ):
        code, message = rpc_error(lambda: reward.register("j2", bad_url, bearer_token=token))  # noqa: B023
        assert code == grpc.StatusCode.INVALID_ARGUMENT and why in message and "pw" not in message
    # the credential is write-only
    [listed] = reward.stub.ListServices(reward_pb2.ListServicesRequest(), timeout=10).services
    assert listed.bearer_token == ""


def test_registration_is_refused_when_the_service_does_not_answer(reward, remote):
    _, url = remote
    dead = f"http://127.0.0.1:{free_port()}/score"
    code, message = rpc_error(lambda: reward.register("judge", dead, timeout_seconds=2))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "registration of 'judge' refused" in message and "cannot connect" in message and dead in message

    code, message = rpc_error(lambda: reward.register("judge", f"grpc://127.0.0.1:{free_port()}", timeout_seconds=0.5))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "UNAVAILABLE" in message

    # answers, but not per the contract (a 404 page; a service whose probe reply is garbage)
    code, message = rpc_error(lambda: reward.register("judge", f"{url}/no/such/path", timeout_seconds=2))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "HTTP 404" in message
    assert reward.stub.ListServices(reward_pb2.ListServicesRequest()).services == []


@pytest.mark.parametrize(
    "url,reason",
    [
        ("ftp://judge.example/score", "only http://, https:// and grpc:// URLs are accepted, not ftp://"),
        ("file:///etc/passwd", "only http://, https:// and grpc://"),
        ("judge:8000/score", "only http://, https:// and grpc://"),
        ("grpc://judge", "needs a port"),
        ("grpc://judge:50053/path", "host:port only"),
        ("http://", "has no host"),
    ],
)
def test_only_http_https_and_grpc_urls(reward, url, reason):
    code, message = rpc_error(lambda: reward.register("judge", url))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and reason in message


def test_bad_registrations(reward, remote):
    _, url = remote
    for kw, reason in (
        (dict(name="math"), "already a built-in verifier"),
        (dict(name="has space"), "not valid"),
        (dict(name="a/b"), "not valid"),
        (dict(name="judge", protocol="grpc"), "does not match the URL"),
        (dict(name="judge", timeout_seconds=-1), "timeout_seconds"),
        (dict(name="judge", weight=float("nan")), "weight: Input should be a finite number"),
    ):
        code, message = rpc_error(lambda: reward.register(url=f"{url}/ok", **kw))  # noqa: B023
        assert code == grpc.StatusCode.INVALID_ARGUMENT and reason in message, (kw, message)
    code, message = rpc_error(lambda: reward.stub.RegisterService(reward_pb2.RegisterServiceRequest()))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "no service" in message


def test_registry_survives_a_restart(start_in_loop, redis_url, remote, loop_thread):
    _, url = remote
    first = Reward(start_in_loop, redis_url)
    first.register("judge", f"{url}/ok", timeout_seconds=5, max_concurrency=3)
    loop_thread.run(first.server.stop(None))

    second = Reward(start_in_loop, redis_url)
    [listed] = second.stub.ListServices(reward_pb2.ListServicesRequest()).services
    assert (listed.name, listed.max_concurrency) == ("judge", 3)
    [s] = second.score([make_sample(0)], {"judge": 1.0})
    assert s.status == Status.COMPLETED and s.reward == 1.0

    # a replica sharing the Redis sees registrations made through another one
    third = Reward(start_in_loop, redis_url)
    second.register("judge2", f"{url}/named", timeout_seconds=5)
    [s] = third.score([make_sample(0)], {"judge2/exact": 1.0})
    assert s.reward == 1.0


def test_without_redis_registrations_live_in_memory(start_in_loop, remote):
    _, url = remote
    reward = Reward(start_in_loop, redis_url="")
    reward.register("judge", f"{url}/ok", timeout_seconds=5)
    assert [s.name for s in reward.stub.ListServices(reward_pb2.ListServicesRequest()).services] == ["judge"]
    assert reward.score([make_sample(0)], {"judge": 1.0})[0].reward == 1.0


# ---------------------------------------------------------------- where remotes may live; what clients see


def test_loopback_remotes_only_where_the_operator_allows_them(start_in_loop, redis_url, remote):
    state, url = remote
    strict = Reward(start_in_loop, redis_url, remote_allowed_networks=[])  # the default: public addresses only
    code, message = rpc_error(lambda: strict.register("judge", f"{url}/ok", timeout_seconds=2))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "resolves to a loopback address" in message and "remote_allowed_networks" in message
    assert state.requests == 0  # refused before anything was sent
    assert strict.stub.ListServices(reward_pb2.ListServicesRequest()).services == []


@pytest.mark.parametrize(
    "url",
    [
        "http://169.254.169.254/latest/meta-data/iam/security-credentials/",
        "http://[fe80::1]:8000/score",
        "http://metadata.google.internal/computeMetadata/v1/",
        "http://[::ffff:169.254.169.254]/score",
        "http://0.0.0.0:{port}/ok",
        "grpc://169.254.169.254:50053",
    ],
)
def test_link_local_and_metadata_addresses_are_never_called(start_in_loop, redis_url, remote, url):
    state, remote_url = remote
    anything = Reward(start_in_loop, redis_url, remote_allowed_networks=["0.0.0.0/0", "::/0"])
    code, message = rpc_error(lambda: anything.register("judge", url.format(port=remote_url.rsplit(":", 1)[1])))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "never calls" in message
    assert state.requests == 0


def test_a_name_is_checked_again_before_every_call(reward, remote, monkeypatch):
    state, url = remote
    dns = fake_dns(monkeypatch)
    port = url.rsplit(":", 1)[1]
    dns["judge.test"] = ["127.0.0.1"]
    reward.register("judge", f"http://judge.test:{port}/ok", timeout_seconds=2)
    [s] = reward.score([make_sample(0)], {"judge": 1.0})
    assert s.status == Status.COMPLETED and s.reward == 1.0

    dns["judge.test"] = ["169.254.169.254"]  # DNS rebinding: the name now points at the metadata endpoint
    sent = state.requests
    [s] = reward.score([make_sample(0)], {"judge": 1.0, "exact_match": 1.0})
    assert s.status == Status.FAILED
    assert "judge.test resolves to a link-local address" in s.metadata["reward_error"]
    assert "(1 attempt)" in s.metadata["reward_error"]  # not retried: it would not change
    assert state.requests == sent

    dns["judge.test"] = ["127.0.0.1"]
    [s] = reward.score([make_sample(0)], {"judge": 1.0})
    assert s.status == Status.COMPLETED


class LeakyGrpcReward(reward_pb2_grpc.RewardServicer):
    """A gRPC remote whose errors carry a secret: a status message, or samples it marks FAILED."""

    def __init__(self) -> None:
        self.abort = False

    async def ScoreGroups(self, request, context):
        if self.abort:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad request; by the way {SECRET}")
        reply = reward_pb2.ScoreGroupsResponse()
        for group in request.groups:
            answer = group_from_proto(group)
            for s in answer.samples:
                s.status, s.metadata["reward_error"] = Status.FAILED, f"cannot score: {SECRET}"
            reply.groups.append(group_to_proto(answer))
        return reply


def test_no_text_of_a_remote_reply_reaches_a_client(start_in_loop, reward, remote):
    _, url = remote
    # registration: the probe's reply is never quoted
    code, message = rpc_error(lambda: reward.register("judge", f"{url}/leaky", timeout_seconds=2))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "HTTP 500" in message and SECRET not in message

    leaky_grpc = LeakyGrpcReward()

    async def start_leaky():
        server, port, _ = await start_server(
            [ServiceBinding(leaky_grpc, reward_pb2_grpc.add_RewardServicer_to_server, "rlmesh.v1.Reward")],
            "127.0.0.1:0",
        )
        return server, port

    _, grpc_port = start_in_loop(start_leaky)
    reward.register("upstream", f"grpc://127.0.0.1:{grpc_port}", timeout_seconds=2, bearer_token=auth.stack_token())
    for behaviour in ("leaky_500", "leaky_text", "leaky_json", "leaky_scores"):
        reward.register(behaviour, f"{url}/{behaviour}", timeout_seconds=2)

    samples = [make_sample(0), make_sample(1)]
    seen = []
    for component in ("leaky_500", "leaky_text", "leaky_json", "leaky_scores", "upstream"):
        scored = reward.score(samples, {component: 1.0})
        assert all(s.status == Status.FAILED for s in scored)
        seen.append(scored[0].metadata["reward_error"])
    leaky_grpc.abort = True
    seen.append(reward.score(samples, {"upstream": 1.0})[0].metadata["reward_error"])
    stats = reward.stub.GetStats(reward_pb2.GetRewardStatsRequest(), timeout=10)
    listed = reward.stub.ListServices(reward_pb2.ListServicesRequest(), timeout=10)

    assert [reason.split(" (")[0] for reason in seen] == [
        f"leaky_500: HTTP 500 from {url}/leaky_500",
        "leaky_text: the reply is not valid JSON",
        'leaky_json: the reply must be an object {"scores": [...]} with one score per sample, got an object '
        'without a "scores" list',
        "leaky_scores: the score is a JSON string, not a number",
        "upstream: the remote marked it FAILED",
        f"upstream: INVALID_ARGUMENT from grpc://127.0.0.1:{grpc_port}",
    ]
    for text in (*seen, str(stats), str(listed)):
        assert SECRET not in text and "very-secret" not in text


# ---------------------------------------------------------------- the coordinator guards the active run's services


def test_the_active_runs_reward_services_cannot_be_swapped(start_in_loop, redis_url, reward, remote, silent_address):
    _, url = remote
    _, port = start_in_loop(
        lambda: start_coordinator(
            CoordinatorSettings(
                port=0,
                redis_url=redis_url,
                buffer_address=silent_address,
                rollout_address=silent_address,
                reward_address=f"127.0.0.1:{reward.port}",
                trainer_address=silent_address,
            )
        )
    )
    api = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30, headers=client_headers())
    judge = {"name": "judge", "url": f"{url}/ok", "timeout_seconds": 5}
    assert api.post("/reward-services", json=judge).status_code == 201
    r = api.post("/reward-services", json={**judge, "url": f"{url}/named"})
    assert r.status_code == 409 and r.json()["code"] == "ALREADY_EXISTS" and "replace" in r.json()["detail"]
    assert api.post("/reward-services", json={**judge, "replace": True}).status_code == 201  # no run: fine

    run = api.post(
        "/runs",
        json={
            "model_path": "/models/m",
            "datasets": [{"name": "d", "path": "d.jsonl"}],
            "reward": {"components": {"judge/exact": 1.0, "math": 0.5}},
        },
    )
    assert run.status_code == 201, run.text
    run_id = run.json()["id"]
    for r in (
        api.delete("/reward-services/judge"),
        api.post("/reward-services", json={**judge, "url": f"{url}/named", "replace": True}),
    ):
        assert (
            r.status_code == 409
            and f"run {run_id} is active and its reward uses the reward service 'judge'" in r.json()["detail"]
        )
    assert [s["url"] for s in api.get("/reward-services").json()] == [f"{url}/ok"]  # unchanged

    # names the run does not use are free
    assert api.post("/reward-services", json={**judge, "name": "other"}).status_code == 201
    assert api.delete("/reward-services/other").json() == {"removed": True}


def test_a_run_without_components_uses_every_weighted_service():
    config = RunConfig.model_validate(
        {"model_path": "m", "datasets": [{"name": "d", "path": "d.jsonl"}], "reward": {"components": {}}}
    )
    registered = {"weighted": 1.0, "unweighted": 0.0}
    with pytest.raises(FailedPrecondition, match="'weighted'"):
        check_reward_service_change("r1", config, "weighted", registered, removes=True)
    check_reward_service_change("r1", config, "unweighted", registered, removes=True)
    with pytest.raises(FailedPrecondition, match="would take it in"):  # a new weighted one would join its reward
        check_reward_service_change("r1", config, "new", registered, removes=False, new_weight=0.5)
    check_reward_service_change("r1", config, "new", registered, removes=False)


# ---------------------------------------------------------------- scoring through remotes


def test_remote_scores_are_components_beside_the_total(reward, remote):
    _, url = remote
    reward.register("judge", f"{url}/ok", timeout_seconds=5)
    reward.register("multi", f"{url}/named", timeout_seconds=5)
    right, wrong = make_sample(0, r"\boxed{42}", "42"), make_sample(1, "41", "42")
    scored = reward.score([right, wrong], {"math": 1.0, "judge": 0.5, "multi/length": 0.1})
    assert [s.status for s in scored] == [Status.COMPLETED] * 2
    assert scored[0].reward_components == {"math": 1.0, "judge": 0.0, "multi/exact": 0.0, "multi/length": 10.0}
    assert scored[0].reward == pytest.approx(1.0 + 0.0 + 1.0)
    assert scored[1].reward_components == {"math": 0.0, "judge": 0.0, "multi/exact": 0.0, "multi/length": 2.0}

    # named scores: the whole service needs reward_key, an unknown name fails clearly
    [s] = reward.score([make_sample(0)], {"multi": 1.0}, reward_key="exact")
    assert s.reward == 1.0
    [s] = reward.score([make_sample(0)], {"multi": 1.0})
    assert (
        s.status == Status.FAILED
        and "name one in the spec as 'multi/<name>' or set reward_key" in s.metadata["reward_error"]
    )
    [s] = reward.score([make_sample(0)], {"multi/style": 1.0})
    assert "returned no score named 'style' (it returned: exact, length)" in s.metadata["reward_error"]


def test_per_sample_override_and_registered_weight_as_default(reward, remote):
    _, url = remote
    reward.register("judge", f"{url}/ok", timeout_seconds=5, weight=2.0)
    plain, override = make_sample(0), make_sample(1, metadata={"reward": {"judge": 3.0}})
    scored = reward.score([plain, override], {"exact_match": 1.0})
    assert scored[0].reward_components == {"exact_match": 1.0} and scored[1].reward == 3.0
    # an empty spec: the service's defaults plus every registered service with a weight
    [s] = reward.score([make_sample(0)], {})
    assert s.reward_components == {"exact_match": 1.0, "judge": 1.0} and s.reward == 3.0


def test_groups_travel_whole_batched_and_capped(reward, remote):
    state, url = remote
    reward.register("judge", f"{url}/ok", timeout_seconds=5, max_batch_size=4, max_concurrency=2)
    groups = [SampleGroup(f"g{g}", g, [make_sample(3 * g + i, group_index=g) for i in range(3)]) for g in range(6)]
    scored = reward.score_groups(groups, {"judge": 1.0})
    assert all(s.reward == 1.0 for g in scored for s in g.samples)
    # 3 + 3 > 4: one group per request, never split; at most 2 requests in flight
    assert sorted(state.batches["ok"]) == [[3 * g + i for i in range(3)] for g in range(6)]
    assert state.max_in_flight <= 2

    state.batches.clear()
    reward.score([make_sample(i) for i in range(10)], {"judge": 1.0})  # one by one: packed 4 + 4 + 2
    assert sorted(len(b) for b in state.batches["ok"]) == [2, 4, 4]


@pytest.mark.parametrize(
    "behaviour,reason,failed",
    [
        ("slow", "judge: no answer within 0.2 s (3 attempts)", [0, 1]),
        ("error", "judge: HTTP 500 from http://127.0.0.1:{port}/error (3 attempts)", [0, 1]),
        ("teapot", "judge: HTTP 418 from", [0, 1]),  # not retried
        ("garbage", "judge: the reply is not valid JSON (1 attempt)", [0, 1]),
        ("nan", "judge: the score is nan (scores must be finite numbers)", [0]),
        ("inf", "judge: named score 'exact' is inf", [0, 1]),
        ("string", "judge: the score is a JSON string, not a number", [0, 1]),
        ("bool", "judge: the score is a JSON boolean, not a number", [0, 1]),
        ("wrong_count", "judge: the reply has 1 scores for 2 samples (1 attempt)", [0, 1]),
        ("huge", "judge: the reply is", [0, 1]),  # larger than max_reply_bytes
        ("overflow", "judge: the score is an integer too large for a float", [0]),
        ("null", "judge: the service returned null: it could not score this sample", [0]),
    ],
)
def test_misbehaving_remote_fails_samples_with_the_reason(reward, remote, behaviour, reason, failed):
    _state, url = remote
    reward.register("judge", f"{url}/{behaviour}", timeout_seconds=0.2, max_batch_size=2)
    scored = reward.score_groups(
        [SampleGroup("g", 0, [make_sample(0), make_sample(1)])], {"exact_match": 1.0, "judge": 1.0}
    )
    samples = scored[0].samples
    for i, s in enumerate(samples):
        if i in failed:
            assert s.status == Status.FAILED, s
            assert reason.format(port=url.rsplit(":", 1)[1]) in s.metadata["reward_error"]
            assert s.metadata["reward_failed_components"] == ["judge"]
            assert s.reward_components["exact_match"] == 1.0  # what worked is kept
        else:
            assert s.status == Status.COMPLETED and s.reward == 2.0
    stats = reward.stub.GetStats(reward_pb2.GetRewardStatsRequest(), timeout=10)
    assert stats.samples_failed == len(failed) and stats.failures_by_component["judge"] == len(failed)
    assert next(s for s in stats.services if s.name == "judge").samples_failed == len(failed)
    if behaviour == "huge":
        assert "larger than max_reply_bytes (65536)" in samples[0].metadata["reward_error"]


def test_retries_recover_from_a_brief_outage(reward, remote):
    state, url = remote
    reward.register("judge", f"{url}/flaky", timeout_seconds=5)
    state.flaky_failures_left = 2  # two 503s, then fine: within remote_max_retries=2
    [s] = reward.score([make_sample(0)], {"judge": 1.0})
    assert s.status == Status.COMPLETED and s.reward == 1.0
    stats = reward.stats("judge")
    assert (stats.calls, stats.failures, stats.retries, stats.breaker_state) == (3, 2, 2, "closed")


def wait_until_breaker_admits(reward: Reward, components: dict[str, float]) -> Sample:
    """Score until the answer is no longer 'breaker open' (the cool-down is 0.3 s)."""
    deadline = time.monotonic() + 30
    while True:
        [s] = reward.score([make_sample(0)], components)
        if "circuit breaker open" not in s.metadata.get("reward_error", "") or time.monotonic() > deadline:
            return s
        time.sleep(0.05)


def test_breaker_opens_fails_fast_and_closes_on_success(reward, remote):
    state, url = remote
    reward.register("judge", f"{url}/switch", timeout_seconds=5)
    state.down = True
    [s] = reward.score([make_sample(0)], {"judge": 1.0})  # 3 attempts = 3 consecutive failures: opens
    assert s.status == Status.FAILED and "HTTP 500" in s.metadata["reward_error"]
    stats = reward.stats("judge")
    assert (stats.breaker_state, stats.breaker_opened, stats.consecutive_failures) == ("open", 1, 3)

    calls = stats.calls
    [s] = reward.score([make_sample(0)], {"judge": 1.0, "exact_match": 1.0})  # fails fast, nothing sent
    assert (
        s.status == Status.FAILED
        and "judge: circuit breaker open after 3 consecutive failures" in s.metadata["reward_error"]
    )
    assert "last: HTTP 500" in s.metadata["reward_error"] and reward.stats("judge").calls == calls

    # half-open: the trial fails, the breaker opens again
    s = wait_until_breaker_admits(reward, {"judge": 1.0})
    assert s.status == Status.FAILED and "HTTP 500" in s.metadata["reward_error"]
    assert "(1 attempt; the circuit breaker is now open)" in s.metadata["reward_error"]
    assert (reward.stats("judge").breaker_state, reward.stats("judge").breaker_opened) == ("open", 2)

    # the service is back: the next trial succeeds and closes the breaker
    state.down = False
    s = wait_until_breaker_admits(reward, {"judge": 1.0})
    assert s.status == Status.COMPLETED and s.reward == 1.0
    assert reward.stats("judge").breaker_state == "closed" and reward.stats("judge").consecutive_failures == 0


def test_a_remote_that_dies_mid_run(start_in_loop, loop_thread, redis_url):
    state = RemoteState()
    server, port = start_in_loop(lambda: start_http(remote_app(state)))
    reward = Reward(start_in_loop, redis_url)
    reward.register("judge", f"http://127.0.0.1:{port}/ok", timeout_seconds=2)

    def group(g):
        return SampleGroup(f"g{g}", g, [make_sample(3 * g + i, group_index=g) for i in range(3)])

    assert all(s.reward == 1.0 for s in reward.score_groups([group(0)], {"judge": 1.0})[0].samples)

    loop_thread.run(server.stop())  # the remote dies
    for g in (1, 2):  # every later step still gets an answer promptly: FAILED samples with the reason
        [scored] = reward.score_groups([group(g)], {"judge": 1.0, "exact_match": 0.5})
        assert all(s.status == Status.FAILED for s in scored.samples)
        assert (
            "judge: cannot connect" in scored.samples[0].metadata["reward_error"]
            or "circuit breaker open" in scored.samples[0].metadata["reward_error"]
        )
    assert reward.stats("judge").breaker_state == "open"

    server, _ = start_in_loop(lambda: start_http(remote_app(state), port))  # back on the same port
    s = wait_until_breaker_admits(reward, {"judge": 1.0})
    assert s.status == Status.COMPLETED and reward.stats("judge").breaker_state == "closed"


# ---------------------------------------------------------------- the gRPC protocol


class ReorderingReward(reward_pb2_grpc.RewardServicer):
    """A remote that breaks the contract: it answers with the samples reversed."""

    async def ScoreGroups(self, request, context):
        reply = reward_pb2.ScoreGroupsResponse()
        for group in request.groups:
            answer = reply.groups.add()
            answer.CopyFrom(group)
            del answer.samples[:]
            answer.samples.extend(reversed(group.samples))
        return reply


def test_grpc_remote(start_in_loop, redis_url, reward):
    # another rlmesh reward service is a valid remote
    _, remote_port = start_in_loop(
        lambda: start_reward(Settings(port=0, default_components={"math": 1.0, "format": 0.5}))
    )
    # it wants the stack's token: the registration carries it as the remote's credential
    registered = reward.register(
        "upstream", f"grpc://127.0.0.1:{remote_port}", timeout_seconds=5, bearer_token=auth.stack_token()
    )
    assert registered.protocol == "grpc"
    right, wrong, unlabeled = (
        make_sample(0, r"\boxed{42}", "42"),
        make_sample(1, r"\boxed{41}", "42"),
        make_sample(2, "x", ""),
    )
    groups = [SampleGroup("g", 0, [right, wrong, unlabeled])]
    samples = reward.score_groups(groups, {"upstream": 1.0, "upstream/format": 1.0})[0].samples
    assert samples[0].reward_components == {"upstream": 1.5, "upstream/math": 1.0, "upstream/format": 1.0}
    assert samples[0].reward == 2.5 and samples[1].reward == 1.5
    assert samples[2].status == Status.FAILED
    assert "upstream: the remote marked it FAILED" in samples[2].metadata["reward_error"]

    async def start_reordering():
        server, port, _ = await start_server(
            [ServiceBinding(ReorderingReward(), reward_pb2_grpc.add_RewardServicer_to_server, "rlmesh.v1.Reward")],
            "127.0.0.1:0",
        )
        return server, port

    _, bad_port = start_in_loop(start_reordering)
    reward.register(
        "reorders",
        f"grpc://127.0.0.1:{bad_port}",
        timeout_seconds=5,  # one sample: order is fine
        bearer_token=auth.stack_token(),
    )
    [scored] = reward.score_groups([SampleGroup("g", 0, [make_sample(0), make_sample(1)])], {"reorders": 1.0})
    assert (
        "the reply has sample 1 where sample 0 was sent (order must be kept)"
        in scored.samples[0].metadata["reward_error"]
    )


# ---------------------------------------------------------------- plain logic


def test_circuit_breaker_states():
    now = [0.0]
    breaker = CircuitBreaker(threshold=2, cooldown=10, clock=lambda: now[0])

    async def scenario():
        assert await breaker.acquire() is False
        breaker.record_failure("boom")
        assert breaker.state == CLOSED  # one failure is not enough
        breaker.record_failure("boom")
        assert breaker.state == OPEN
        with pytest.raises(BreakerOpen, match="after 2 consecutive failures \\(last: boom\\); next try in 10.0 s"):
            await breaker.acquire()
        now[0] = 10.0
        assert await breaker.acquire() is True and breaker.state == HALF_OPEN  # the trial
        waiter = asyncio.ensure_future(breaker.acquire())  # others wait for the trial's outcome
        await asyncio.sleep(0)
        assert not waiter.done()
        breaker.record_success()
        assert await waiter is False and breaker.state == CLOSED and breaker.consecutive_failures == 0

        breaker.record_failure("a"), breaker.record_failure("b")
        now[0] = 25.0
        assert await breaker.acquire() is True
        waiter = asyncio.ensure_future(breaker.acquire())
        await asyncio.sleep(0)
        breaker.record_failure("trial failed")  # half-open failure: open again at once
        with pytest.raises(BreakerOpen):
            await waiter
        assert breaker.times_opened == 3

    asyncio.run(scenario())


def test_backoff_is_exponential_capped_and_jittered():
    policy = CallPolicy(backoff_base_seconds=0.1, backoff_max_seconds=0.5)
    for retry, ceiling in ((1, 0.1), (2, 0.2), (3, 0.4), (4, 0.5), (10, 0.5)):
        delays = {policy.backoff(retry) for _ in range(20)}
        assert all(ceiling / 2 <= d <= ceiling for d in delays) and len(delays) > 1


def test_batches_keep_units_whole():
    units = [Unit([make_sample(i) for i in range(n)]) for n in (2, 2, 5, 1)]
    assert [[len(u.samples) for u in b] for b in pack_batches(units, 4)] == [[2, 2], [5], [1]]


def test_http_reply_parsing():
    assert parse_scores_reply(b'{"scores": [1, 0.5, {"a": 2}, null]}', 4)[:3] == [
        RemoteScore(1.0),
        RemoteScore(0.5),
        RemoteScore(None, {"a": 2.0}),
    ]
    for body, reason in (
        (b"[1, 2]", "the reply must be an object"),
        (b'{"score": [1]}', "must be an object"),
        (b'{"scores": [1]}', "1 scores for 2 samples"),
        (b"\xff\xfe", "not valid JSON"),
    ):
        with pytest.raises(CallFailed, match=reason):
            parse_scores_reply(body, 2)
    assert parse_scores_reply(b'{"scores": [1e999, {}]}', 2) == [
        "the score is inf (scores must be finite numbers)",
        "the service returned an empty object instead of named scores",
    ]


# ---------------------------------------------------------------- the conformance kit


def test_check_passes_a_good_service(remote, capsys):
    _, url = remote
    assert check.main([f"{url}/ok", "--latency-calls", "3", "--batch-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "6 passed, 0 failed" in out
    for name in check.CHECKS:
        assert f"{name}" in out and "FAIL" not in out


def test_check_passes_an_rlmesh_grpc_service(start_in_loop, capsys, tmp_path):
    _, port = start_in_loop(lambda: start_reward(Settings(port=0, default_components={"math": 1.0})))
    token_file = tmp_path / "token"
    token_file.write_text(auth.stack_token())
    assert check.main([f"grpc://127.0.0.1:{port}", "--latency-calls", "2", "--batch-size", "4"]) == 1  # no token
    assert "UNAUTHENTICATED" in capsys.readouterr().out
    assert (
        check.main(
            [f"grpc://127.0.0.1:{port}", "--latency-calls", "2", "--batch-size", "4", "--token-file", str(token_file)]
        )
        == 0
    )
    assert "6 passed, 0 failed" in capsys.readouterr().out


@pytest.mark.parametrize(
    "behaviour,failing",
    [
        ("nan", "answers"),
        ("garbage", "answers"),
        ("error", "answers"),
        ("slow", "answers"),
        ("wrong_count", "answers"),
        ("null", "answers"),
        ("reverse", "ordering"),
        ("varying_names", "shapes"),
        ("crash_on_unlabeled", "errors"),
        ("lenient", "errors"),
    ],
)
def test_check_fails_a_bad_service(remote, capsys, behaviour, failing):
    _, url = remote
    assert check.main([f"{url}/{behaviour}", "--timeout", "0.5", "--latency-calls", "2", "--batch-size", "4"]) == 1
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[2:-1]}
    assert "FAIL" in rows[failing]


def test_check_refuses_a_bad_url(capsys):
    assert check.main(["ftp://x/score"]) == 2
    assert "only http://, https:// and grpc://" in capsys.readouterr().out
