"""Buffer service contract: every implemented call over real gRPC against a real Redis."""

from __future__ import annotations

import json

import grpc
import pytest

from rlmesh.v1 import buffer_pb2, buffer_pb2_grpc, sample_pb2
from services.buffer.config import Settings
from services.buffer.server import start
from services.common.grpc_server import sync_channel
from services.common.sample import Sample, SampleGroup, Status, group_from_proto, group_to_proto


@pytest.fixture
def dataset(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"q": f"question {i}", "a": str(i)}) + "\n" for i in range(5)))
    return path


@pytest.fixture
def buffer(redis_url, start_in_loop):
    def factory(**overrides):
        settings = Settings(redis_url=redis_url, port=0, **overrides)
        server, port = start_in_loop(lambda: start(settings))
        return buffer_pb2_grpc.BufferStub(sync_channel(f"127.0.0.1:{port}"))
    return factory


def create(stub, dataset, run_id="r1", n=2, cap=0, shuffle=False):
    return stub.CreateRun(buffer_pb2.CreateRunRequest(
        run_id=run_id, n_samples_per_prompt=n, max_queued_groups=cap,
        datasets=[buffer_pb2.DatasetSpec(name="train", path=str(dataset), prompt_key="q", label_key="a", shuffle=shuffle, seed=7)],
    ))


def completed(prompt_group: sample_pb2.SampleGroup) -> sample_pb2.SampleGroup:
    group = group_from_proto(prompt_group)
    for s in group.samples:
        s.tokens, s.response_length, s.loss_mask = [5, 6, 7], 2, [1, 1]
        s.rollout_log_probs, s.status, s.reward = [-0.5, -0.25], Status.COMPLETED, 1.0
    return group_to_proto(group)


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code(), e.value.details()


def test_prompts_come_in_order_with_consecutive_sample_indices(buffer, dataset):
    stub = buffer()
    assert create(stub, dataset).created
    assert not create(stub, dataset).created  # idempotent
    groups = stub.GetPrompts(buffer_pb2.GetPromptsRequest(run_id="r1", num_groups=3)).groups
    assert [g.samples[0].prompt for g in groups] == ["question 0", "question 1", "question 2"]
    assert [s.index for g in groups for s in g.samples] == [0, 1, 2, 3, 4, 5]
    assert all(s.status == sample_pb2.Sample.PENDING and s.label for g in groups for s in g.samples)
    # epoch rollover: 5 records, 3 drawn, 4 more wraps into epoch 1
    stub.GetPrompts(buffer_pb2.GetPromptsRequest(run_id="r1", num_groups=4))
    stats = stub.GetStats(buffer_pb2.GetStatsRequest(run_id="r1"))
    assert (stats.epoch, stats.offset, stats.prompts_handed_out) == (1, 2, 7)


def test_shuffled_order_is_reproducible(buffer, dataset):
    stub = buffer()
    create(stub, dataset, run_id="a", shuffle=True)
    create(stub, dataset, run_id="b", shuffle=True)
    order = lambda run: [g.samples[0].prompt for g in stub.GetPrompts(buffer_pb2.GetPromptsRequest(run_id=run, num_groups=5)).groups]
    first = order("a")
    assert first == order("b")
    assert sorted(first) == [f"question {i}" for i in range(5)]


