"""Buffer service contract: every RPC over real gRPC against a real Redis, its happy path
and each error code it answers with."""

from __future__ import annotations

import json
import time

import grpc
import httpx
import redis

from rlmesh.common.auth import client_headers
from rlmesh.common.net import free_port
from rlmesh.common.sample import group_from_proto
from rlmesh.v1 import buffer_pb2, sample_pb2
from tests.helpers.buffer import code_of, completed, create, prompts, put, stats
from tests.helpers.prometheus import scrape, value

INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND


def lease(stub, run_id="r1", **kw) -> buffer_pb2.LeaseBatchResponse:
    return stub.LeaseBatch(buffer_pb2.LeaseBatchRequest(run_id=run_id, **kw))


def ack(stub, lease_id, run_id="r1") -> int:
    return stub.AckBatch(buffer_pb2.AckBatchRequest(run_id=run_id, lease_id=lease_id)).acknowledged


# ---------------------------------------------------------------- runs and prompts


def test_prompts_come_in_order_with_consecutive_sample_indices(buffer, dataset):
    stub = buffer()
    assert create(stub, dataset).created
    assert not create(stub, dataset).created  # idempotent
    groups = prompts(stub, 3)
    assert [g.samples[0].prompt for g in groups] == ["question 0", "question 1", "question 2"]
    assert [s.index for g in groups for s in g.samples] == [0, 1, 2, 3, 4, 5]
    assert all(s.status == sample_pb2.Sample.PENDING and s.label for g in groups for s in g.samples)
    assert json.loads(groups[0].samples[0].metadata_json) == {"dataset": "train"}
    # epoch rollover: 5 records, 3 drawn, 4 more wraps into epoch 1
    prompts(stub, 4)
    s = stats(stub)
    assert (s.epoch, s.offset, s.prompts_handed_out, s.next_sample_index) == (1, 2, 7, 14)


def test_shuffled_order_is_reproducible(buffer, dataset):
    stub = buffer()
    create(stub, dataset, run_id="a", shuffle=True)
    create(stub, dataset, run_id="b", shuffle=True)
    order = lambda run: [g.samples[0].prompt for g in prompts(stub, 5, run_id=run)]  # noqa: E731
    first = order("a")
    assert first == order("b")
    assert sorted(first) == [f"question {i}" for i in range(5)]


def test_create_run_errors(buffer, dataset, tmp_path):
    stub = buffer()

    def spec(**kw):
        return buffer_pb2.DatasetSpec(**{"name": "t", "path": str(dataset), **kw})

    def run(*ds, n=1, **kw):
        return stub.CreateRun(buffer_pb2.CreateRunRequest(run_id="r2", n_samples_per_prompt=n, datasets=list(ds), **kw))

    for call, words in [
        (lambda: run(spec(path=str(tmp_path / "missing.jsonl"))), "file not found"),
        (lambda: run(spec(), n=0), "n_samples_per_prompt"),
        (lambda: run(spec(eval=True)), "training dataset"),
        (lambda: run(spec(), spec()), "unique"),
        (lambda: run(spec(weight=-1)), "weight"),
        (lambda: run(spec(prompt_key="nope")), "'nope'"),
        (lambda: run(spec(), max_queued_groups=-1), "max_queued_groups"),
        (lambda: stub.CreateRun(buffer_pb2.CreateRunRequest(n_samples_per_prompt=1, datasets=[spec()])), "run_id"),
    ]:
        code, details = code_of(call)
        assert code == INVALID and words in details, details
    create(stub, dataset)
    code, details = code_of(lambda: create(stub, dataset, n=3))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "different spec" in details


def test_get_prompts_errors(buffer, dataset):
    stub = buffer()
    code, details = code_of(lambda: prompts(stub, 1, run_id="nope"))
    assert code == NOT_FOUND and "CreateRun" in details
    code, _ = code_of(lambda: stub.GetEvalPrompts(buffer_pb2.GetEvalPromptsRequest(run_id="nope", dataset="train")))
    assert code == NOT_FOUND
    create(stub, dataset)
    code, _ = code_of(lambda: prompts(stub, 0))
    assert code == INVALID
    code, _ = code_of(lambda: prompts(stub, 1, lease_seconds=-1))
    assert code == INVALID


