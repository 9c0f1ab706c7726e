"""Reward service contract over gRPC on loopback: scoring, groups, errors, stats."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlmesh.common import errors
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
from rlmesh.reward.scoring import RewardSpec, Scorer
from rlmesh.reward.server import start
from rlmesh.v1 import reward_pb2, reward_pb2_grpc, sample_pb2
from tests.helpers.reward import CUSTOM, GROUP, make_sample


@pytest.fixture
def reward_channel(loop_thread):
    settings = Settings(port=0, default_components={"math": 1.0}, custom_functions=CUSTOM, group_functions=GROUP)
    server, port = loop_thread.run(start(settings))
    channel = sync_channel(f"127.0.0.1:{port}")
    yield channel
    channel.close()
    loop_thread.run(server.stop(None))


def test_score_over_grpc(reward_channel):
    stub = reward_pb2_grpc.RewardStub(reward_channel)
    samples = [
        make_sample(0, r"\boxed{\frac{1}{2}}", "0.5"),
        make_sample(1, r"\boxed{2}", "0.5"),
        make_sample(2, "x", ""),
    ]
    reply = stub.Score(reward_pb2.ScoreRequest(samples=[sample_to_proto(s) for s in samples]), timeout=30)
    scored = [sample_from_proto(m) for m in reply.samples]
    assert [s.reward for s in scored] == [1.0, 0.0, 0.0]
    assert [s.status for s in scored] == [Status.COMPLETED, Status.COMPLETED, Status.FAILED]
    assert "no label" in scored[2].metadata["reward_error"]
    assert scored[0].tokens == samples[0].tokens and scored[0].loss_mask == [1, 1]  # nothing else changed

    spec = reward_pb2.RewardSpec(components={"contains_label": 1.0, "format": 0.5}, reward_key="score")
    reply = stub.Score(reward_pb2.ScoreRequest(samples=[sample_to_proto(samples[0])], spec=spec), timeout=30)
    assert dict(reply.samples[0].reward_components) == {"contains_label": 0.0, "format": 1.0}
    assert reply.samples[0].reward == 0.5

    health = health_pb2_grpc.HealthStub(reward_channel)
    status = health.Check(health_pb2.HealthCheckRequest(service="rlmesh.v1.Reward"), timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING


def test_score_groups_over_grpc(reward_channel):
    stub = reward_pb2_grpc.RewardStub(reward_channel)
    groups = [
        SampleGroup(f"g{g}", g, [make_sample(4 * g + i, "y" * (i + 1), "y", group_index=g) for i in range(4)])
        for g in range(2)
    ]
    spec = reward_pb2.RewardSpec(components={"shortest": 1.0, "exact_match": 0.5})
    reply = stub.ScoreGroups(
        reward_pb2.ScoreGroupsRequest(groups=[group_to_proto(g) for g in groups], spec=spec), timeout=30
    )
    scored = [group_from_proto(m) for m in reply.groups]
    assert [g.group_id for g in scored] == ["g0", "g1"]
    assert [g.rewards for g in scored] == [[1.5, 0.0, 0.0, 0.0]] * 2


def _code_and_message(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def test_bad_requests_over_grpc(reward_channel):
    stub = reward_pb2_grpc.RewardStub(reward_channel)
    good = sample_to_proto(make_sample(0, "x", "x"))

    code, message = _code_and_message(lambda: stub.Score(reward_pb2.ScoreRequest(), timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "no samples" in message
    code, message = _code_and_message(lambda: stub.ScoreGroups(reward_pb2.ScoreGroupsRequest(), timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "no groups" in message
    empty_group = reward_pb2.ScoreGroupsRequest(groups=[sample_pb2.SampleGroup(group_id="g7")])
    code, message = _code_and_message(lambda: stub.ScoreGroups(empty_group, timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "'g7'" in message

    unknown = reward_pb2.ScoreRequest(samples=[good], spec=reward_pb2.RewardSpec(components={"nope": 1.0}))
    code, message = _code_and_message(lambda: stub.Score(unknown, timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "unknown reward component 'nope'" in message
    assert "length_bonus" in message and "math" in message  # lists what is known

    malformed = sample_pb2.Sample()
    malformed.CopyFrom(good)
    malformed.loss_mask = bytes([1, 1, 1])  # three mask entries, response_length 2
    code, message = _code_and_message(lambda: stub.Score(reward_pb2.ScoreRequest(samples=[malformed]), timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "loss_mask has 3 entries but response_length is 2" in message

    # without Redis, registrations live in memory; none yet
    assert list(stub.ListServices(reward_pb2.ListServicesRequest(), timeout=10).services) == []
    code, message = _code_and_message(lambda: stub.UnregisterService(reward_pb2.UnregisterServiceRequest(), timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "no name" in message


def test_stats_count_scored_and_failed_samples(reward_channel):
    stub = reward_pb2_grpc.RewardStub(reward_channel)
    samples = [make_sample(0, r"\boxed{1}", "1"), make_sample(1, r"\boxed{1}", ""), make_sample(2, "x", "x")]
    spec = reward_pb2.RewardSpec(components={"math": 1.0, "broken": 0.0})
    stub.Score(reward_pb2.ScoreRequest(samples=[sample_to_proto(s) for s in samples[:2]]), timeout=30)
    reply = stub.Score(reward_pb2.ScoreRequest(samples=[sample_to_proto(samples[2])], spec=spec), timeout=30)
    assert sample_from_proto(reply.samples[0]).metadata["reward_failed_components"] == ["broken"]
    stats = stub.GetStats(reward_pb2.GetRewardStatsRequest(), timeout=10)
    assert (stats.samples_scored, stats.samples_failed) == (1, 2)
    assert dict(stats.failures_by_component) == {"math": 1, "broken": 1}


def test_no_components_at_all_is_refused_not_scored_zero():
    scorer = Scorer.from_config(default_components={})
    with pytest.raises(errors.InvalidArgument, match="no reward components"):
        asyncio.run(
            scorer.score_samples(
                [Sample(index=0, response="a", label="a", tokens=[1], response_length=1)], RewardSpec()
            )
        )
