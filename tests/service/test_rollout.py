"""Rollout service over real gRPC, with a real buffer (Redis), reward service and CPU
reference engine (its own process), all on loopback."""

from __future__ import annotations

import functools
import json

import grpc
import pytest

from rlmesh.buffer.config import Settings as BufferSettings
from rlmesh.buffer.server import start as start_buffer
from rlmesh.common.grpc_server import sync_channel
from rlmesh.common.run_config import SamplingConfig
from rlmesh.common.sample import Status, group_from_proto
from rlmesh.common.sampling import sampling_to_proto
from rlmesh.reward.config import Settings as RewardSettings
from rlmesh.reward.server import start as start_reward
from rlmesh.rollout.config import Settings as RolloutSettings
from rlmesh.rollout.server import start as start_rollout
from rlmesh.v1 import buffer_pb2, buffer_pb2_grpc, reward_pb2, rollout_pb2, rollout_pb2_grpc, sample_pb2
from tests.helpers.rollout import request


@pytest.fixture
def stack(redis_url, start_in_loop, engine_url, tmp_path):
    _, buffer_port = start_in_loop(lambda: start_buffer(BufferSettings(redis_url=redis_url, port=0)))
    _, reward_port = start_in_loop(lambda: start_reward(RewardSettings(port=0)))
    _, rollout_port = start_in_loop(
        lambda: start_rollout(
            RolloutSettings(
                port=0,
                buffer_address=f"127.0.0.1:{buffer_port}",
                reward_address=f"127.0.0.1:{reward_port}",
                engine_urls=[engine_url],
            )
        )
    )
    data = tmp_path / "train.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"rev {s}=", "label": s[::-1]}) + "\n" for s in ("abc", "bcd", "cde", "def"))
    )
    buffer = buffer_pb2_grpc.BufferStub(sync_channel(f"127.0.0.1:{buffer_port}"))
    buffer.CreateRun(
        buffer_pb2.CreateRunRequest(
            run_id="r",
            n_samples_per_prompt=3,
            datasets=[
                buffer_pb2.DatasetSpec(name="train", path=str(data)),
                buffer_pb2.DatasetSpec(name="held_out", path=str(data), eval=True),
            ],
        )
    )
    return buffer, WithDeadline(rollout_pb2_grpc.RolloutStub(sync_channel(f"127.0.0.1:{rollout_port}")))


class WithDeadline:
    """A stub whose every call has a deadline: a stalled rollout fails the test, never hangs it."""

    def __init__(self, stub, seconds: float = 120.0) -> None:
        self.stub, self.seconds = stub, seconds

    def __getattr__(self, name: str):
        return functools.partial(getattr(self.stub, name), timeout=self.seconds)


def test_rollout_writes_scored_groups_with_engine_tokens_and_logprobs(stack):
    buffer, rollout = stack
    r = rollout.GenerateRollout(request())
    assert r.groups_written == 2 and r.metrics["rollout/samples"] == 6
    lease = buffer.LeaseBatch(buffer_pb2.LeaseBatchRequest(run_id="r", num_groups=2))
    groups = [group_from_proto(g) for g in lease.groups]
    for g in groups:
        assert [s.index for s in g.samples] == [g.group_index * 3 + i for i in range(3)]
        for s in g.samples:
            assert s.status in (Status.COMPLETED, Status.TRUNCATED)
            assert 1 <= s.response_length <= 6
            assert len(s.rollout_log_probs) == len(s.loss_mask) == s.response_length
            assert all(lp <= 0 for lp in s.rollout_log_probs)
            assert s.weight_versions == [0]  # engine reports "default" before any update
            assert s.reward_components.keys() == {"exact_match"}
            assert s.prompt_tokens  # prompt + response tokens, straight from the engine


def test_sft_mode_writes_label_as_response(stack):
    buffer, rollout = stack
    assert rollout.GenerateRollout(request(mode="sft", num_groups=2)).groups_written == 2
    g = group_from_proto(buffer.LeaseBatch(buffer_pb2.LeaseBatchRequest(run_id="r", num_groups=2)).groups[0])
    s = g.samples[0]
    assert len(g.samples) == 1 and s.response == s.label and s.loss_mask == [1] * s.response_length


def test_sft_mode_reads_a_warm_start_dataset_apart_from_the_training_stream(stack):
    buffer, rollout = stack
    for offset in (3, 3):  # a step redone (after a restart) is new data, not a duplicate
        assert (
            rollout.GenerateRollout(
                request(mode="sft", num_groups=2, dataset="held_out", dataset_offset=offset)
            ).groups_written
            == 2
        )
    groups = [
        group_from_proto(g) for g in buffer.LeaseBatch(buffer_pb2.LeaseBatchRequest(run_id="r", num_groups=4)).groups
    ]
    assert [g.samples[0].response for g in groups] == ["fed", "cba"] * 2  # rows 3 and 0 (4 rows, cycled)
    assert len({g.group_id for g in groups}) == 4
    # the training stream was not touched: its first prompt is still row 0's group
    assert buffer.GetPrompts(buffer_pb2.GetPromptsRequest(run_id="r", num_groups=1)).groups[0].group_id == "g0"