def test_eval_prompts_and_delete_run(buffer, dataset):
    stub = buffer()
    stub.CreateRun(
        buffer_pb2.CreateRunRequest(
            run_id="r1",
            n_samples_per_prompt=4,
            datasets=[
                buffer_pb2.DatasetSpec(name="train", path=str(dataset), prompt_key="q", label_key="a"),
                buffer_pb2.DatasetSpec(name="held_out", path=str(dataset), prompt_key="q", label_key="a", eval=True),
            ],
        )
    )
    create(stub, dataset, run_id="other")
    groups = stub.GetEvalPrompts(
        buffer_pb2.GetEvalPromptsRequest(run_id="r1", dataset="held_out", n_samples_per_prompt=1, offset=1, limit=3)
    ).groups
    assert [g.samples[0].label for g in groups] == ["1", "2", "3"]
    assert [g.group_id for g in groups] == ["eval:held_out:1", "eval:held_out:2", "eval:held_out:3"]
    # a warm start cycles its dataset (5 rows): rows 8, 9, 10.. are rows 3, 4, 0.., ids count on
    groups = stub.GetEvalPrompts(
        buffer_pb2.GetEvalPromptsRequest(run_id="r1", dataset="held_out", offset=8, limit=7, wrap=True)
    ).groups
    assert [g.samples[0].label for g in groups] == ["3", "4", "0", "1", "2", "3", "4"]
    assert len({g.group_id for g in groups}) == 7
    code, details = code_of(
        lambda: stub.GetEvalPrompts(buffer_pb2.GetEvalPromptsRequest(run_id="r1", dataset="held_out", wrap=True))
    )
    assert code == INVALID and "limit" in details
    code, details = code_of(lambda: stub.GetEvalPrompts(buffer_pb2.GetEvalPromptsRequest(run_id="r1", dataset="x")))
    assert code == NOT_FOUND and "held_out" in details
    code, _ = code_of(
        lambda: stub.GetEvalPrompts(buffer_pb2.GetEvalPromptsRequest(run_id="r1", dataset="held_out", offset=-1))
    )
    assert code == INVALID
    # runs share one Redis without seeing each other; deleting one leaves the other
    put(stub, [completed(g) for g in prompts(stub, 2, run_id="other")], run_id="other")
    assert stub.DeleteRun(buffer_pb2.DeleteRunRequest(run_id="r1")).keys_deleted > 0
    code, _ = code_of(lambda: stats(stub))
    assert code == NOT_FOUND
    assert stats(stub, "other").queued_groups == 2
    assert stub.DeleteRun(buffer_pb2.DeleteRunRequest(run_id="r1")).keys_deleted == 0
    code, _ = code_of(lambda: stub.DeleteRun(buffer_pb2.DeleteRunRequest()))
    assert code == INVALID
    # a deleted run can be created again, from scratch
    create(stub, dataset)
    assert prompts(stub, 1)[0].group_id == "g0"


# ---------------------------------------------------------------- completed groups and batches


def test_write_lease_ack_delivers_each_group_once(buffer, dataset):
    stub = buffer()
    create(stub, dataset)
    groups = [completed(g) for g in prompts(stub, 3)]
    assert put(stub, groups).stored == 3
    retry = put(stub, groups[:1])
    assert (retry.stored, retry.duplicates) == (0, 1)

    batch = lease(stub, num_groups=2)
    assert [g.group_id for g in batch.groups] == [groups[0].group_id, groups[1].group_id]
    assert batch.groups[0] == groups[0]  # the bytes as written
    assert group_from_proto(batch.groups[0]).samples[0].rollout_log_probs == [-0.5, -0.25]
    # not enough left for another batch of 2: empty answer after the wait
    assert not lease(stub, num_groups=2, wait_seconds=0.1).groups
    assert ack(stub, batch.lease_id) == 2
    # an acknowledged group is never stored or delivered again
    assert put(stub, groups[:1]).duplicates == 1
    rest = lease(stub, num_groups=1)
    assert [g.group_id for g in rest.groups] == [groups[2].group_id]
    s = stats(stub)
    assert (s.queued_groups, s.leased_groups, s.acknowledged_groups, s.groups_written) == (0, 1, 2, 3)


