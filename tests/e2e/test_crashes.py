"""Crashes: the buffer process, a rollout worker and Redis itself killed with SIGKILL, and
two buffer replicas racing on one Redis. Nothing acknowledged is lost, nothing is
delivered twice. (Lease timeouts are fractions of a second; no timing is asserted.)"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

from rlmesh.buffer.config import Settings
from rlmesh.buffer.server import start
from rlmesh.cli.embedded_redis import start_redis
from rlmesh.common.grpc_server import sync_channel
from rlmesh.common.net import free_port
from rlmesh.v1 import buffer_pb2, buffer_pb2_grpc
from tests.helpers.buffer import completed, create, prompts, put, start_buffer_process, stats


def stub_at(port: int) -> buffer_pb2_grpc.BufferStub:
    return buffer_pb2_grpc.BufferStub(sync_channel(f"127.0.0.1:{port}"))


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


@pytest.mark.slow
def test_buffer_killed_between_a_trainers_lease_and_its_ack(redis_url, dataset, tmp_path):
    port = free_port()
    log = tmp_path / "buffer.log"
    proc = start_buffer_process(redis_url, port, log)
    stub = stub_at(port)
    try:
        create(stub, dataset)
        written = [completed(g) for g in prompts(stub, 4)]
        put(stub, written)
        # trainer A leases, the buffer dies before A's ack; A's ack reaches the restarted
        # buffer within the lease: accepted (the lease lives in Redis), trained once
        a = stub.LeaseBatch(buffer_pb2.LeaseBatchRequest(run_id="r1", num_groups=2, lease_seconds=60))
        kill(proc)
        with pytest.raises(grpc.RpcError) as e:
            stub.AckBatch(buffer_pb2.AckBatchRequest(run_id="r1", lease_id=a.lease_id), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        proc = start_buffer_process(redis_url, port, log)
        # As a real client would: wait for the channel to reconnect (it is in backoff).
        ack = stub.AckBatch(buffer_pb2.AckBatchRequest(run_id="r1", lease_id=a.lease_id), wait_for_ready=True, timeout=60)
        assert ack.acknowledged == 2

        # trainer B leases, the buffer dies, B never acks (it died too): after the lease
        # expires the restarted buffer redelivers the batch; it is acknowledged once
        b = stub.LeaseBatch(buffer_pb2.LeaseBatchRequest(run_id="r1", num_groups=2, lease_seconds=0.3))
        kill(proc)
        proc = start_buffer_process(redis_url, port, log)
        again = stub.LeaseBatch(buffer_pb2.LeaseBatchRequest(run_id="r1", num_groups=2, wait_seconds=30),
                                wait_for_ready=True, timeout=60)
        assert list(again.groups) == list(b.groups) == written[2:]
        assert stub.AckBatch(buffer_pb2.AckBatchRequest(run_id="r1", lease_id=again.lease_id)).acknowledged == 2
        with pytest.raises(grpc.RpcError) as e:
            stub.AckBatch(buffer_pb2.AckBatchRequest(run_id="r1", lease_id=b.lease_id))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert not stub.LeaseBatch(buffer_pb2.LeaseBatchRequest(run_id="r1", num_groups=1, wait_seconds=0.3)).groups
        s = stats(stub)
        assert (s.acknowledged_groups, s.redelivered_groups, s.queued_groups, s.leased_groups) == (4, 2, 0, 0)
    finally:
        kill(proc)


WORKER = """
import sys
from rlmesh.v1 import buffer_pb2, buffer_pb2_grpc
from rlmesh.common.grpc_server import sync_channel
stub = buffer_pb2_grpc.BufferStub(sync_channel(sys.argv[1]))
groups = stub.GetPrompts(buffer_pb2.GetPromptsRequest(run_id="r1", num_groups=2, lease_seconds=0.3)).groups
print(" ".join(g.group_id for g in groups), flush=True)
sys.stdin.read()  # "generating" until killed
"""


@pytest.mark.slow
def test_prompts_of_a_killed_rollout_worker_are_handed_out_again(redis_url, dataset, start_in_loop):
    _srv, port = start_in_loop(lambda: start(Settings(redis_url=redis_url, port=0)))
    stub = stub_at(port)
    create(stub, dataset)
    worker = subprocess.Popen([sys.executable, "-c", WORKER, f"127.0.0.1:{port}"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        held = worker.stdout.readline().split()
        assert held == ["g0", "g1"]
        assert [g.group_id for g in prompts(stub, 1)] == ["g2"]  # still leased to the worker: not handed out
    finally:
        kill(worker)
    time.sleep(0.4)  # let the dead worker's lease run out
    again = prompts(stub, 3)
    assert [g.group_id for g in again] == ["g0", "g1", "g3"]
    assert [g.samples[0].prompt for g in again[:2]] == ["question 0", "question 1"]
    assert stats(stub).prompts_reissued == 2


@pytest.mark.slow
def test_redis_killed_and_restarted_on_its_data_dir_loses_nothing_acknowledged(tmp_path, start_in_loop, dataset):
    """appendfsync everysec: a power cut can cost up to a second of writes, but a killed
    redis-server process loses nothing it wrote to the append-only file before replying."""
    server = start_redis(tmp_path / "redis")
    try:
        _, port = start_in_loop(lambda: start(Settings(redis_url=server.url, port=0)))
        stub = stub_at(port)
        create(stub, dataset, n=2)
        written = []
        for _ in range(4):  # several acknowledged writes, the last one just before the kill
            batch = [completed(g, version=1) for g in prompts(stub, 3)]
            assert put(stub, batch).stored == 3
            written += batch
        first = stub.LeaseBatch(buffer_pb2.LeaseBatchRequest(run_id="r1", num_groups=4))
        assert stub.AckBatch(buffer_pb2.AckBatchRequest(run_id="r1", lease_id=first.lease_id)).acknowledged == 4
        before = stats(stub)
        server.stop(kill=True)

        with pytest.raises(grpc.RpcError) as e:  # Redis down: UNAVAILABLE, not an internal error
            stats(stub)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE

        server = start_redis(tmp_path / "redis", port=server.port)
        after = stats(stub)
        assert (after.groups_written, after.acknowledged_groups, after.queued_groups) == (12, 4, 8)
        assert (after.prompts_handed_out, after.next_sample_index) == (before.prompts_handed_out, before.next_sample_index)
        rest = stub.LeaseBatch(buffer_pb2.LeaseBatchRequest(run_id="r1", num_groups=8))
        assert list(rest.groups) == written[4:]  # every byte as written
        assert put(stub, written[:4]).duplicates == 4  # acknowledged ones stay acknowledged
        assert [g.group_id for g in prompts(stub, 1)] == ["g12"]  # the cursor too
    finally:
        server.stop()


REPLICA_GROUPS = 60


@pytest.mark.parametrize("buffer_filter", ["rlmesh.buffer.filters:fifo",
                                           "rlmesh.buffer.filters:highest_reward_variance_first"])
@pytest.mark.slow
def test_two_replicas_deliver_every_group_exactly_once(redis_url, start_in_loop, dataset, tmp_path, buffer_filter):
    flags = ["--buffer-filter", buffer_filter]
    port_a = free_port()
    replica_a = start_buffer_process(redis_url, port_a, tmp_path / "a.log", *flags)
    try:
        _, port_b = start_in_loop(lambda: start(Settings(redis_url=redis_url, port=0, buffer_filter=buffer_filter)))
        stubs = [stub_at(port_a), stub_at(port_b)]
        create(stubs[0], dataset, n=4)
        errors: list[BaseException] = []
        delivered: list[str] = []
        lock = threading.Lock()

        def writer(w: int) -> None:
            try:
                for _ in range(REPLICA_GROUPS // 4 // 3):
                    stub = stubs[w % 2]
                    batch = [completed(g, rewards=[w, 0, 1, w % 3]) for g in prompts(stub, 3)]
                    put(stub, batch)
                    put(stubs[(w + 1) % 2], batch[:1])  # a retried write through the other replica
            except BaseException as e:
                errors.append(e)

        def leaser(i: int) -> None:
            stub = stubs[i % 2]
            try:
                while True:
                    with lock:
                        if len(delivered) >= REPLICA_GROUPS:
                            return
                    batch = stub.LeaseBatch(buffer_pb2.LeaseBatchRequest(run_id="r1", num_groups=2, wait_seconds=0.2))
                    if batch.groups:
                        with lock:
                            delivered.extend(g.group_id for g in batch.groups)
                        stub.AckBatch(buffer_pb2.AckBatchRequest(run_id="r1", lease_id=batch.lease_id))
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
        threads += [threading.Thread(target=leaser, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors
        assert sorted(delivered) == sorted(f"g{i}" for i in range(REPLICA_GROUPS))  # each exactly once
        s = stats(stubs[1])
        assert (s.groups_written, s.acknowledged_groups, s.queued_groups, s.leased_groups) == (REPLICA_GROUPS, REPLICA_GROUPS, 0, 0)
    finally:
        kill(replica_a)
