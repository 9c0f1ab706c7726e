"""The shared retry helper: backoff that doubles up to a cap, jitter within bounds, and a
call that gives up after the outage budget with a message naming the service. The clock
and the sleep are injected: nothing here waits."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from rlmesh.common.errors import Unavailable
from rlmesh.common.retry import Backoff, OutageTooLong, retry, transient_grpc_error


class FakeTime:
    """A clock that only moves when someone sleeps."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def failing(times: int, error: Exception, result: str = "ok"):
    calls = []

    async def call() -> str:
        calls.append(1)
        if len(calls) <= times:
            raise error
        return result

    return call, calls


def test_backoff_doubles_up_to_its_cap_and_jitters_within_half_to_full():
    b = Backoff(base_seconds=0.5, max_seconds=4.0)
    assert [b.ceiling(n) for n in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert b.delay(3, uniform=lambda lo, hi: lo) == 1.0
    assert b.delay(3, uniform=lambda lo, hi: hi) == 2.0
    assert all(1.0 <= b.delay(3) <= 2.0 for _ in range(200))


def test_a_call_is_retried_through_an_outage_and_each_wait_is_reported():
    t = FakeTime()
    call, calls = failing(3, rpc_error(grpc.StatusCode.UNAVAILABLE, "Socket closed"))
    waits: list[str] = []

    async def on_wait(reason: str) -> None:
        waits.append(reason)

    result = asyncio.run(
        retry(
            call,
            service="trainer at 127.0.0.1:50054",
            budget_seconds=60,
            on_wait=on_wait,
            backoff=Backoff(1.0, 10.0),
            clock=t.clock,
            sleep=t.sleep,
            uniform=lambda lo, hi: hi,
        )
    )
    assert result == "ok" and len(calls) == 4
    assert t.sleeps == [1.0, 2.0, 4.0]
    assert len(waits) == 3
    assert waits[0].startswith("waiting for trainer at 127.0.0.1:50054: UNAVAILABLE: Socket closed")


def test_the_outage_budget_runs_out_with_a_message_naming_the_service():
    t = FakeTime()
    call, calls = failing(1000, rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
    with pytest.raises(OutageTooLong) as e:
        asyncio.run(
            retry(
                call,
                service="reward service at 127.0.0.1:50053",
                budget_seconds=30,
                backoff=Backoff(1.0, 8.0),
                clock=t.clock,
                sleep=t.sleep,
                uniform=lambda lo, hi: hi,
            )
        )
    assert isinstance(e.value, Unavailable)  # answered as UNAVAILABLE by a gRPC service
    message = str(e.value)
    assert "reward service at 127.0.0.1:50053" in message and "30 s" in message and "DEADLINE_EXCEEDED" in message
    assert sum(t.sleeps) <= 30  # never waits past the budget
    assert t.sleeps == [1.0, 2.0, 4.0, 8.0, 8.0] and len(calls) == 6


def test_errors_that_are_not_an_outage_are_raised_at_once():
    t = FakeTime()
    call, calls = failing(1, rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "bad num_groups"))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        asyncio.run(retry(call, service="buffer", budget_seconds=60, clock=t.clock, sleep=t.sleep))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and len(calls) == 1 and not t.sleeps


def test_transient_grpc_errors_are_the_ones_a_restarting_peer_gives():
    for code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        assert transient_grpc_error(rpc_error(code, "x")) == f"{code.name}: x"
    for code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INTERNAL):
        assert transient_grpc_error(rpc_error(code, "x")) is None
    assert transient_grpc_error(ValueError("x")) is None