def test_a_lease_by_samples_takes_whole_groups(buffer, dataset):
    stub = buffer()
    create(stub, dataset, n=2)
    groups = [completed(g) for g in prompts(stub, 4)]
    one_sample = sample_pb2.SampleGroup()
    one_sample.CopyFrom(groups[3])
    del one_sample.samples[1:]
    put(stub, [*groups[:3], one_sample])
    assert stats(stub).queued_samples == 7
    assert [g.group_id for g in lease(stub, num_samples=3).groups] == ["g0", "g1"]  # never split: 4 samples
    assert [g.group_id for g in lease(stub, num_samples=2).groups] == ["g2"]
    assert not lease(stub, num_samples=2, wait_seconds=0.05).groups  # only one sample left
    assert [g.group_id for g in lease(stub, num_samples=1).groups] == ["g3"]
    assert stats(stub).queued_samples == 0


def test_expired_batch_lease_is_redelivered(buffer, dataset):
    stub = buffer()
    create(stub, dataset)
    put(stub, [completed(g) for g in prompts(stub, 1)])
    first = lease(stub, num_groups=1, lease_seconds=0.05)
    assert (stats(stub).leased_groups, stats(stub).expired_lease_groups) == (1, 0)
    time.sleep(0.1)  # (past its expiry: counted apart until the next lease queues it again)
    assert (stats(stub).leased_groups, stats(stub).expired_lease_groups) == (0, 1)
    again = lease(stub, num_groups=1, wait_seconds=5)
    assert (stats(stub).leased_groups, stats(stub).expired_lease_groups) == (1, 0)
    assert again.groups[0].group_id == first.groups[0].group_id
    code, details = code_of(lambda: ack(stub, first.lease_id))
    assert code == NOT_FOUND and "expired" in details
    assert ack(stub, again.lease_id) == 1
    s = stats(stub)
    assert (s.redelivered_groups, s.acknowledged_groups, s.leased_groups) == (1, 1, 0)


def test_a_waiting_lease_is_answered_when_its_groups_arrive_not_at_the_next_poll(buffer, dataset):
    stub = buffer(poll_interval_seconds=60)  # the poll alone would answer after a minute
    create(stub, dataset)
    groups = [completed(g) for g in prompts(stub, 3)]
    waiting = stub.LeaseBatch.future(buffer_pb2.LeaseBatchRequest(run_id="r1", num_groups=2, wait_seconds=50))
    put(stub, groups[:1])  # one is not a batch of two: the lease waits on
    time.sleep(0.3)
    assert not waiting.done()
    put(stub, groups[1:])
    assert [g.group_id for g in waiting.result(timeout=10).groups] == ["g0", "g1"]
    # Groups a trainer hands back untrained wake a waiting lease too.
    again = stub.LeaseBatch.future(buffer_pb2.LeaseBatchRequest(run_id="r1", num_groups=2, wait_seconds=50))
    time.sleep(0.3)
    stub.ReleaseBatch(buffer_pb2.ReleaseBatchRequest(run_id="r1", lease_id=waiting.result().lease_id))
    assert [g.group_id for g in again.result(timeout=10).groups] == ["g0", "g1"]


def test_a_lease_waiting_on_one_replica_gets_groups_written_through_another(buffer, dataset):
    waiting_replica, writing_replica = buffer(poll_interval_seconds=0.05), buffer()
    create(writing_replica, dataset)
    groups = [completed(g) for g in prompts(writing_replica, 2)]
    waiting = waiting_replica.LeaseBatch.future(
        buffer_pb2.LeaseBatchRequest(run_id="r1", num_groups=2, wait_seconds=50)
    )
    time.sleep(0.2)
    put(writing_replica, groups)
    assert [g.group_id for g in waiting.result(timeout=10).groups] == ["g0", "g1"]


def test_lease_and_ack_errors(buffer, dataset):
    stub = buffer()
    code, _ = code_of(lambda: lease(stub, run_id="nope", num_groups=1))
    assert code == NOT_FOUND
    code, _ = code_of(lambda: ack(stub, "x", run_id="nope"))
    assert code == NOT_FOUND
    create(stub, dataset)
    for kw in (
        {},
        {"num_groups": 1, "num_samples": 2},
        {"num_groups": -1},
        {"num_groups": 1, "min_weight_version": -1},
        {"num_groups": 1, "lease_seconds": -1},
        {"num_groups": 1, "stale_policy": 7},
    ):
        code, details = code_of(lambda: lease(stub, **kw))  # noqa: B023
        assert code == INVALID, (kw, details)
    code, _ = code_of(lambda: ack(stub, ""))
    assert code == INVALID
    code, details = code_of(lambda: ack(stub, "no-such-lease"))
    assert code == NOT_FOUND and "no-such-lease" in details


