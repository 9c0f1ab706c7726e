"""The rollout service's continuous generation (StartAsyncRollout / StopAsyncRollout) and
per-sample isolation, over real gRPC with a real buffer, reward service and engine."""

from __future__ import annotations

import concurrent.futures
import json
import time

import grpc
import pytest

from rlmesh.buffer.config import Settings as BufferSettings
from rlmesh.buffer.server import start as start_buffer
from rlmesh.common.grpc_server import sync_channel
from rlmesh.common.run_config import SamplingConfig
from rlmesh.common.sample import Sample, Status, group_from_proto
from rlmesh.common.sampling import sampling_to_proto
from rlmesh.reward.config import Settings as RewardSettings
from rlmesh.reward.server import start as start_reward
from rlmesh.rollout.config import Settings as RolloutSettings
from rlmesh.rollout.generation import GenerateContext, default_generate
from rlmesh.rollout.server import start as start_rollout
from rlmesh.v1 import buffer_pb2, buffer_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from tests.helpers.rollout import request


async def fails_for_the_second_sample(ctx: GenerateContext, sample: Sample, params: dict) -> Sample:
    """A custom generate function with a bug that only one sample of each group hits."""
    if sample.index % 3 == 1:
        raise KeyError("tool_result")
    return await default_generate(ctx, sample, params)


@pytest.fixture
def make_stack(redis_url, start_in_loop, engine_url, tmp_path):
    def make(**rollout_settings):
        _, buffer_port = start_in_loop(lambda: start_buffer(BufferSettings(redis_url=redis_url, port=0)))
        _, reward_port = start_in_loop(lambda: start_reward(RewardSettings(port=0)))
        _, rollout_port = start_in_loop(
            lambda: start_rollout(
                RolloutSettings(
                    port=0,
                    buffer_address=f"127.0.0.1:{buffer_port}",
                    reward_address=f"127.0.0.1:{reward_port}",
                    engine_urls=[engine_url],
                    **rollout_settings,
                )
            )
        )
        data = tmp_path / "train.jsonl"
        data.write_text(
            "".join(
                json.dumps({"prompt": f"rev {a}{b}=", "label": f"{b}{a}"}) + "\n" for a in "abcdef" for b in "abcdef"
            )
        )
        buffer = buffer_pb2_grpc.BufferStub(sync_channel(f"127.0.0.1:{buffer_port}"))
        buffer.CreateRun(
            buffer_pb2.CreateRunRequest(
                run_id="r",
                n_samples_per_prompt=3,
                max_queued_groups=4,
                datasets=[buffer_pb2.DatasetSpec(name="train", path=str(data))],
            )
        )
        return buffer, rollout_pb2_grpc.RolloutStub(sync_channel(f"127.0.0.1:{rollout_port}"))

    return make


def stats(buffer) -> buffer_pb2.BufferStats:
    return buffer.GetStats(buffer_pb2.GetStatsRequest(run_id="r"))


def lease_and_ack(buffer, n: int) -> list:
    batch = buffer.LeaseBatch(buffer_pb2.LeaseBatchRequest(run_id="r", num_groups=n, wait_seconds=60))
    assert len(batch.groups) == n
    buffer.AckBatch(buffer_pb2.AckBatchRequest(run_id="r", lease_id=batch.lease_id))
    return [group_from_proto(g) for g in batch.groups]


@pytest.mark.slow
def test_groups_keep_arriving_across_steps_and_a_stop_hands_the_rest_back(make_stack):
    buffer, rollout = make_stack()
    assert rollout.StartAsyncRollout(request(num_groups=2)).running
    trained = [g for _ in range(3) for g in lease_and_ack(buffer, 2)]  # a consumer, step after step
    assert len({g.group_id for g in trained}) == 6
    beat = rollout.StartAsyncRollout(request(num_groups=2))  # a heartbeat: the same loop
    assert beat.running and beat.error == ""
    assert beat.metrics["rollout/groups_written"] >= 6 and 0 <= beat.metrics["rollout/reward_mean"] <= 1
    with pytest.raises(grpc.RpcError) as e:  # one run at a time
        rollout.StartAsyncRollout(request(run_id="other"))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "r" in e.value.details()

    time.sleep(0.5)  # (the queue cap of 4 holds the loop back meanwhile: it waits, drops nothing)
    stopped = rollout.StopAsyncRollout(rollout_pb2.StopAsyncRolloutRequest(run_id="r"))
    assert not stopped.running
    assert not rollout.StopAsyncRollout(rollout_pb2.StopAsyncRolloutRequest(run_id="r")).running  # idempotent
    s = stats(buffer)
    # Every prompt handed out is trained, queued, or back in the buffer; nothing is left leased.
    assert s.queued_groups <= 4 and s.leased_groups == 0 and s.dropped_groups == 0
    assert s.prompts_handed_out == s.acknowledged_groups + s.queued_groups + s.partial_groups
    assert s.partial_groups >= 1


