"""Coalescer: callers that submit while a call is under way share the next call, each gets
its own item's result, and one bad item fails only its own caller; and which failures of a
fully_async loop's shared call send its groups again one by one."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from rlmesh.common.coalesce import Coalescer
from rlmesh.common.errors import InvalidArgument, Unavailable
from rlmesh.common.retry import OutageTooLong
from rlmesh.rollout.async_rollout import maybe_one_groups_fault


class BadItem(ValueError):
    pass


class Calls:
    """A call that doubles its items, taking `seconds`; records each call's items."""

    def __init__(self, seconds: float = 0.01, bad: frozenset = frozenset()) -> None:
        self.seconds = seconds
        self.bad = bad
        self.batches: list[list[int]] = []

    async def __call__(self, items: list[int]) -> list[int]:
        self.batches.append(list(items))
        await asyncio.sleep(self.seconds)
        if self.bad & set(items):
            raise BadItem(f"bad item(s) {sorted(self.bad & set(items))}")
        return [2 * i for i in items]


def test_items_submitted_during_a_call_go_out_together_in_the_next():
    async def main():
        calls = Calls(seconds=0.05)
        coalescer = Coalescer(calls, max_items=10)
        first = asyncio.create_task(coalescer.submit(1))
        await asyncio.sleep(0.01)  # the first call is under way
        rest = [asyncio.create_task(coalescer.submit(i)) for i in (2, 3, 4)]
        assert await first == 2
        assert await asyncio.gather(*rest) == [4, 6, 8]
        return calls.batches

    assert asyncio.run(main()) == [[1], [2, 3, 4]]


def test_a_call_carries_at_most_max_items():
    async def main():
        calls = Calls()
        coalescer = Coalescer(calls, max_items=2)
        results = await asyncio.gather(*(coalescer.submit(i) for i in range(5)))
        return results, calls.batches

    results, batches = asyncio.run(main())
    assert results == [0, 2, 4, 6, 8]
    assert batches == [[0, 1], [2, 3], [4]]


def test_a_bad_item_fails_only_its_own_caller_when_its_error_is_an_items_own():
    async def main():
        calls = Calls(bad=frozenset({3}))
        coalescer = Coalescer(calls, max_items=10, alone_if=lambda e: isinstance(e, BadItem))
        return await asyncio.gather(*(coalescer.submit(i) for i in (1, 2, 3, 4)), return_exceptions=True), calls

    results, calls = asyncio.run(main())
    assert results[:2] == [2, 4] and results[3] == 8
    assert isinstance(results[2], BadItem)
    assert calls.batches == [[1, 2, 3, 4], [1], [2], [3], [4]]  # sent again one by one


def test_any_other_failure_fails_every_caller_of_that_call_once():
    async def main():
        calls = Calls(bad=frozenset({3}))
        coalescer = Coalescer(calls, max_items=10)  # (no error is an item's own)
        return await asyncio.gather(*(coalescer.submit(i) for i in (1, 2, 3)), return_exceptions=True), calls

    results, calls = asyncio.run(main())
    assert all(isinstance(r, BadItem) for r in results)
    assert calls.batches == [[1, 2, 3]]


def test_a_caller_that_gives_up_is_left_out_and_the_others_are_answered():
    async def main():
        calls = Calls(seconds=0.05)
        coalescer = Coalescer(calls, max_items=10)
        first = asyncio.create_task(coalescer.submit(1))
        await asyncio.sleep(0.01)
        gone, kept = asyncio.create_task(coalescer.submit(2)), asyncio.create_task(coalescer.submit(3))
        await asyncio.sleep(0)
        gone.cancel()
        assert await first == 2 and await kept == 6
        return calls.batches

    assert asyncio.run(main()) == [[1], [3]]


def test_closing_fails_the_callers_still_waiting():
    async def main():
        coalescer = Coalescer(Calls(seconds=5), max_items=10)
        waiting = [asyncio.create_task(coalescer.submit(i)) for i in (1, 2)]
        await asyncio.sleep(0.01)
        await coalescer.close()
        return await asyncio.gather(*waiting, return_exceptions=True)

    results = asyncio.run(main())
    assert all(isinstance(r, RuntimeError) and "closing" in str(r) for r in results)


def test_max_items_must_be_positive():
    with pytest.raises(ValueError, match="max_items"):
        Coalescer(Calls(), max_items=0)


def test_a_wrong_number_of_results_fails_every_caller_of_that_call():
    async def short(items: list[int]) -> list[int]:
        return items[:-1]

    async def main():
        coalescer = Coalescer(short, max_items=10)
        return await asyncio.gather(*(coalescer.submit(i) for i in (1, 2)), return_exceptions=True)

    assert all(isinstance(r, RuntimeError) and "1 results for 2 items" in str(r) for r in asyncio.run(main()))


def test_close_ends_a_call_that_swallows_its_cancellation():
    """grpc.aio's calls can return their answer when a cancellation lands: closing cancels
    again until the sender has ended, and nobody is left waiting."""

    async def swallowing(items: list[int]) -> list[int]:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            pass  # answers anyway, once
        await asyncio.sleep(30)
        return items

    async def main():
        coalescer = Coalescer(swallowing, max_items=1)
        waiting = [asyncio.create_task(coalescer.submit(i)) for i in (1, 2)]
        await asyncio.sleep(0.01)
        await asyncio.wait_for(coalescer.close(), timeout=10)
        results = await asyncio.gather(*waiting, return_exceptions=True)
        with pytest.raises(RuntimeError, match="closed"):
            await coalescer.submit(3)
        return results

    assert all(isinstance(r, RuntimeError) for r in asyncio.run(main()))


def test_a_failing_alone_if_fails_the_callers_instead_of_leaving_them_waiting():
    def broken(_: Exception) -> bool:
        raise KeyError("alone_if")

    async def main():
        coalescer = Coalescer(Calls(bad=frozenset({1})), max_items=10, alone_if=broken)
        return await asyncio.wait_for(
            asyncio.gather(*(coalescer.submit(i) for i in (1, 2)), return_exceptions=True), timeout=5
        )

    assert all(isinstance(r, KeyError) for r in asyncio.run(main()))


def rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "details")


@pytest.mark.parametrize(
    "code, split",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, True),  # one group's bad content
        (grpc.StatusCode.RESOURCE_EXHAUSTED, True),  # no room for all of them at once
        (grpc.StatusCode.FAILED_PRECONDITION, True),  # more than the queue's cap at once
        (grpc.StatusCode.INTERNAL, True),
        (grpc.StatusCode.UNAVAILABLE, False),  # the peer out of reach, its retries spent
        (grpc.StatusCode.DEADLINE_EXCEEDED, False),
        (grpc.StatusCode.NOT_FOUND, False),  # the run is gone, whatever the groups
        (grpc.StatusCode.UNAUTHENTICATED, False),
    ],
)
def test_which_failures_of_a_shared_call_send_its_groups_again_alone(code, split):
    assert maybe_one_groups_fault(rpc_error(code)) is split
    try:  # as the reward service's failures reach the loop: chained to the gRPC error
        raise Unavailable("reward service failed") from rpc_error(code)
    except Unavailable as e:
        assert maybe_one_groups_fault(e) is split


def test_an_outage_the_retries_outlasted_is_not_one_groups_fault():
    assert not maybe_one_groups_fault(OutageTooLong("the reward service has not answered for 120 s"))
    assert maybe_one_groups_fault(InvalidArgument("reward service: a bad group"))