def test_staleness_bound_drops_or_keeps_old_groups_and_counts_them(buffer, dataset):
    stub = buffer()
    create(stub, dataset, n=2)
    g = prompts(stub, 5)
    put(
        stub,
        [
            completed(g[0], version=1),
            completed(g[1], version=3),
            completed(g[2], version=1),
            completed(g[3]),
            completed(g[4], version=4),
        ],
    )

    # Counted before any lease as a lease with that bound would take them (no versions: never stale).
    def queued_from(version: int) -> int:
        return stub.GetStats(buffer_pb2.GetStatsRequest(run_id="r1", min_weight_version=version)).queued_groups_from

    assert [queued_from(v) for v in (0, 2, 4, 5)] == [5, 3, 2, 1]
    code, details = code_of(lambda: queued_from(-1))
    assert code == INVALID and "min_weight_version" in details
    # KEEP: delivered, counted
    kept = lease(stub, num_groups=1, min_weight_version=2, stale_policy=buffer_pb2.LeaseBatchRequest.STALE_POLICY_KEEP)
    assert [x.group_id for x in kept.groups] == ["g0"] and kept.stale_groups == 1
    # DROP (the default): g2 (version 1) is dropped on the way; g3 has no versions: never stale
    batch = lease(stub, num_groups=3, min_weight_version=2)
    assert [x.group_id for x in batch.groups] == ["g1", "g3", "g4"]
    assert (batch.stale_groups, batch.stale_groups_dropped) == (0, 1)
    s = stats(stub)
    assert (s.stale_groups_kept, s.stale_groups_dropped, s.dropped_by_reason["stale"], s.queued_groups) == (1, 1, 1, 0)
    # a dropped stale group is never stored again
    assert put(stub, [completed(g[2], version=1)]).duplicates == 1
    # a sample generated partly with old weights makes its group stale
    mixed = completed(prompts(stub, 1)[0], version=5)
    mixed.samples[1].weight_versions[:] = [2, 5]
    put(stub, [mixed])
    empty = lease(stub, num_groups=1, min_weight_version=3, wait_seconds=0.05)
    assert not empty.groups and empty.stale_groups_dropped == 1


def test_backpressure_refuses_writes_beyond_the_cap(buffer, dataset):
    stub = buffer()
    create(stub, dataset, cap=2)
    groups = [completed(g) for g in prompts(stub, 3)]
    put(stub, groups[:2])
    code, details = code_of(lambda: put(stub, groups[2:]))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "cap is 2" in details
    assert put(stub, groups[:1]).duplicates == 1  # a retried write still answers
    ack(stub, lease(stub, num_groups=1).lease_id)
    assert put(stub, groups[2:]).stored == 1


def test_prompts_within_the_cap_count_the_groups_being_generated(buffer, dataset):
    stub = buffer()
    create(stub, dataset, cap=4)

    def within_cap(n: int) -> list[sample_pb2.SampleGroup]:
        return prompts(stub, n, within_queue_cap=True)

    generating = within_cap(10)
    assert len(generating) == 4 and within_cap(1) == []  # 4 being generated: no room
    put(stub, [completed(g) for g in generating[:3]])
    assert within_cap(10) == []  # 3 queued + 1 being generated
    ack(stub, lease(stub, num_groups=2).lease_id)
    assert len(within_cap(10)) == 2  # trained 2: room for 2
    assert len(prompts(stub, 3)) == 3  # without the flag (a sync rollout's batch), as before


def test_prompts_within_a_tighter_bound_than_the_cap(buffer, dataset):
    stub = buffer()
    create(stub, dataset, cap=6)
    generating = prompts(stub, 10, within_queue_cap=True, max_groups_ahead=4)
    assert len(generating) == 4  # the tighter bound, not the cap
    put(stub, [completed(g) for g in generating[:2]])
    assert prompts(stub, 10, within_queue_cap=True, max_groups_ahead=4) == []  # 2 queued + 2 being generated
    assert len(prompts(stub, 10, within_queue_cap=True, max_groups_ahead=9)) == 2  # a looser one: the cap's
    code, details = code_of(lambda: prompts(stub, 1, within_queue_cap=True, max_groups_ahead=-1))
    assert code == INVALID and "max_groups_ahead" in details


