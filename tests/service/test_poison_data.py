"""Poisoned data (token ids outside the vocabulary, broken arrays, non-finite numbers)
stops where it can be seen: the buffer refuses such writes whole; what only the trainer
can see goes to the run's dead-letter list with its reason, as does a group whose leases
keep expiring; the run trains on. Real Redis, real buffer, real trainer on the tiny model."""

from __future__ import annotations

import functools
import json
import math
import time

import grpc
import pytest

from rlmesh.buffer.config import Settings as BufferSettings
from rlmesh.buffer.server import start as start_buffer
from rlmesh.common.grpc_server import start_service, sync_channel
from rlmesh.common.net import free_port
from rlmesh.common.run_config import TrainerRunConfig
from rlmesh.common.sample import Sample, SampleGroup, Status, group_to_proto
from rlmesh.trainer.config import Settings as TrainerSettings
from rlmesh.trainer.server import build as build_trainer
from rlmesh.trainer.trainer import Trainer
from rlmesh.v1 import buffer_pb2, trainer_pb2
from rlmesh.v1.buffer_pb2_grpc import BufferStub
from rlmesh.v1.trainer_pb2_grpc import TrainerStub
from tests.helpers.buffer import code_of, put, stats
from tests.helpers.prometheus import scrape
from tests.helpers.prometheus import value as metric_value

INVALID = grpc.StatusCode.INVALID_ARGUMENT
Rejection = buffer_pb2.RejectGroupsRequest.Rejection


def group(group_id: str, response=(8, 9), rewards=(1.0, 0.0), **sample_fields):
    """A completed group of len(rewards) samples: prompt [5, 6, 7] + `response`."""
    samples = [
        Sample(
            index=i,
            tokens=[5, 6, 7, *response],
            response_length=len(response),
            loss_mask=[1] * len(response),
            rollout_log_probs=[-0.5] * len(response),
            reward=r,
            status=Status.COMPLETED,
        )
        for i, r in enumerate(rewards)
    ]
    for name, value in sample_fields.items():
        setattr(samples[-1], name, value)
    return group_to_proto(SampleGroup(group_id, 0, samples, "train"))


def create(stub, dataset, run_id="r1", vocab_size=0):
    stub.CreateRun(
        buffer_pb2.CreateRunRequest(
            run_id=run_id,
            n_samples_per_prompt=2,
            vocab_size=vocab_size,
            datasets=[buffer_pb2.DatasetSpec(name="train", path=str(dataset), prompt_key="q", label_key="a")],
        )
    )


def lease(stub, run_id="r1", **kw) -> buffer_pb2.LeaseBatchResponse:
    return stub.LeaseBatch(buffer_pb2.LeaseBatchRequest(run_id=run_id, **kw))


def export_dead_letters(stub, path, run_id="r1") -> list[dict]:
    stub.ExportGroups(buffer_pb2.ExportGroupsRequest(run_id=run_id, path=str(path), dead_letters=True))
    return [json.loads(line) for line in path.read_text().splitlines()]


# ------------------------------------------------------------------ refused at write time


@pytest.mark.parametrize(
    "fields, says",
    [
        ({"tokens": [5, 6, 7, -3, 9]}, "tokens holds id -3 at position 3, outside 0.."),
        ({"loss_mask": [1]}, "loss_mask has 1 entries but response_length is 2"),
        ({"rollout_log_probs": [-0.5, -0.5, -0.5]}, "rollout_log_probs has 3 entries but response_length is 2"),
        ({"response_length": 9}, "response_length 9 is outside 0..5"),
        ({"reward": math.nan}, "reward is nan, not a finite number"),
        ({"reward_components": {"acc": math.inf}}, "reward_components['acc'] is inf, not a finite number"),
        ({"rollout_log_probs": [-0.5, -math.inf]}, "rollout_log_probs holds -inf at position 1, not a finite number"),
    ],
)
def test_a_write_with_a_broken_group_is_refused_whole_naming_the_group_and_field(buffer, dataset, fields, says):
    stub = buffer()
    create(stub, dataset)
    put(stub, [group("before")])

    code, details = code_of(lambda: put(stub, [group("ok"), group("bad", **fields)]))
    assert code == INVALID
    assert "group 'bad', sample 1: " + says in details and "none of its groups was stored" in details
    code, _ = code_of(
        lambda: stub.ReturnPartialGroups(buffer_pb2.PutGroupsRequest(run_id="r1", groups=[group("bad", **fields)]))
    )
    assert code == INVALID

    # Nothing else of the run was touched: the group before is queued, the good one can be written.
    s = stats(stub)
    assert (s.groups_written, s.queued_groups, s.partial_groups) == (1, 1, 0)
    assert put(stub, [group("ok")]).stored == 1


