"""Remote reward services scoring: real HTTP servers (uvicorn) and real gRPC servers on
loopback, the reward service over gRPC. Misbehaving remotes (slow, 500, garbage, NaN, wrong
counts, dying) must give FAILED samples with the reason, open and close the circuit
breaker, and never stop scoring; `rlmesh check` of a remote. Registration and the URL
policy: test_reward_remote_registry.py."""

from __future__ import annotations

import asyncio
import time

import pytest

from rlmesh.common import auth
from rlmesh.common.errors import FailedPrecondition
from rlmesh.common.grpc_server import ServiceBinding, start_server
from rlmesh.common.run_config import RunConfig
from rlmesh.common.sample import (
    Sample,
    SampleGroup,
    Status,
)
from rlmesh.coordinator.routes_reward_services import check_reward_service_change
from rlmesh.reward import check
from rlmesh.reward.config import Settings
from rlmesh.reward.remote import CallFailed, RemoteScore, Unit, parse_scores_reply
from rlmesh.reward.resilience import CLOSED, HALF_OPEN, OPEN, BreakerOpen, CallPolicy, CircuitBreaker, pack_batches
from rlmesh.reward.server import start as start_reward
from rlmesh.v1 import reward_pb2, reward_pb2_grpc
from tests.helpers.remote_reward import (
    RemoteState,
    Reward,
    make_sample,
    remote_app,
    start_http,
)


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
    # A short deadline only where slowness is the fault: on a busy machine a sound answer can
    # take over 0.5 s, and a failed "answers" check ends the run before the others.
    timeout = "0.5" if behaviour == "slow" else "10"
    assert check.main([f"{url}/{behaviour}", "--timeout", timeout, "--latency-calls", "2", "--batch-size", "4"]) == 1
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[2:-1]}
    assert "FAIL" in rows[failing]


def test_check_refuses_a_bad_url(capsys):
    assert check.main(["ftp://x/score"]) == 2
    assert "only http://, https:// and grpc://" in capsys.readouterr().out
