"""Verifiers that cannot be starved: a real reward server on loopback whose built-in
verifiers run in worker processes with a time budget per sample. Adversarial answers are
scored in linear time (or fail with "verifier timeout"), a hung or crashed worker is
replaced while the other samples are scored, and gRPC health reports an overloaded pool
and its recovery."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlmesh.common.grpc_server import start_server, sync_channel
from rlmesh.common.sample import Sample, Status, sample_from_proto, sample_to_proto
from rlmesh.reward.config import Settings
from rlmesh.reward.server import build
from rlmesh.reward.workers import VerifierError, VerifierPool
from rlmesh.v1 import reward_pb2, reward_pb2_grpc
from tests.helpers import verifiers as misbehaving
from tests.helpers.reward import make_sample

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class RewardServer:
    def __init__(self, channel: grpc.Channel) -> None:
        self.stub = reward_pb2_grpc.RewardStub(channel)
        self.health = health_pb2_grpc.HealthStub(channel)

    def score(self, samples: list[Sample], **components: float) -> list[Sample]:
        return self.reply(self.score_async(samples, **components))

    def score_async(self, samples: list[Sample], **components: float) -> grpc.Future:
        request = reward_pb2.ScoreRequest(
            samples=[sample_to_proto(s) for s in samples],
            spec=reward_pb2.RewardSpec(components=components or {"math": 1.0}),
        )
        return self.stub.Score.future(request, timeout=120)

    @staticmethod
    def reply(future: grpc.Future) -> list[Sample]:
        return [sample_from_proto(m) for m in future.result().samples]

    def status(self, service: str = "rlmesh.v1.Reward") -> int:
        return self.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


@pytest.fixture
def reward_server(loop_thread) -> Callable[..., RewardServer]:
    """reward_server(**settings) -> a reward server whose verifier table has the built-ins
    plus tests.helpers.verifiers (hang, held, crash); stopped, pool closed, after the test."""
    started = []

    def start(**overrides) -> RewardServer:
        settings = Settings(**{"port": 0, "default_components": {"math": 1.0}, **overrides})
        service = loop_thread.run(build(settings, misbehaving.VERIFIERS))
        server, port, health = loop_thread.run(start_server(service.bindings, "127.0.0.1:0"))
        loop_thread.run(service.on_start(health))
        channel = sync_channel(f"127.0.0.1:{port}")
        started.append((server, service, channel))
        return RewardServer(channel)

    yield start
    for server, service, channel in started:
        channel.close()
        loop_thread.run(server.stop(None))
        loop_thread.run(service.on_shutdown())


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout:.0f} s"
        time.sleep(0.02)


ORDINARY = [  # (response, label, math reward)
    (r"So the result is \boxed{\frac{1}{2}}.", "0.5", 1.0),
    (r"We get \boxed{2\sqrt{2}}", r"\sqrt{8}", 1.0),
    ("The answer is 42.", "42", 1.0),
    (r"\boxed{3}", "4", 0.0),
]


def ordinary_samples(first_index: int = 0) -> list[Sample]:
    return [make_sample(first_index + i, r, label) for i, (r, label, _) in enumerate(ORDINARY)]


def assert_ordinary_scores(scored: list[Sample]) -> None:
    assert [s.status for s in scored] == [Status.COMPLETED] * len(ORDINARY)
    assert [s.reward for s in scored] == [expected for _, _, expected in ORDINARY]


# ---------------------------------------------------------------- adversarial answers

UNCLOSED = "\\boxed{" * 50_000  # 350k characters: the verifiers read the last max_answer_chars (100k)
NESTED = "\\boxed{" + "{" * 40_000 + "7" + "}" * 40_000 + "}"
PATHOLOGICAL = [  # (response, label, component, reward when scored); all but the first fit in 100k
    (UNCLOSED, "1", "math", 0.0),  # no closed box, no phrase, no number
    (r"\boxed{7} " + "\\boxed{" * 10_000, "7", "math", 1.0),  # the last closed box is the one before them
    (NESTED, "7", "format", 1.0),
    (NESTED, "7", "gsm8k", 1.0),
    ("\\boxed{" + "\\text{" * 12_000 + "7" + "}" * 12_001, "7", "math", 1.0),
    ("The answer" + " " * 90_000 + "is (B)", "B", "multiple_choice", 1.0),
    (r"\boxed{5." + "0" * 90_000 + "}", "5", "math", 1.0),
]


def test_pathological_answers_are_scored_linearly_while_ordinary_ones_go_on(reward_server):
    server = reward_server(verifier_workers=2)
    assert_ordinary_scores(server.score(ordinary_samples()))  # workers up

    attacks = [
        server.score_async([make_sample(i, response, label, metadata={"reward": component})])
        for i, (response, label, component, _) in enumerate(PATHOLOGICAL)
    ]
    ordinary = [server.score_async(ordinary_samples(100 * k)) for k in range(3)]

    for future in ordinary:
        assert_ordinary_scores(server.reply(future))
    for future, (_, _, component, reward) in zip(attacks, PATHOLOGICAL):
        (scored,) = server.reply(future)
        if scored.status == Status.FAILED:  # a machine too slow for the budget: failed, never hung
            assert "verifier timeout" in scored.metadata["reward_error"]
        else:
            assert scored.reward_components == {component: reward}


def test_long_responses_are_read_from_their_tail(reward_server):
    server = reward_server(max_answer_chars=1000)
    head_answer = make_sample(0, r"\boxed{5}" + " filler" * 500, "5")
    tail_answer = make_sample(1, "filler " * 500 + r"\boxed{5}", "5")
    assert [s.reward for s in server.score([head_answer, tail_answer])] == [0.0, 1.0]


# ---------------------------------------------------------------- the time budget


def test_a_hung_verifier_is_killed_and_the_other_samples_are_scored(reward_server):
    server = reward_server(verifier_workers=1, verifier_timeout_seconds=3.0)
    mixed = ordinary_samples()
    mixed.insert(1, make_sample(10, "x", "x", metadata={"reward": "hang"}))
    mixed.insert(3, make_sample(11, "x", "x", metadata={"reward": "hang"}))
    mixed.append(make_sample(12, "x", "x", metadata={"reward": "crash"}))

    scored = server.score(mixed)

    hung, died = [scored[1], scored[3]], scored[-1]
    assert all(s.status == Status.FAILED for s in [*hung, died])
    assert all("hang: verifier timeout" in s.metadata["reward_error"] for s in hung)
    assert "worker process died" in died.metadata["reward_error"]
    assert_ordinary_scores([s for s in scored if s not in [*hung, died]])
    # the single worker was replaced three times, and scoring goes on
    assert_ordinary_scores(server.score(ordinary_samples()))
    stats = server.stub.GetStats(reward_pb2.GetRewardStatsRequest(), timeout=10)
    assert dict(stats.failures_by_component) == {"hang": 2, "crash": 1}


def test_a_caller_that_goes_away_does_not_receive_or_poison_later_answers(tmp_path):
    release = tmp_path / "release"

    async def scenario() -> None:
        pool = VerifierPool(1, timeout_seconds=60, overload_seconds=60, verifiers=misbehaving.VERIFIERS)
        try:
            gone = asyncio.create_task(pool.verify("held", "", str(release), {}))
            await asyncio.sleep(0.5)  # the call reaches the worker (or waits for it): either way it is dropped
            gone.cancel()
            later = asyncio.create_task(pool.verify("math", r"\boxed{3}", "4", {}))
            release.touch()
            assert await later == 0.0  # not the held call's 1.0
        finally:
            pool.close()

    asyncio.run(scenario())


def test_stopping_fails_calls_in_flight_instead_of_leaving_them_hanging(tmp_path):
    async def scenario() -> None:
        pool = VerifierPool(1, timeout_seconds=60, overload_seconds=60, verifiers=misbehaving.VERIFIERS)
        calls = asyncio.gather(
            *(pool.verify("held", "", str(tmp_path / "never"), {}) for _ in range(3)), return_exceptions=True
        )
        await asyncio.sleep(0.5)  # one call at the worker (or all waiting for it)
        pool.close()
        results = await calls
        assert all(isinstance(r, VerifierError) and "stopping" in str(r) for r in results)

    asyncio.run(scenario())


# ---------------------------------------------------------------- health


def test_health_is_not_serving_while_the_pool_is_overloaded(reward_server, tmp_path):
    server = reward_server(verifier_workers=1, verifier_timeout_seconds=60, verifier_overload_seconds=0.2)
    assert_ordinary_scores(server.score(ordinary_samples()))  # the worker is up
    assert server.status() == SERVING

    release = tmp_path / "release"
    busy = server.score_async([make_sample(0, "x", str(release), metadata={"reward": "held"})])
    # (sent together, both calls could go to the worker as one batch, and none would wait)
    wait_until((tmp_path / "release.started").exists, "the held call reaching the worker")
    waiting = server.score_async(ordinary_samples())
    wait_until(lambda: server.status() == NOT_SERVING, "NOT_SERVING while a call waits for the held worker")
    assert server.status("") == NOT_SERVING  # the server as a whole, as load balancers probe it
    assert not waiting.done()

    release.touch()
    assert [s.reward for s in server.reply(busy)] == [1.0]
    assert_ordinary_scores(server.reply(waiting))
    wait_until(lambda: server.status() == SERVING, "SERVING once the backlog cleared")
    assert server.status("") == SERVING


def test_a_worker_is_heard_on_a_descriptor_above_1023():
    """A busy service's descriptors pass 1023, where select() gives up (seen: no verifier
    worker could start late in a long test run)."""
    import os
    import resource

    from rlmesh.reward.workers import readable_now

    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] <= 1500:
        pytest.skip("this machine allows too few descriptors to test one above 1023")
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    r, w = os.pipe()
    high = os.dup2(r, 1500)
    try:
        assert not readable_now(high)
        os.write(w, b"ready")
        assert readable_now(high)
    finally:
        for fd in (r, w, high):
            os.close(fd)