def test_put_groups_errors(buffer, dataset):
    stub = buffer(max_message_bytes=64 * 1024)
    code, _ = code_of(
        lambda: put(
            stub, [completed(sample_pb2.SampleGroup(group_id="g0", samples=[sample_pb2.Sample()]))], run_id="nope"
        )
    )
    assert code == NOT_FOUND
    create(stub, dataset)
    code, _ = code_of(lambda: put(stub, []))
    assert code == INVALID
    empty = sample_pb2.SampleGroup(group_id="g0")
    code, details = code_of(lambda: put(stub, [empty]))
    assert code == INVALID and "no samples" in details
    no_id = sample_pb2.SampleGroup(samples=[sample_pb2.Sample()])
    code, details = code_of(lambda: put(stub, [no_id]))
    assert code == INVALID and "group_id" in details
    bad = sample_pb2.SampleGroup(
        group_id="g0", samples=[sample_pb2.Sample(tokens=b"\0" * 12, response_length=2, loss_mask=b"\1")]
    )
    code, details = code_of(lambda: put(stub, [bad]))
    assert code == INVALID and "loss_mask" in details
    odd = sample_pb2.SampleGroup(group_id="g0", samples=[sample_pb2.Sample(tokens=b"\0" * 5)])
    code, details = code_of(lambda: put(stub, [odd]))
    assert code == INVALID and "multiple of 4" in details
    huge = sample_pb2.SampleGroup(group_id="g0", samples=[sample_pb2.Sample(tokens=b"\0" * 100_000)])
    code, _ = code_of(lambda: put(stub, [huge]))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert stats(stub).groups_written == 0  # nothing half-written


def test_partial_groups_resume_before_fresh_prompts(buffer, dataset):
    stub = buffer()
    create(stub, dataset)
    g = prompts(stub, 1)[0]
    partial = completed(g)
    for s in partial.samples:
        s.status = sample_pb2.Sample.ABORTED
    assert stub.ReturnPartialGroups(buffer_pb2.PutGroupsRequest(run_id="r1", groups=[partial])).stored == 1
    assert stats(stub).partial_groups == 1
    resumed = prompts(stub, 2)
    assert resumed[0] == partial  # with its partial response, as handed back
    assert resumed[1].samples[0].prompt == "question 1"
    s = stats(stub)
    assert (s.partial_groups, s.partial_groups_returned) == (0, 1)
    # a group already completed is not taken back as partial
    put(stub, [completed(resumed[0])])
    assert stub.ReturnPartialGroups(buffer_pb2.PutGroupsRequest(run_id="r1", groups=[partial])).stored == 0
    code, _ = code_of(lambda: stub.ReturnPartialGroups(buffer_pb2.PutGroupsRequest(run_id="r1")))
    assert code == INVALID
    code, _ = code_of(lambda: stub.ReturnPartialGroups(buffer_pb2.PutGroupsRequest(run_id="nope", groups=[partial])))
    assert code == NOT_FOUND


def test_expired_prompt_lease_hands_prompts_out_again(buffer, dataset):
    stub = buffer()
    create(stub, dataset)
    lost = prompts(stub, 1, lease_seconds=0.01)
    import time

    time.sleep(0.05)
    again = prompts(stub, 2)
    assert again[0] == lost[0]
    assert again[1].samples[0].prompt == "question 1"
    assert stats(stub).prompts_reissued == 1


def test_dropped_groups_are_counted_by_reason_and_not_handed_out_again(buffer, dataset):
    stub = buffer()
    create(stub, dataset)
    g = prompts(stub, 2, lease_seconds=0.01)
    assert (
        stub.DropGroups(
            buffer_pb2.DropGroupsRequest(run_id="r1", group_ids=[g[0].group_id], reason="nonzero_std")
        ).dropped
        == 1
    )
    import time

    time.sleep(0.05)
    assert [x.group_id for x in prompts(stub, 2)] == [g[1].group_id, "g2"]  # g0 is gone for good
    assert put(stub, [completed(g[0])]).duplicates == 1
    s = stats(stub)
    assert (s.dropped_groups, dict(s.dropped_by_reason)) == (1, {"nonzero_std": 1})
    code, _ = code_of(lambda: stub.DropGroups(buffer_pb2.DropGroupsRequest(run_id="r1")))
    assert code == INVALID
    code, _ = code_of(lambda: stub.DropGroups(buffer_pb2.DropGroupsRequest(run_id="nope", group_ids=["g0"])))
    assert code == NOT_FOUND


