"""Crashes: the buffer process, a rollout worker and Redis itself killed with SIGKILL, and
two buffer replicas racing on one Redis; the engine, the reward service and the rollout
service killed and restarted under a run, which completes. Nothing acknowledged is lost,
nothing is delivered twice. (Lease timeouts are fractions of a second; no timing is asserted.)"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import grpc
import httpx
import pytest

from rlmesh.buffer.config import Settings
from rlmesh.buffer.server import start
from rlmesh.cli.embedded_redis import start_redis
from rlmesh.cli.launcher import http_ready, wait_until_ready
from rlmesh.common.auth import client_headers
from rlmesh.common.grpc_server import sync_channel
from rlmesh.common.net import free_port
from rlmesh.coordinator.app import start as start_coordinator
from rlmesh.coordinator.config import Settings as CoordinatorSettings
from rlmesh.trainer.config import Settings as TrainerSettings
from rlmesh.trainer.server import start as start_trainer
from rlmesh.v1 import buffer_pb2, buffer_pb2_grpc
from tests.helpers.buffer import completed, create, prompts, put, start_buffer_process, stats
from tests.helpers.runs import run_config
from tests.helpers.stack import wait_for_run


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
        ack = stub.AckBatch(
            buffer_pb2.AckBatchRequest(run_id="r1", lease_id=a.lease_id), wait_for_ready=True, timeout=60
        )
        assert ack.acknowledged == 2

        # trainer B leases, the buffer dies, B never acks (it died too): after the lease
        # expires the restarted buffer redelivers the batch; it is acknowledged once
        b = stub.LeaseBatch(buffer_pb2.LeaseBatchRequest(run_id="r1", num_groups=2, lease_seconds=0.3))
        kill(proc)
        proc = start_buffer_process(redis_url, port, log)
        again = stub.LeaseBatch(
            buffer_pb2.LeaseBatchRequest(run_id="r1", num_groups=2, wait_seconds=30), wait_for_ready=True, timeout=60
        )
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
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, f"127.0.0.1:{port}"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
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
    """appendfsync always (the embedded default): Redis answers a write once it is on disk,
    so a killed server loses nothing it acknowledged."""
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
        assert (after.prompts_handed_out, after.next_sample_index) == (
            before.prompts_handed_out,
            before.next_sample_index,
        )
        rest = stub.LeaseBatch(buffer_pb2.LeaseBatchRequest(run_id="r1", num_groups=8))
        assert list(rest.groups) == written[4:]  # every byte as written
        assert put(stub, written[:4]).duplicates == 4  # acknowledged ones stay acknowledged
        assert [g.group_id for g in prompts(stub, 1)] == ["g12"]  # the cursor too
    finally:
        server.stop()


REPLICA_GROUPS = 60


@pytest.mark.parametrize(
    "buffer_filter", ["rlmesh.buffer.filters:fifo", "rlmesh.buffer.filters:highest_reward_variance_first"]
)
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
        assert (s.groups_written, s.acknowledged_groups, s.queued_groups, s.leased_groups) == (
            REPLICA_GROUPS,
            REPLICA_GROUPS,
            0,
            0,
        )
    finally:
        kill(replica_a)


# ---------------------------------------------------------------- a peer killed under a run


def grpc_ready(address: str) -> bool:
    channel = grpc.insecure_channel(address)
    try:
        grpc.channel_ready_future(channel).result(timeout=0.5)
        return True
    except grpc.FutureTimeoutError:
        return False
    finally:
        channel.close()


class Peers:
    """The engine, the reward service and the rollout service, each in its own process on
    a fixed port (as deployed), so that each can be killed and started again in its place."""

    def __init__(self, redis_url: str, buffer_address: str, model_dir, log_dir) -> None:
        self.ports = {name: free_port() for name in ("engine", "reward", "rollout")}
        self.flags = {
            "engine": ["--model-path", str(model_dir), "--num-threads", "1"],
            "reward": ["--redis-url", redis_url],
            "rollout": [
                "--buffer-address",
                buffer_address,
                "--reward-address",
                self.address("reward"),
                "--engine-urls",
                f'["http://{self.address("engine")}"]',
            ],
        }
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def start(self, name: str) -> None:
        log = (self.log_dir / f"{name}.log").open("ab")
        self.procs[name] = proc = subprocess.Popen(
            [sys.executable, "-m", "rlmesh.cli", "serve", name, "--port", str(self.ports[name]), *self.flags[name]],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        address = self.address(name)
        ready = (lambda: http_ready(f"http://{address}")) if name == "engine" else (lambda: grpc_ready(address))
        wait_until_ready(ready, proc, name, timeout=120)

    def kill(self, name: str) -> None:
        kill(self.procs[name])

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                kill(proc)


@pytest.fixture
def peer_stack(redis_url, start_in_loop, tiny_model_dir, tmp_path):
    """(REST client, buffer stub, Peers): buffer, trainer and coordinator in-process; the
    coordinator retries quickly (backoff capped at 1 s)."""
    _, buffer_port = start_in_loop(lambda: start(Settings(redis_url=redis_url, port=0)))
    buffer_address = f"127.0.0.1:{buffer_port}"
    peers = Peers(redis_url, buffer_address, tiny_model_dir, tmp_path)
    try:
        for name in ("engine", "reward", "rollout"):
            peers.start(name)
        _, trainer_port = start_in_loop(
            lambda: start_trainer(
                TrainerSettings(
                    port=0,
                    buffer_address=buffer_address,
                    rollout_address=peers.address("rollout"),
                    work_dir=tmp_path / "trainer",
                )
            )
        )
        _, api_port = start_in_loop(
            lambda: start_coordinator(
                CoordinatorSettings(
                    port=0,
                    redis_url=redis_url,
                    buffer_address=buffer_address,
                    rollout_address=peers.address("rollout"),
                    reward_address=peers.address("reward"),
                    trainer_address=f"127.0.0.1:{trainer_port}",
                    retry_backoff_max_seconds=1.0,
                )
            )
        )
        api = httpx.Client(base_url=f"http://127.0.0.1:{api_port}", timeout=30, headers=client_headers())
        yield api, stub_at(buffer_port), peers
    finally:
        peers.close()


@pytest.mark.parametrize("peer", ["engine", "reward", "rollout"])
@pytest.mark.slow
def test_a_run_completes_when_a_peer_is_killed_and_restarted_under_it(peer_stack, tmp_path, tiny_model_dir, peer):
    api, buffer, peers = peer_stack
    config = run_config(tmp_path, tiny_model_dir, num_rollouts=3)
    config["max_outage_seconds"] = 120
    run_id = api.post("/runs", json=config).json()["id"]
    wait_for_run(api, run_id, lambda run: run["rollout_id"] >= 1 or run["status"] != "running")
    peers.kill(peer)
    peers.start(peer)  # on its port again: the run's calls find it there

    run = wait_for_run(api, run_id)
    assert run["status"] == "completed", run["error"]
    assert run["rollout_id"] == 3 and run["waiting_for"] == ""
    s = buffer.GetStats(buffer_pb2.GetStatsRequest(run_id=run_id))
    # every group written was trained once; nothing left queued or leased
    assert s.groups_written == s.acknowledged_groups >= 8
    assert (s.queued_groups, s.leased_groups) == (0, 0)
