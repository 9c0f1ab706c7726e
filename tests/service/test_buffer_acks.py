"""Acknowledgments that wait for a checkpoint: AckBatch(provisional), CommitAcks and
RollbackToCheckpoint, over real gRPC on a real Redis. What a trainer that crashes and
restarts from an older checkpoint relies on: the groups it trained after that checkpoint
come back first, in order, those before it never do, and its dead leases end at once."""

from __future__ import annotations

import grpc

from rlmesh.v1 import buffer_pb2
from tests.helpers.buffer import code_of, completed, create, prompts, put, stats


def setup(stub, dataset, groups: int) -> list:
    create(stub, dataset)
    written = [completed(g) for g in prompts(stub, groups)]
    put(stub, written)
    return written


def train(stub, n: int, step: int, provisional: bool = True, load: str = "") -> list[str]:
    """Lease n groups and acknowledge them as trained at `step` (by the trainer's load `load`)."""
    batch = stub.LeaseBatch(buffer_pb2.LeaseBatchRequest(run_id="r1", num_groups=n))
    stub.AckBatch(
        buffer_pb2.AckBatchRequest(
            run_id="r1", lease_id=batch.lease_id, step=step, provisional=provisional, load_id=load
        )
    )
    return [g.group_id for g in batch.groups]


def commit(stub, through: int) -> int:
    return stub.CommitAcks(buffer_pb2.CommitAcksRequest(run_id="r1", through_step=through)).committed


def rollback(stub, step: int) -> buffer_pb2.RollbackToCheckpointResponse:
    return stub.RollbackToCheckpoint(buffer_pb2.RollbackToCheckpointRequest(run_id="r1", step=step))


def test_provisional_acks_become_final_when_their_checkpoint_is_committed(buffer, dataset):
    stub = buffer()
    written = setup(stub, dataset, 4)
    ids = [g.group_id for g in written]
    assert train(stub, 2, step=1) == ids[:2]
    assert train(stub, 2, step=2) == ids[2:]
    s = stats(stub)
    assert (s.provisional_groups, s.acknowledged_groups, s.leased_groups, s.queued_groups) == (4, 0, 0, 0)
    assert commit(stub, 1) == 2
    assert commit(stub, 1) == 0  # idempotent
    s = stats(stub)
    assert (s.provisional_groups, s.acknowledged_groups) == (2, 2)
    assert commit(stub, 5) == 2
    s = stats(stub)
    assert (s.provisional_groups, s.acknowledged_groups, s.groups_written) == (0, 4, 4)
    assert put(stub, written).duplicates == 4  # trained for good: a retried write stores nothing


def test_a_rollback_hands_out_again_exactly_what_was_trained_after_the_checkpoint(buffer, dataset):
    stub = buffer()
    ids = [g.group_id for g in setup(stub, dataset, 8)]
    train(stub, 2, step=1)
    train(stub, 2, step=2)
    train(stub, 2, step=3)
    dead = stub.LeaseBatch(buffer_pb2.LeaseBatchRequest(run_id="r1", num_groups=1, lease_seconds=600))
    r = rollback(stub, 1)
    assert (r.committed, r.requeued, r.leases_released) == (2, 4, 1)
    s = stats(stub)
    assert (s.acknowledged_groups, s.provisional_groups, s.leased_groups, s.queued_groups) == (2, 0, 0, 6)
    assert s.rolled_back_groups == 4
    # Steps 2 and 3 first, in the order they were trained, then the dead trainer's lease, then the rest.
    again = stub.LeaseBatch(buffer_pb2.LeaseBatchRequest(run_id="r1", num_groups=6)).groups
    assert [g.group_id for g in again] == ids[2:6] + [dead.groups[0].group_id] + ids[7:]
    code, _ = code_of(lambda: stub.AckBatch(buffer_pb2.AckBatchRequest(run_id="r1", lease_id=dead.lease_id)))
    assert code == grpc.StatusCode.NOT_FOUND
    assert rollback(stub, 1).requeued == 0  # idempotent: nothing provisional left


def test_a_trainer_starting_from_scratch_rolls_back_everything_provisional(buffer, dataset):
    stub = buffer()
    ids = [g.group_id for g in setup(stub, dataset, 2)]
    train(stub, 2, step=1)
    r = rollback(stub, 0)
    assert (r.committed, r.requeued) == (0, 2)
    assert [g.group_id for g in stub.LeaseBatch(buffer_pb2.LeaseBatchRequest(run_id="r1", num_groups=2)).groups] == ids