def test_write_lease_ack_delivers_each_group_once(buffer, dataset):
    stub = buffer()
    create(stub, dataset)
    prompts = stub.GetPrompts(buffer_pb2.GetPromptsRequest(run_id="r1", num_groups=3)).groups
    groups = [completed(g) for g in prompts]
    assert stub.PutGroups(buffer_pb2.PutGroupsRequest(run_id="r1", groups=groups)).stored == 3
    retry = stub.PutGroups(buffer_pb2.PutGroupsRequest(run_id="r1", groups=groups[:1]))
    assert (retry.stored, retry.duplicates) == (0, 1)

    lease = stub.LeaseBatch(buffer_pb2.LeaseBatchRequest(run_id="r1", num_groups=2))
    assert [g.group_id for g in lease.groups] == [groups[0].group_id, groups[1].group_id]
    assert group_from_proto(lease.groups[0]).samples[0].rollout_log_probs == [-0.5, -0.25]
    # not enough left for another batch of 2: empty answer after the wait
    assert not stub.LeaseBatch(buffer_pb2.LeaseBatchRequest(run_id="r1", num_groups=2, wait_seconds=0.1)).groups
    assert stub.AckBatch(buffer_pb2.AckBatchRequest(run_id="r1", lease_id=lease.lease_id)).acknowledged == 2
    # an acknowledged group is never stored or delivered again
    assert stub.PutGroups(buffer_pb2.PutGroupsRequest(run_id="r1", groups=groups[:1])).duplicates == 1
    rest = stub.LeaseBatch(buffer_pb2.LeaseBatchRequest(run_id="r1", num_groups=1))
    assert [g.group_id for g in rest.groups] == [groups[2].group_id]
    stats = stub.GetStats(buffer_pb2.GetStatsRequest(run_id="r1"))
    assert (stats.queued_groups, stats.leased_groups, stats.acknowledged_groups) == (0, 1, 2)


def test_expired_batch_lease_is_redelivered(buffer, dataset):
    stub = buffer()
    create(stub, dataset)
    groups = [completed(g) for g in stub.GetPrompts(buffer_pb2.GetPromptsRequest(run_id="r1", num_groups=1)).groups]
    stub.PutGroups(buffer_pb2.PutGroupsRequest(run_id="r1", groups=groups))
    first = stub.LeaseBatch(buffer_pb2.LeaseBatchRequest(run_id="r1", num_groups=1, lease_seconds=0.05))
    again = stub.LeaseBatch(buffer_pb2.LeaseBatchRequest(run_id="r1", num_groups=1, wait_seconds=5))
    assert again.groups[0].group_id == first.groups[0].group_id
    code, details = code_of(lambda: stub.AckBatch(buffer_pb2.AckBatchRequest(run_id="r1", lease_id=first.lease_id)))
    assert code == grpc.StatusCode.NOT_FOUND and "expired" in details
    assert stub.AckBatch(buffer_pb2.AckBatchRequest(run_id="r1", lease_id=again.lease_id)).acknowledged == 1


def test_expired_prompt_lease_hands_prompts_out_again(buffer, dataset):
    stub = buffer()
    create(stub, dataset)
    lost = stub.GetPrompts(buffer_pb2.GetPromptsRequest(run_id="r1", num_groups=1, lease_seconds=0.01)).groups
    import time; time.sleep(0.05)
    again = stub.GetPrompts(buffer_pb2.GetPromptsRequest(run_id="r1", num_groups=2)).groups
    assert again[0].group_id == lost[0].group_id
    assert again[1].samples[0].prompt == "question 1"


def test_partial_groups_resume_before_fresh_prompts(buffer, dataset):
    stub = buffer()
    create(stub, dataset)
    g = stub.GetPrompts(buffer_pb2.GetPromptsRequest(run_id="r1", num_groups=1)).groups[0]
    partial = completed(g)
    for s in partial.samples:
        s.status = sample_pb2.Sample.ABORTED
    stub.ReturnPartialGroups(buffer_pb2.PutGroupsRequest(run_id="r1", groups=[partial]))
    resumed = stub.GetPrompts(buffer_pb2.GetPromptsRequest(run_id="r1", num_groups=2)).groups
    assert resumed[0].group_id == g.group_id and resumed[0].samples[0].response_length == 2
    assert resumed[1].samples[0].prompt == "question 1"