# ---------------------------------------------------------------- filters, export / import, stats


def test_a_buffer_filter_from_the_settings_picks_high_variance_groups_first(buffer, dataset):
    stub = buffer(buffer_filter="rlmesh.buffer.filters:highest_reward_variance_first")
    create(stub, dataset, n=4)
    g = prompts(stub, 4)
    put(
        stub,
        [
            completed(g[0], rewards=[1, 1, 1, 1]),
            completed(g[1], rewards=[0, 1, 0, 1]),
            completed(g[2], rewards=[0, 0, 0, 1]),
            completed(g[3], rewards=[0, 1, 1, 0]),
        ],
    )
    assert [x.group_id for x in lease(stub, num_groups=2).groups] == ["g1", "g3"]  # variance 0.25, ties oldest first
    assert [x.group_id for x in lease(stub, num_samples=5).groups] == ["g2", "g0"]
    assert stats(stub).queued_groups == 0


def test_a_lease_holds_each_datasets_minimum_or_none_is_made(buffer, dataset):
    """A run fed by environments: each environment's min_batch_allocation is its least
    groups in every batch (its groups are their own dataset), the rest oldest first."""
    stub = buffer()
    create(stub, dataset, n=5)
    groups = [completed(g) for g in prompts(stub, 5)]
    for g, env in zip(groups, ["a", "a", "a", "b", "c"]):
        g.dataset = env
    put(stub, groups[:3])
    assert not lease(stub, num_groups=2, min_groups_by_dataset={"b": 1}).groups  # none of b's queued yet
    put(stub, groups[3:])
    got = lease(stub, num_groups=3, min_groups_by_dataset={"c": 1, "b": 1})
    assert [g.group_id for g in got.groups] == ["g3", "g4", "g0"]  # b's and c's, then the oldest
    assert [g.group_id for g in lease(stub, num_groups=2).groups] == ["g1", "g2"]
    code, detail = code_of(lambda: lease(stub, num_groups=2, min_groups_by_dataset={"a": 3}))
    assert code == INVALID and "add up to at most num_groups (2)" in detail
    code, detail = code_of(lambda: lease(stub, num_samples=2, min_groups_by_dataset={"a": 1}))
    assert code == INVALID and "needs num_groups" in detail


def test_a_bad_buffer_filter_fails_at_start(redis_url):
    import pytest
    from pydantic import ValidationError

    from rlmesh.buffer.config import Settings

    # The settings refuse it, so the service never starts with it.
    with pytest.raises(ValidationError, match="cannot import module 'no_such_module'"):
        Settings(redis_url=redis_url, port=0, buffer_filter="no_such_module:f")
    with pytest.raises(ValidationError, match="has no attribute"):
        Settings(redis_url=redis_url, port=0, buffer_filter="rlmesh.buffer.filters:no_such_filter")


def test_export_and_import_jsonl(buffer, dataset, tmp_path):
    stub = buffer()
    create(stub, dataset)
    groups = [completed(g, version=3) for g in prompts(stub, 3)]
    put(stub, groups)
    leased = lease(stub, num_groups=1)
    path = tmp_path / "rollouts.jsonl"
    assert stub.ExportGroups(buffer_pb2.ExportGroupsRequest(run_id="r1", path=str(path))).groups == 3
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["group_id"] for line in lines] == ["g1", "g2", "g0"]  # queued, then leased
    assert (
        lines[0]["samples"][0]["rollout_log_probs"] == [-0.5, -0.25] and lines[0]["samples"][0]["status"] == "completed"
    )
    assert stats(stub).queued_groups == 2  # exporting takes nothing away
    ack(stub, leased.lease_id)

    # a trainer can run on the saved rollouts: import them into another run
    create(stub, dataset, run_id="replay")
    imported = stub.ImportGroups(buffer_pb2.ImportGroupsRequest(run_id="replay", path=str(path)))
    assert (imported.groups, imported.duplicates) == (3, 0)
    replayed = lease(stub, run_id="replay", num_groups=3).groups
    assert [group_from_proto(g) for g in replayed] == [group_from_proto(g) for g in (groups[1], groups[2], groups[0])]
    again = stub.ImportGroups(buffer_pb2.ImportGroupsRequest(run_id="replay", path=str(path)))
    assert (again.groups, again.duplicates) == (0, 3)