def test_a_run_the_buffer_does_not_hold_is_refused_not_started(make_stack):
    _, rollout = make_stack()
    with pytest.raises(grpc.RpcError) as e:
        rollout.StartAsyncRollout(request(run_id="never-created", num_groups=2))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "never-created" in e.value.details()
    assert rollout.StartAsyncRollout(request(num_groups=2)).running  # nothing of it is left holding the service
    rollout.StopAsyncRollout(rollout_pb2.StopAsyncRolloutRequest(run_id="r"))


def test_starts_at_the_same_moment_make_one_loop(make_stack):
    """A heartbeat and a start of the coordinator may cross: one loop comes of them, and a
    stop leaves nothing generating."""
    buffer, rollout = make_stack()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: rollout.StartAsyncRollout(request(num_groups=2)), range(4)))
    assert all(a.running for a in answers)
    time.sleep(0.5)
    assert not rollout.StopAsyncRollout(rollout_pb2.StopAsyncRolloutRequest(run_id="r")).running
    before = stats(buffer)
    time.sleep(1.0)  # (a second loop, left running, would go on taking prompts)
    after = stats(buffer)
    assert after.leased_groups == 0 and after.prompts_handed_out == before.prompts_handed_out


def test_a_loop_whose_run_ended_in_the_buffer_ends_and_lets_another_run_start(make_stack, tmp_path):
    # (a coordinator that closed its run but could not stop the loop: say, down at that moment)
    buffer, rollout = make_stack()
    assert rollout.StartAsyncRollout(request(num_groups=2)).running
    data = buffer_pb2.DatasetSpec(name="train", path=str(tmp_path / "train.jsonl"))
    buffer.CreateRun(buffer_pb2.CreateRunRequest(run_id="other", n_samples_per_prompt=3, datasets=[data]))
    buffer.CloseRun(buffer_pb2.CloseRunRequest(run_id="r"))
    deadline = time.monotonic() + 30
    while True:
        try:
            started = rollout.StartAsyncRollout(request(run_id="other", num_groups=2))
            break
        except grpc.RpcError as e:  # refused while r's loop still runs
            assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and time.monotonic() < deadline
            time.sleep(0.2)
    assert started.running and started.error == ""
    assert not rollout.StopAsyncRollout(rollout_pb2.StopAsyncRolloutRequest(run_id="r")).running
    rollout.StopAsyncRollout(rollout_pb2.StopAsyncRolloutRequest(run_id="other"))


def test_a_new_loop_takes_back_the_prompts_a_dead_one_held_at_once(make_stack):
    """The rollout service was killed mid-generation: the prompts its loop held stay leased
    (prompt_lease_seconds: 600), and within the queue cap they filled all the room, so the
    restarted service's loop got nothing for ten minutes. A new loop reclaims them."""
    buffer, rollout = make_stack()
    held = buffer.GetPrompts(buffer_pb2.GetPromptsRequest(run_id="r", num_groups=4, within_queue_cap=True))
    assert len(held.groups) == 4  # (the dead loop's: the cap of 4 is full)
    assert rollout.StartAsyncRollout(request(num_groups=2, within_queue_cap=True)).running
    deadline = time.monotonic() + 30
    while stats(buffer).queued_groups < 4:
        assert time.monotonic() < deadline, "the new loop generated nothing: the dead loop's leases held the room"
        time.sleep(0.05)
    written = [g.group_id for g in lease_and_ack(buffer, 4)]
    assert sorted(written) == sorted(g.group_id for g in held.groups)  # the same prompts, each once
    rollout.StopAsyncRollout(rollout_pb2.StopAsyncRolloutRequest(run_id="r"))


@pytest.mark.slow
def test_groups_finishing_together_never_wait_for_more_room_than_one_needs(make_stack):
    """Groups that finish together share one write; under the queue cap (4) all of them at
    once may not fit while fewer would, and a trainer waiting for a whole batch would then
    wait for ever. Refused together, they are written one by one. The stop then hands back
    every prompt handed out, those of a GetPrompts it cut short included."""
    buffer, rollout = make_stack()
    assert rollout.StartAsyncRollout(request(num_groups=4, within_queue_cap=False)).running
    lease_and_ack(buffer, 4)
    time.sleep(2)  # the queue fills (4) and the next 4 finish meanwhile, waiting for room
    for n in (2, 4, 4):  # (after the 2, the queue has room for 2 of those 4)
        lease_and_ack(buffer, n)
    rollout.StopAsyncRollout(rollout_pb2.StopAsyncRolloutRequest(run_id="r"))
    s = stats(buffer)
    assert s.leased_groups == 0 and s.prompts_handed_out == s.acknowledged_groups + s.queued_groups + s.partial_groups