def test_token_ids_are_checked_against_the_runs_vocab_size_and_counts_against_the_limits(buffer, dataset):
    stub = buffer(limits={"max_samples_per_prompt": 3})
    create(stub, dataset, vocab_size=10)
    code, details = code_of(lambda: put(stub, [group("big", response=(8, 10))]))
    assert (
        code == INVALID
        and "group 'big', sample 0: tokens holds id 10 at position 4, outside the vocabulary [0, 9]" in details
    )
    assert put(stub, [group("fits", response=(8, 9))]).stored == 1

    code, details = code_of(lambda: put(stub, [group("many", rewards=(1.0,) * 4)]))
    assert code == INVALID and "samples in one group is 4, more than the limit of 3" in details
    assert stats(stub).groups_written == 1

    code, details = code_of(lambda: create(stub, dataset, run_id="r2", vocab_size=-1))
    assert code == INVALID and "vocab_size" in details


# ------------------------------------------------------------------ dead letters from the trainer


@pytest.fixture
def stack(redis_url, start_in_loop, loop_thread, tmp_path, tiny_model_dir):
    """(buffer stub, trainer stub) over a real buffer and a trainer holding run r1 of the tiny model."""
    _, port = start_in_loop(lambda: start_buffer(BufferSettings(redis_url=redis_url, port=0)))
    trainer = Trainer(TrainerSettings(work_dir=tmp_path, buffer_address=f"127.0.0.1:{port}"))
    server, trainer_port = loop_thread.run(
        start_service(functools.partial(build_trainer, trainer=trainer), trainer.settings)
    )
    config = TrainerRunConfig.model_validate(
        {"model_path": str(tiny_model_dir), "micro_batch_size": 2, "optimizer": {"lr": 1e-3}, "device": "cpu"}
    )
    trainer_stub = TrainerStub(sync_channel(f"127.0.0.1:{trainer_port}"))
    trainer_stub.InitRun(trainer_pb2.InitRunRequest(run_id="r1", config_json=config.model_dump_json()))
    yield BufferStub(sync_channel(f"127.0.0.1:{port}")), trainer_stub
    loop_thread.run(trainer.close())
    loop_thread.run(server.stop(None))


def test_groups_the_trainer_cannot_train_go_to_the_dead_letter_list_and_the_run_trains_on(
    stack, dataset, tiny_model_dir, tmp_path
):
    buffer, trainer = stack
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    create(buffer, dataset)  # the run does not tell the buffer its vocab_size: only the trainer can see

    def step(n):
        return trainer.TrainStep(trainer_pb2.TrainStepRequest(run_id="r1", num_groups=n, wait_seconds=5))

    # A batch with one poisoned group: that group is rejected, the other one trains.
    put(buffer, [group("p1", response=(8, vocab + 3)), group("g1")])
    r = step(2)
    assert (r.step, r.groups_trained, r.metrics["rejected_groups"]) == (1, 1, 1)

    # A batch with nothing trainable: no step, no error.
    put(buffer, [group("p2", response=(vocab,))])
    r = step(1)
    assert (r.step, r.groups_trained, r.metrics["rejected_groups"]) == (1, 0, 1)

    # The next good batch trains.
    put(buffer, [group("g2")])
    r = step(1)
    assert (r.step, r.groups_trained, r.metrics["rejected_groups"]) == (2, 1, 0)

    s = stats(buffer)
    # (acknowledged provisionally: checkpoints are on by default, by time)
    acknowledged = s.acknowledged_groups + s.provisional_groups
    assert (s.dead_letter_groups, acknowledged, s.queued_groups, s.leased_groups) == (2, 2, 0, 0)
    assert put(buffer, [group("p1", response=(8, vocab + 3))]).duplicates == 1  # never stored again
    lines = export_dead_letters(buffer, tmp_path / "dead.jsonl")
    assert [line["group_id"] for line in lines] == ["p1", "p2"]
    assert (
        f"group 'p1', sample 0: tokens holds id {vocab + 3}, outside the model's vocabulary [0, {vocab - 1}]"
        in lines[0]["reason"]
    )
    assert lines[0]["samples"][1]["tokens"] == [5, 6, 7, 8, vocab + 3]  # as it was written, to find its source


