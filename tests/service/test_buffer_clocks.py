"""Leases are timed on Redis's clock, not on the clocks of the buffer replicas: a replica
whose host clock runs an hour ahead (its own process, time.time shifted before anything
else runs) neither expires the leases another replica handed out nor hands their prompts
out again. Real Redis, real gRPC, two buffers."""

from __future__ import annotations

import time

import pytest

from rlmesh.common.grpc_server import sync_channel
from rlmesh.common.net import free_port
from rlmesh.v1 import buffer_pb2
from rlmesh.v1.buffer_pb2_grpc import BufferStub
from tests.helpers.buffer import completed, create, prompts, put, start_buffer_process, stats

SKEW_SECONDS = 3600.0


@pytest.fixture
def ahead(redis_url, tmp_path, monkeypatch):
    """A second buffer, as `rlmesh serve buffer` runs it, on a host whose clock is an hour ahead."""
    site = tmp_path / "skewed_clock"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        f"import time\n_real = time.time\ntime.time = lambda: _real() + {SKEW_SECONDS}\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(site))
    port = free_port()
    proc = start_buffer_process(redis_url, port, tmp_path / "ahead.log")
    monkeypatch.delenv("PYTHONPATH")
    yield BufferStub(sync_channel(f"127.0.0.1:{port}"))
    proc.terminate()
    proc.wait(timeout=30)


def lease(stub, n: int, **kw) -> buffer_pb2.LeaseBatchResponse:
    return stub.LeaseBatch(buffer_pb2.LeaseBatchRequest(run_id="r1", num_groups=n, **kw))


def test_a_replica_whose_clock_runs_ahead_expires_no_other_replicas_lease(buffer, ahead, dataset):
    stub = buffer()
    create(stub, dataset)
    put(stub, [completed(g) for g in prompts(stub, 2, lease_seconds=600)])
    held = lease(stub, 1, lease_seconds=600)

    # The replica an hour ahead leases next: the other lease has ten minutes to go.
    other = lease(ahead, 1, lease_seconds=600)
    assert [g.group_id for g in other.groups] != [g.group_id for g in held.groups]
    for stub_, batch in ((stub, held), (ahead, other)):
        stub_.AckBatch(buffer_pb2.AckBatchRequest(run_id="r1", lease_id=batch.lease_id))
    s = stats(stub)
    assert (s.acknowledged_groups, s.redelivered_groups) == (2, 0)

    # Prompts too: what one replica handed out is not handed out again by the other.
    first = prompts(stub, 2, lease_seconds=600)
    again = prompts(ahead, 2, lease_seconds=600)
    assert not {g.group_id for g in first} & {g.group_id for g in again}
    assert stats(stub).prompts_reissued == 0

    # A lease that has run out on Redis's clock still expires, whichever replica looks.
    put(stub, [completed(g) for g in first])
    short = lease(stub, 1, lease_seconds=0.05)
    time.sleep(0.2)
    assert [g.group_id for g in lease(ahead, 1, wait_seconds=5).groups] == [g.group_id for g in short.groups]
    assert stats(stub).redelivered_groups == 1