def test_a_commit_settles_what_a_lost_rollback_left_of_a_dead_trainer(buffer, dataset):
    """Trainer A trains steps 1-3 provisionally and dies; B loads A's checkpoint of step 1,
    and its RollbackToCheckpoint is lost (a Redis that lost the write, a failover). B's
    steps are numbered 2, 3, ... too: its first commit must not take A's steps 2-3 for its
    own (final, though no checkpoint of B's holds them). It settles them as the rollback
    would have: A's step 1 final, A's steps 2-3 queued again, first, in order."""
    stub = buffer()
    ids = [g.group_id for g in setup(stub, dataset, 10)]
    for step in (1, 2, 3):
        train(stub, 2, step=step, load="a")
    assert train(stub, 2, step=2, load="b") == ids[6:8]
    reply = stub.CommitAcks(buffer_pb2.CommitAcksRequest(run_id="r1", through_step=2, load_id="b", loaded_step=1))
    assert (reply.committed, reply.requeued) == (4, 4)  # A's step 1 and B's step 2; A's steps 2-3
    s = stats(stub)
    assert (s.acknowledged_groups, s.provisional_groups, s.queued_groups, s.rolled_back_groups) == (4, 0, 6, 4)
    again = stub.LeaseBatch(buffer_pb2.LeaseBatchRequest(run_id="r1", num_groups=6)).groups
    assert [g.group_id for g in again] == ids[2:6] + ids[8:]
    reply = stub.CommitAcks(buffer_pb2.CommitAcksRequest(run_id="r1", through_step=9, load_id="b", loaded_step=1))
    assert (reply.committed, reply.requeued) == (0, 0)  # idempotent
    code, message = code_of(
        lambda: stub.CommitAcks(buffer_pb2.CommitAcksRequest(run_id="r1", through_step=1, load_id="b/../c"))
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "load_id" in message


def test_final_acks_are_unchanged_and_bad_requests_are_refused(buffer, dataset):
    stub = buffer()
    setup(stub, dataset, 2)
    train(stub, 2, step=1, provisional=False)
    s = stats(stub)
    assert (s.acknowledged_groups, s.provisional_groups) == (2, 0)
    assert rollback(stub, 0).requeued == 0  # final is final
    code, message = code_of(lambda: commit(stub, -1))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "through_step" in message
    code, _ = code_of(lambda: stub.RollbackToCheckpoint(buffer_pb2.RollbackToCheckpointRequest(run_id="nope", step=0)))
    assert code == grpc.StatusCode.NOT_FOUND


def test_a_retried_acknowledgment_answers_as_the_first_and_counts_once(buffer, dataset):
    # The buffer may die after acknowledging but before replying: the trainer asks again,
    # and must not be told its lease expired (its step would fail for nothing).
    stub = buffer()
    setup(stub, dataset, 4)
    for provisional in (False, True):
        batch = stub.LeaseBatch(buffer_pb2.LeaseBatchRequest(run_id="r1", num_groups=2))
        request = buffer_pb2.AckBatchRequest(run_id="r1", lease_id=batch.lease_id, step=1, provisional=provisional)
        assert [stub.AckBatch(request).acknowledged for _ in range(3)] == [2, 2, 2]
    s = stats(stub)
    assert (s.acknowledged_groups, s.provisional_groups, s.leased_groups) == (2, 2, 0)
    assert commit(stub, 1) == 2
    assert stats(stub).acknowledged_groups == 4


def test_a_retried_lease_answers_the_same_batch_and_a_released_one_comes_back_undelivered(buffer, dataset):
    stub = buffer()
    ids = [g.group_id for g in setup(stub, dataset, 4)]

    def lease(n: int, lease_id: str) -> list[str]:
        request = buffer_pb2.LeaseBatchRequest(run_id="r1", num_groups=n, lease_id=lease_id)
        reply = stub.LeaseBatch(request)
        assert reply.lease_id == lease_id
        return [g.group_id for g in reply.groups]

    # The reply of the first call was lost: the retry, with the same lease id, gets the same groups.
    assert lease(2, "step-1") == lease(2, "step-1") == ids[:2]
    assert (stats(stub).leased_groups, stats(stub).queued_groups) == (2, 2)
    # The step failed before training: given up, the batch is first in line again, and the
    # failed attempt does not count as a delivery.
    release = buffer_pb2.ReleaseBatchRequest(run_id="r1", lease_id="step-1")
    assert stub.ReleaseBatch(release).released == 2
    assert stub.ReleaseBatch(release).released == 0  # idempotent
    assert (stats(stub).leased_groups, stats(stub).queued_groups) == (0, 4)
    assert lease(4, "step-2") == ids
    s = stats(stub)
    assert (s.redelivered_groups, s.dead_letter_groups) == (0, 0)
    assert code_of(lambda: lease(1, "no:colons"))[0] == grpc.StatusCode.INVALID_ARGUMENT