def test_export_and_import_errors(buffer, dataset, tmp_path):
    stub = buffer()
    code, _ = code_of(
        lambda: stub.ExportGroups(buffer_pb2.ExportGroupsRequest(run_id="nope", path=str(tmp_path / "x.jsonl")))
    )
    assert code == NOT_FOUND
    create(stub, dataset, cap=1)
    code, details = code_of(lambda: stub.ExportGroups(buffer_pb2.ExportGroupsRequest(run_id="r1")))
    assert code == INVALID and "path" in details
    code, details = code_of(
        lambda: stub.ExportGroups(buffer_pb2.ExportGroupsRequest(run_id="r1", path=str(tmp_path / "no" / "x.jsonl")))
    )
    assert code == INVALID and "does not exist" in details
    code, details = code_of(
        lambda: stub.ImportGroups(buffer_pb2.ImportGroupsRequest(run_id="r1", path=str(tmp_path / "none.jsonl")))
    )
    assert code == NOT_FOUND and "none.jsonl" in details
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"group_id": "a", "samples": []}\nnot json\n')
    code, details = code_of(lambda: stub.ImportGroups(buffer_pb2.ImportGroupsRequest(run_id="r1", path=str(bad))))
    assert code == INVALID and ":2" in details
    bad.write_text(
        json.dumps({"group_id": "a", "samples": [{"tokens": [1, 2], "response_length": 1, "loss_mask": [1, 1]}]}) + "\n"
    )
    code, details = code_of(lambda: stub.ImportGroups(buffer_pb2.ImportGroupsRequest(run_id="r1", path=str(bad))))
    assert code == INVALID and "loss_mask" in details
    two = tmp_path / "two.jsonl"
    two.write_text("".join(json.dumps({"group_id": f"x{i}", "samples": [{"tokens": [1]}]}) + "\n" for i in range(2)))
    code, details = code_of(lambda: stub.ImportGroups(buffer_pb2.ImportGroupsRequest(run_id="r1", path=str(two))))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "can never fit" in details  # 2 groups, cap 1: all or nothing
    assert stats(stub).queued_groups == 0


def test_stats_over_grpc_and_as_prometheus_metrics(buffer, dataset):
    port = free_port()
    stub = buffer(metrics_port=port)
    create(stub, dataset)
    code, _ = code_of(lambda: stats(stub, "nope"))
    assert code == NOT_FOUND
    stats(stub)  # the first snapshot for the rates
    put(stub, [completed(g) for g in prompts(stub, 3)])
    ack(stub, lease(stub, num_groups=2).lease_id)
    s = stats(stub)
    assert (s.queued_groups, s.acknowledged_groups, s.groups_written, s.prompts_handed_out) == (1, 2, 3, 3)
    assert s.groups_written_per_second > 0 and s.groups_acknowledged_per_second > 0 and s.rate_window_seconds > 0

    url = f"http://127.0.0.1:{port}/metrics"
    text = httpx.get(url, headers=client_headers()).text
    assert "# TYPE rlmesh_buffer_groups_written_total counter" in text
    samples = scrape(url)
    assert value(samples, "rlmesh_buffer_groups_written_total", run="r1") == 3
    assert value(samples, "rlmesh_buffer_queued_groups", run="r1") == 1
    assert value(samples, "rlmesh_buffer_acknowledged_groups_total", run="r1") == 2
    assert httpx.get(f"http://127.0.0.1:{port}/other").status_code == 404


