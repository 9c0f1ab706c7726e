"""A background loop is stopped for sure, even when its cancellation is lost the way grpc.aio
loses it: the call it awaits catches the cancellation and returns its answer."""

from __future__ import annotations

import asyncio

from rlmesh.common.tasks import cancel_and_wait


async def call(answer_through_a_cancel: list[bool]) -> str:
    """A call that takes a while. Cancelled as its answer comes back (once, the first time:
    `answer_through_a_cancel`), it returns the answer: its inner task catches the
    cancellation and returns, so the caller gets the answer, not CancelledError."""

    async def inner() -> str:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            if not answer_through_a_cancel:
                raise
            answer_through_a_cancel.pop()
        return "answer"

    return await asyncio.ensure_future(inner())


async def heartbeat(answers: list[str], answer_through_a_cancel: list[bool]) -> None:
    while True:
        answers.append(await call(answer_through_a_cancel))
        await asyncio.sleep(0.001)


def test_a_loop_whose_cancellation_was_lost_is_still_stopped():
    async def main():
        answers: list[str] = []
        beat = asyncio.ensure_future(heartbeat(answers, [True]))
        await asyncio.sleep(0.05)  # (inside its call)
        beat.cancel()
        await asyncio.wait({beat}, timeout=0.5)
        assert not beat.done() and answers == ["answer"]  # cancelled once, it went on
        await asyncio.wait_for(cancel_and_wait(beat, recancel_seconds=0.1), timeout=10)
        assert beat.cancelled()

    asyncio.run(main())


def test_a_task_that_ended_or_fails_is_waited_for_once():
    async def main():
        async def fails():
            raise RuntimeError("down")

        failed = asyncio.ensure_future(fails())
        await asyncio.sleep(0)
        await cancel_and_wait(failed)  # (its error is retrieved, not raised)
        assert isinstance(failed.exception(), RuntimeError)
        slow = asyncio.ensure_future(asyncio.sleep(30))
        await cancel_and_wait(slow)
        assert slow.cancelled()

    asyncio.run(main())
