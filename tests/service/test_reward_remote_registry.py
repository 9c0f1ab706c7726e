"""Remote reward services registered by URL, their registry: registering, listing and
replacing them (a real reward service over gRPC, registrations in a real Redis), where
remotes may live (the URL policy, checked again before every call), no text of a remote's
reply reaching a client, and the coordinator guarding the names the active run uses."""

from __future__ import annotations

import grpc
import httpx
import pytest

from rlmesh.common import auth
from rlmesh.common.auth import client_headers
from rlmesh.common.grpc_server import ServiceBinding, start_server
from rlmesh.common.net import free_port
from rlmesh.common.sample import (
    Status,
    group_from_proto,
    group_to_proto,
)
from rlmesh.coordinator.app import start as start_coordinator
from rlmesh.coordinator.config import Settings as CoordinatorSettings
from rlmesh.v1 import reward_pb2, reward_pb2_grpc
from tests.helpers.dns import fake_dns
from tests.helpers.remote_reward import (
    SECRET,
    Reward,
    make_sample,
    rpc_error,
)


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
        (f"http://{'a' * 70}.example/score", "is not a valid host name"),  # (a label over 63: a codec error before)
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
    # ... but not one a queued run names: it would fail when it starts, after its warm start
    assert api.post("/reward-services", json={**judge, "name": "second"}).status_code == 201
    queued = api.post(
        "/runs",
        json={"model_path": "/models/m", "datasets": [{"name": "d", "path": "d.jsonl"}],
              "reward": {"components": {"second": 1.0}}},
    ).json()  # fmt: skip
    assert queued["status"] == "queued", queued
    r = api.delete("/reward-services/second")
    assert r.status_code == 409 and f"run {queued['id']} is queued" in r.json()["detail"], r.text
    assert api.post("/reward-services", json={**judge, "name": "second", "replace": True}).status_code == 201
    assert api.delete(f"/runs/{queued['id']}").status_code == 200
    assert api.delete("/reward-services/second").json() == {"removed": True}
    for bad in ("x" * 5000, "é", "a%00", "1st"):  # no service could have such a name
        r = api.delete(f"/reward-services/{bad}")
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["path", "name"], r.text