def test_run_ids_and_dataset_names_cannot_reach_other_keys(buffer, dataset):
    stub = buffer()
    for bad in ("a:b", "a*", ""):
        code, details = code_of(lambda: stub.GetStats(buffer_pb2.GetStatsRequest(run_id=bad)))  # noqa: B023
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "run_id" in details
    code, details = code_of(
        lambda: stub.CreateRun(
            buffer_pb2.CreateRunRequest(
                run_id="r1",
                n_samples_per_prompt=1,
                datasets=[buffer_pb2.DatasetSpec(name="__groups__", path=str(dataset))],
            )
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "dataset name" in details


def test_recent_groups_are_kept_capped_whatever_became_of_them(buffer, dataset):
    stub = buffer(recent_groups=3)
    create(stub, dataset)
    written = []
    for _ in range(4):
        written += [completed(g) for g in prompts(stub, 1)]
        put(stub, written[-1:])
    put(stub, written[-1:])  # a duplicate write is not a new group
    lease = stub.LeaseBatch(buffer_pb2.LeaseBatchRequest(run_id="r1", num_groups=4))
    stub.AckBatch(buffer_pb2.AckBatchRequest(run_id="r1", lease_id=lease.lease_id))  # trained: still shown

    def recent(offset=0, limit=0):
        r = stub.GetRecentGroups(buffer_pb2.GetRecentGroupsRequest(run_id="r1", offset=offset, limit=limit))
        return [g.group_id for g in r.groups], r.total

    newest_first = [g.group_id for g in reversed(written)][:3]
    assert recent() == (newest_first, 3)
    assert recent(offset=1, limit=1) == (newest_first[1:2], 3)
    assert recent(offset=3) == ([], 3)
    assert (
        code_of(lambda: stub.GetRecentGroups(buffer_pb2.GetRecentGroupsRequest(run_id="r1", limit=-1)))[0]
        == grpc.StatusCode.INVALID_ARGUMENT
    )
    assert (
        code_of(lambda: stub.GetRecentGroups(buffer_pb2.GetRecentGroupsRequest(run_id="nope")))[0]
        == grpc.StatusCode.NOT_FOUND
    )
    stub.DeleteRun(buffer_pb2.DeleteRunRequest(run_id="r1"))
    assert (
        code_of(lambda: stub.GetRecentGroups(buffer_pb2.GetRecentGroupsRequest(run_id="r1")))[0]
        == grpc.StatusCode.NOT_FOUND
    )

    off = buffer(recent_groups=0)  # none kept
    create(off, dataset, run_id="r2")
    put(off, [completed(g) for g in prompts(off, 1, run_id="r2")], run_id="r2")
    assert off.GetRecentGroups(buffer_pb2.GetRecentGroupsRequest(run_id="r2")).total == 0


def test_recent_groups_hold_their_bytes_once_and_none_past_the_cap(buffer, dataset, redis_url):
    """The recent view keeps what left the buffer (trained, dead-lettered) browsable, yet
    Redis holds no copy of a group past the newest recent_groups, and the stats count only
    live groups."""
    stub, r = buffer(recent_groups=2), redis.Redis.from_url(redis_url)
    create(stub, dataset)
    written = [completed(g) for g in prompts(stub, 5)]
    for g in written:
        put(stub, [g])
    ack(stub, lease(stub, num_groups=3).lease_id)
    rejected = lease(stub, num_groups=2)
    stub.RejectGroups(
        buffer_pb2.RejectGroupsRequest(
            run_id="r1",
            lease_id=rejected.lease_id,
            groups=[buffer_pb2.RejectGroupsRequest.Rejection(group_id=g.group_id, reason="bad") for g in written[3:]],
        )
    )
    view = stub.GetRecentGroups(buffer_pb2.GetRecentGroupsRequest(run_id="r1"))
    assert list(view.groups) == list(reversed(written[3:])) and view.total == 2  # whole groups, newest first
    s = stats(stub)
    assert (s.queued_groups, s.leased_groups, s.acknowledged_groups) == (0, 0, 3)
    assert r.hlen("rlmesh:run:r1:groups") == 2  # the two recent ones; the three trained went

    more = [completed(g) for g in prompts(stub, 2)]  # pushes the two out of the view
    put(stub, more)
    view = stub.GetRecentGroups(buffer_pb2.GetRecentGroupsRequest(run_id="r1"))
    assert [g.group_id for g in view.groups] == [g.group_id for g in reversed(more)]
    assert r.hlen("rlmesh:run:r1:groups") == 2 and stats(stub).queued_groups == 2  # only the two queued ones