# ------------------------------------------------------------------ bounded redelivery


def test_a_group_whose_leases_keep_expiring_goes_to_the_dead_letter_list(buffer, dataset, tmp_path):
    port = free_port()
    stub = buffer(max_deliveries=2, metrics_port=port)
    create(stub, dataset)
    put(stub, [group("g1"), group("g2")])

    first = lease(stub, num_groups=1, lease_seconds=0.001)
    time.sleep(0.1)  # the first lease has expired: g1 is due again, ahead of g2
    again = lease(stub, num_groups=1, lease_seconds=0.001, wait_seconds=5)
    assert [b.groups[0].group_id for b in (first, again)] == ["g1", "g1"]
    # The second lease expires too: g1 has had its max_deliveries, and g2 comes next.
    after = lease(stub, num_groups=2, wait_seconds=0.2)
    assert not after.groups
    code, _ = code_of(lambda: stub.AckBatch(buffer_pb2.AckBatchRequest(run_id="r1", lease_id=again.lease_id)))
    assert code == grpc.StatusCode.NOT_FOUND
    last = lease(stub, num_groups=1)
    assert [g.group_id for g in last.groups] == ["g2"]
    stub.AckBatch(buffer_pb2.AckBatchRequest(run_id="r1", lease_id=last.lease_id))

    s = stats(stub)
    assert (s.dead_letter_groups, s.redelivered_groups, s.acknowledged_groups, s.queued_groups, s.leased_groups) == (
        1,
        1,
        1,
        0,
        0,
    )
    [line] = export_dead_letters(stub, tmp_path / "dead.jsonl")
    assert line["group_id"] == "g1" and "delivered 2 times and never acknowledged" in line["reason"]
    assert "max_deliveries is 2" in line["reason"]
    assert metric_value(scrape(f"http://127.0.0.1:{port}/metrics"), "rlmesh_buffer_dead_letter_groups", run="r1") == 1


def test_reject_groups_errors(buffer, dataset):
    stub = buffer()

    def reject(lease_id, *group_ids, run_id="r1"):
        return stub.RejectGroups(
            buffer_pb2.RejectGroupsRequest(
                run_id=run_id, lease_id=lease_id, groups=[Rejection(group_id=g, reason="bad") for g in group_ids]
            )
        )

    code, _ = code_of(lambda: reject("x", "g1", run_id="nope"))
    assert code == grpc.StatusCode.NOT_FOUND
    create(stub, dataset)
    put(stub, [group("g1"), group("g2")])
    batch = lease(stub, num_groups=1)
    code, details = code_of(lambda: reject("no-such-lease", "g1"))
    assert code == grpc.StatusCode.NOT_FOUND and "no-such-lease" in details
    code, _ = code_of(lambda: reject(batch.lease_id))
    assert code == INVALID
    code, details = code_of(lambda: reject(batch.lease_id, "g1", "g2"))  # g2 is queued, not in this lease
    assert code == INVALID and "group 'g2' is not in lease" in details and "nothing was rejected" in details
    assert stats(stub).dead_letter_groups == 0

    assert reject(batch.lease_id, "g1").rejected == 1
    assert reject(batch.lease_id, "g1").rejected == 1  # a retry (the reply was lost) answers the same
    assert stats(stub).dead_letter_groups == 1
    # The lease stays, now empty: acknowledging it acknowledges nothing.
    assert stub.AckBatch(buffer_pb2.AckBatchRequest(run_id="r1", lease_id=batch.lease_id)).acknowledged == 0
    s = stats(stub)
    assert (s.dead_letter_groups, s.acknowledged_groups, s.queued_groups) == (1, 0, 1)