def test_backpressure_refuses_writes_beyond_the_cap(buffer, dataset):
    stub = buffer()
    create(stub, dataset, cap=2)
    groups = [completed(g) for g in stub.GetPrompts(buffer_pb2.GetPromptsRequest(run_id="r1", num_groups=3)).groups]
    stub.PutGroups(buffer_pb2.PutGroupsRequest(run_id="r1", groups=groups[:2]))
    code, details = code_of(lambda: stub.PutGroups(buffer_pb2.PutGroupsRequest(run_id="r1", groups=groups[2:])))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "cap is 2" in details


def test_errors_are_clear_status_codes(buffer, dataset, tmp_path):
    stub = buffer(max_message_bytes=64 * 1024)
    code, details = code_of(lambda: stub.GetPrompts(buffer_pb2.GetPromptsRequest(run_id="nope", num_groups=1)))
    assert code == grpc.StatusCode.NOT_FOUND and "CreateRun" in details
    code, details = code_of(lambda: stub.CreateRun(buffer_pb2.CreateRunRequest(
        run_id="r2", n_samples_per_prompt=1, datasets=[buffer_pb2.DatasetSpec(name="t", path=str(tmp_path / "missing.jsonl"))])))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "file not found" in details
    create(stub, dataset)
    code, details = code_of(lambda: create(stub, dataset, n=3))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    code, _ = code_of(lambda: stub.PutGroups(buffer_pb2.PutGroupsRequest(run_id="r1", groups=[])))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    empty = sample_pb2.SampleGroup(group_id="g0")
    code, details = code_of(lambda: stub.PutGroups(buffer_pb2.PutGroupsRequest(run_id="r1", groups=[empty])))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "no samples" in details
    bad = sample_pb2.SampleGroup(group_id="g0", samples=[sample_pb2.Sample(tokens=b"\0" * 12, response_length=2, loss_mask=b"\1")])
    code, details = code_of(lambda: stub.PutGroups(buffer_pb2.PutGroupsRequest(run_id="r1", groups=[bad])))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "loss_mask" in details
    huge = sample_pb2.SampleGroup(group_id="g0", samples=[sample_pb2.Sample(tokens=b"\0" * 100_000)])
    code, _ = code_of(lambda: stub.PutGroups(buffer_pb2.PutGroupsRequest(run_id="r1", groups=[huge])))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    code, details = code_of(lambda: stub.AckBatch(buffer_pb2.AckBatchRequest(run_id="r1", lease_id="x")))
    assert code == grpc.StatusCode.NOT_FOUND
    code, _ = code_of(lambda: stub.ExportGroups(buffer_pb2.ExportGroupsRequest(run_id="r1")))
    assert code == grpc.StatusCode.UNIMPLEMENTED


def test_eval_prompts_and_delete_run(buffer, dataset):
    stub = buffer()
    stub.CreateRun(buffer_pb2.CreateRunRequest(run_id="r1", n_samples_per_prompt=4, datasets=[
        buffer_pb2.DatasetSpec(name="train", path=str(dataset), prompt_key="q", label_key="a"),
        buffer_pb2.DatasetSpec(name="held_out", path=str(dataset), prompt_key="q", label_key="a", eval=True),
    ]))
    groups = stub.GetEvalPrompts(buffer_pb2.GetEvalPromptsRequest(run_id="r1", dataset="held_out", n_samples_per_prompt=1, limit=3)).groups
    assert [g.samples[0].label for g in groups] == ["0", "1", "2"]
    code, details = code_of(lambda: stub.GetEvalPrompts(buffer_pb2.GetEvalPromptsRequest(run_id="r1", dataset="x")))
    assert code == grpc.StatusCode.NOT_FOUND and "held_out" in details
    assert stub.DeleteRun(buffer_pb2.DeleteRunRequest(run_id="r1")).keys_deleted > 0
    code, _ = code_of(lambda: stub.GetStats(buffer_pb2.GetStatsRequest(run_id="r1")))
    assert code == grpc.StatusCode.NOT_FOUND