def test_over_sampling_hands_surplus_groups_back(stack):
    buffer, rollout = stack
    r = rollout.GenerateRollout(request(num_groups=1, over_sampling_groups=2))
    assert r.groups_written == 1
    stats = buffer.GetStats(buffer_pb2.GetStatsRequest(run_id="r"))
    assert stats.queued_groups == 1
    # the two surplus groups went back to the buffer, nothing lost
    assert stats.partial_groups == r.metrics["rollout/groups_aborted"] == 2
    # without partial rollout they start over: no tokens of this policy kept
    resumed = buffer.GetPrompts(buffer_pb2.GetPromptsRequest(run_id="r", num_groups=2)).groups
    assert all(s.status == sample_pb2.Sample.PENDING and not s.tokens for g in resumed for s in g.samples)


def test_evaluate_reports_metrics_per_dataset(stack):
    _, rollout = stack
    r = rollout.Evaluate(
        rollout_pb2.EvaluateRequest(
            run_id="r",
            dataset="held_out",
            sampling=sampling_to_proto(SamplingConfig(max_new_tokens=4, temperature=0)),
            reward=reward_pb2.RewardSpec(components={"exact_match": 1.0}),
        )
    )
    assert r.metrics["eval/held_out/samples"] == 4
    assert 0 <= r.metrics["eval/held_out/reward_mean"] <= 1


def test_list_engines_and_errors(stack, engine_url):
    buffer, rollout = stack
    engines = rollout.ListEngines(rollout_pb2.ListEnginesRequest())
    assert [e.url for e in engines.engines] == [engine_url] and engines.weight_group_world_size == 2
    with pytest.raises(grpc.RpcError) as e:
        rollout.GenerateRollout(request(run_id="missing"))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as e:
        rollout.GenerateRollout(request(num_groups=0))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as e:
        rollout.GenerateRollout(request(reward=reward_pb2.RewardSpec(components={"nope": 1.0})))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "nope" in e.value.details()
    # the failed rollout handed its prompts back instead of leaving them leased
    assert buffer.GetStats(buffer_pb2.GetStatsRequest(run_id="r")).partial_groups == 2
    with pytest.raises(grpc.RpcError) as e:
        rollout.StartAsyncRollout(request(mode="sft"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "async" in e.value.details()
    # sampling parameters are checked as the REST API checks them (they went to the engines unchecked)
    for bad, field in ((dict(top_p=5.0), "top_p"), (dict(temperature=float("nan")), "temperature")):
        with pytest.raises(grpc.RpcError) as e:
            rollout.GenerateRollout(request(sampling=rollout_pb2.SamplingParams(max_new_tokens=6, **bad)))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and f"sampling: {field}" in e.value.details()


def test_a_filter_that_drops_everything_fails_clearly(stack):
    buffer, rollout = stack
    # A reward that is 0 for every sample (labels never match 1-token answers): all groups equal.
    with pytest.raises(grpc.RpcError) as e:
        rollout.GenerateRollout(
            request(
                num_groups=1, group_filter="nonzero_std", sampling=sampling_to_proto(SamplingConfig(max_new_tokens=1))
            )
        )
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "dropped" in e.value.details()
    assert buffer.GetStats(buffer_pb2.GetStatsRequest(run_id="r")).dropped_groups > 20


def test_partial_rollout_resumes_aborted_groups_within_the_token_budget(stack):
    buffer, rollout = stack
    long = sampling_to_proto(SamplingConfig(max_new_tokens=48, ignore_eos=True))
    first = rollout.GenerateRollout(request(num_groups=1, over_sampling_groups=3, partial_rollout=True, sampling=long))
    assert first.groups_written == 1 and first.metrics["rollout/groups_aborted"] == 3
    assert buffer.GetStats(buffer_pb2.GetStatsRequest(run_id="r")).partial_groups == 3
    # the next rollout takes the partial groups first and finishes them
    second = rollout.GenerateRollout(request(num_groups=3, partial_rollout=True, sampling=long))
    assert second.groups_written == 3
    lease = buffer.LeaseBatch(buffer_pb2.LeaseBatchRequest(run_id="r", num_groups=4))
    for g in map(group_from_proto, lease.groups):
        for s in g.samples:
            # one continuous response, however many times it was resumed: never past the budget
            assert s.status == Status.TRUNCATED and s.response_length == 48
            assert len(s.rollout_log_probs) == len(s.loss_mask) == 48
            assert len(s.tokens) == len(s.prompt_tokens) + 48