# ------------------------------------------------------------------ rollbacks are not failed deliveries


def rollback(stub, step: int = 0) -> None:
    """What a trainer restarted from its checkpoint at `step` tells the buffer first."""
    stub.RollbackToCheckpoint(buffer_pb2.RollbackToCheckpointRequest(run_id="r1", step=step))


def dead_letter_reasons(stub, tmp_path) -> dict[str, str]:
    return {line["group_id"]: line["reason"] for line in export_dead_letters(stub, tmp_path / "dead.jsonl")}


def test_a_group_whose_trainers_keep_dying_is_not_a_failed_delivery(buffer, dataset, tmp_path):
    # Preempted trainers: each dies holding g1 (its lease released by the next trainer's
    # rollback) or after training it (its provisional acknowledgment rolled back), six
    # times, three past max_deliveries: g1 is handed out again each time, and then trained.
    stub = buffer(max_deliveries=2, max_rollbacks=10)
    create(stub, dataset)
    put(stub, [group("g1")])
    for restart in range(6):
        held = lease(stub, num_groups=1, lease_id=f"t{restart}")
        assert [g.group_id for g in held.groups] == ["g1"], restart
        if restart % 2:
            stub.AckBatch(buffer_pb2.AckBatchRequest(run_id="r1", lease_id=held.lease_id, step=1, provisional=True))
        rollback(stub)
    # A real failed delivery after all that still leaves it one more (max_deliveries=2).
    lease(stub, num_groups=1, lease_seconds=0.001)
    time.sleep(0.1)
    last = lease(stub, num_groups=1, wait_seconds=5)
    assert [g.group_id for g in last.groups] == ["g1"]
    stub.AckBatch(buffer_pb2.AckBatchRequest(run_id="r1", lease_id=last.lease_id))
    s = stats(stub)
    assert (s.dead_letter_groups, s.acknowledged_groups, s.queued_groups) == (0, 1, 0)


def test_failed_deliveries_and_dying_trainers_each_dead_letter_at_their_own_limit(buffer, dataset, tmp_path):
    stub = buffer(max_deliveries=2, max_rollbacks=3)
    create(stub, dataset)
    put(stub, [group("expires"), group("crashes")])
    # "expires": its leases expire (no trainer restarted: the next lease finds them expired);
    # a rollback between them does not wipe the failures: the second expiry sends it to the
    # dead-letter list.
    lease(stub, num_groups=1, lease_seconds=0.001)
    time.sleep(0.1)
    assert [g.group_id for g in lease(stub, num_groups=1).groups] == ["expires"]  # (the first failure)
    rollback(stub)  # (its trainer died holding it: not a failure)
    lease(stub, num_groups=1, lease_seconds=0.001)
    time.sleep(0.1)
    # "crashes": every trainer that takes it dies (a batch that kills its trainer): the third
    # rollback that releases it sends it to the dead-letter list.
    for restart in range(3):
        assert [g.group_id for g in lease(stub, num_groups=1, wait_seconds=5).groups] == ["crashes"], restart
        rollback(stub)
    assert not lease(stub, num_groups=1).groups
    reasons = dead_letter_reasons(stub, tmp_path)
    assert reasons.keys() == {"expires", "crashes"}
    assert "delivered 2 times and never acknowledged" in reasons["expires"]
    assert "held by 3 trainers that died" in reasons["crashes"] and "max_rollbacks is 3" in reasons["crashes"]
    s = stats(stub)
    assert (s.dead_letter_groups, s.queued_groups, s.leased_groups) == (2, 0, 0)