@pytest.mark.slow
@pytest.mark.parametrize("ahead, bound", [(0, 4), (3, 3)])
def test_within_the_queue_cap_the_loop_starts_no_group_that_would_wait_for_room(make_stack, ahead, bound):
    buffer, rollout = make_stack()
    assert rollout.StartAsyncRollout(request(num_groups=2, within_queue_cap=True, max_groups_ahead=ahead)).running
    # The queue cap of 4 (or the tighter max_groups_ahead) counts the groups being generated:
    # once that many are queued the loop starts none (none would wait for room, aging as the
    # trainer steps on).
    deadline = time.monotonic() + 30
    while stats(buffer).queued_groups < bound and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    s = stats(buffer)
    assert s.queued_groups == bound and s.prompts_handed_out == s.acknowledged_groups + bound
    lease_and_ack(buffer, 2)  # room for 2: the loop generates 2 more
    while stats(buffer).queued_groups < bound and time.monotonic() < deadline:
        time.sleep(0.05)
    rollout.StopAsyncRollout(rollout_pb2.StopAsyncRolloutRequest(run_id="r"))
    s = stats(buffer)
    assert s.queued_groups == bound and s.partial_groups == 0
    assert s.prompts_handed_out == s.acknowledged_groups + bound


@pytest.mark.slow
def test_samples_aborted_by_a_weight_push_resume_under_the_new_weights(make_stack, tiny_model_dir):
    buffer, rollout = make_stack()
    long = sampling_to_proto(SamplingConfig(max_new_tokens=48, ignore_eos=True))
    rollout.StartAsyncRollout(request(num_groups=2, sampling=long, partial_rollout=True))
    samples = []
    for version in range(1, 6):  # training steps, each followed by a weight push with the engines paused
        samples += [s for g in lease_and_ack(buffer, 1) for s in g.samples]
        rollout.PauseGeneration(rollout_pb2.PauseGenerationRequest(mode="abort"))
        rollout.UpdateWeightsFromDisk(
            rollout_pb2.UpdateWeightsFromDiskRequest(model_path=str(tiny_model_dir), weight_version=str(version))
        )
        rollout.ContinueGeneration(rollout_pb2.ContinueGenerationRequest())
    samples += [s for g in lease_and_ack(buffer, 2) for s in g.samples]
    report = rollout.StopAsyncRollout(rollout_pb2.StopAsyncRolloutRequest(run_id="r"))
    resumed = [s for s in samples if len(s.weight_versions) > 1]
    assert resumed and report.metrics["rollout/samples_aborted"] >= len(resumed)
    for s in resumed:  # one response, continued: every token from the engine, in order
        assert s.response_length == 48 == len(s.rollout_log_probs) == len(s.loss_mask)
        assert s.weight_versions == sorted(s.weight_versions)


def test_one_failing_sample_fails_alone_and_the_rollout_completes(make_stack):
    buffer, rollout = make_stack(generate_function="tests.service.test_rollout_async:fails_for_the_second_sample")
    r = rollout.GenerateRollout(request(num_groups=2))
    assert r.groups_written == 2 and r.metrics["rollout/failed_ratio"] == pytest.approx(1 / 3)
    assert r.metrics["rollout/failed/generation"] == 2 and "rollout/failed/reward" not in r.metrics
    groups = lease_and_ack(buffer, 2)
    failed = [s for g in groups for s in g.samples if s.status == Status.FAILED]
    assert [s.index % 3 for s in failed] == [1, 1]
    assert all(s.metadata["failure"] == "KeyError: 'tool_result'" for s in failed)


@pytest.mark.slow
def test_partial_samples_older_than_the_bound_start_over_instead_of_resuming(make_stack, tiny_model_dir):
    """one_step_off trains a batch one version after it was generated: the coordinator asks
    for min_weight_version = that version - max_staleness, so a resumed group is never too
    stale to be trained (the trainer would drop it and wait for a batch that never fills)."""
    buffer, rollout = make_stack()
    long = sampling_to_proto(SamplingConfig(max_new_tokens=48, ignore_eos=True))
    (engine,) = rollout.ListEngines(rollout_pb2.ListEnginesRequest()).engines
    old = int(engine.weight_version) if engine.weight_version.isdigit() else 0
    first = rollout.GenerateRollout(request(num_groups=1, over_sampling_groups=3, partial_rollout=True, sampling=long))
    assert first.metrics["rollout/groups_aborted"] == 3 and stats(buffer).partial_groups == 3
    rollout.UpdateWeightsFromDisk(
        rollout_pb2.UpdateWeightsFromDiskRequest(model_path=str(tiny_model_dir), weight_version=str(old + 1))
    )

    second = rollout.GenerateRollout(
        request(num_groups=3, partial_rollout=True, sampling=long, min_weight_version=old + 1)
    )
    assert second.groups_written == 3
    lease_and_ack(buffer, 1)  # the first rollout's group
    for group in lease_and_ack(buffer, 3):  # the partial groups, started over under the new weights
        for s in group.samples:
            assert s.weight_versions == [old + 1] and s.response_length == 48
            assert len(s.rollout_log_probs) == len(s.loss_mask) == 48
