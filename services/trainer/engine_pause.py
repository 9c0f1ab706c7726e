"""The engines paused around the moment a push moves the weights, when the caller asks
(fully_async: the engines generate between pushes).

The pusher pauses them itself, at the same time as it asks which engines it pushes to
(its ListEngines), so that no coordinator -> trainer hop and no wait for that answer comes
between the pause and the weights, and lets them continue as soon as every engine has
answered the last bucket, one hop before the coordinator could. A push that fails leaves
them paused: they may hold part of the new weights, so they generate again only once the
caller has pushed again or given up (it then lets them continue itself).

The first calls of a push (which engines, pause them) are safe to repeat: `when_reachable`
tries them again while the rollout service is unreachable, so a push waits a little for one
that is (re)starting rather than failing at once."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import grpc

from rlmesh.common import errors
from rlmesh.common.grpc_server import answered_by_service
from rlmesh.common.retry import retry, transient_grpc_error
from rlmesh.common.run_config import PAUSE_MODES
from rlmesh.v1 import rollout_pb2
from rlmesh.v1.rollout_pb2_grpc import RolloutStub

log = logging.getLogger(__name__)

# A pause or continue is one call to each engine: far shorter than a push's own deadline.
CALL_DEADLINE_SECONDS = 30.0
# How long the first calls of a push wait for an unreachable rollout service (then the push
# fails, and the coordinator tries it again).
UNREACHABLE_WAIT_SECONDS = 30.0


def _unreachable(e: BaseException) -> str | None:
    """Why to try again: the rollout service is not (yet) reachable. Not its own UNAVAILABLE
    (its engines are down: that answer is the push's), nor a deadline (a service that
    answered nothing for a whole call's deadline is not waited for that long again)."""
    if isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.UNAVAILABLE and not answered_by_service(e):
        return transient_grpc_error(e)
    return None


async def _log_wait(reason: str) -> None:
    log.warning("weight push %s", reason)


def when_reachable(what: str, address: str, make_call: Callable[[], Awaitable], budget_seconds: float) -> Awaitable:
    """make_call() (a call safe to repeat), again with backoff while the rollout service at
    `address` is unreachable, for up to budget_seconds; then OutageTooLong."""
    return retry(
        make_call,
        service=f"rollout service ({what}) at {address}",
        budget_seconds=budget_seconds,
        transient=_unreachable,
        on_wait=_log_wait,
    )


def check_pause_mode(mode: str) -> None:
    if mode and mode not in PAUSE_MODES:
        raise errors.InvalidArgument(f"pause_mode must be one of {', '.join(PAUSE_MODES)} (or empty), got {mode!r}")


class EnginePause:
    """begin() before the weights move, end() once every engine holds them (not after a
    failure). `mode` "" pauses nothing. `continued`: the engines were paused here and
    generate again."""

    def __init__(
        self, stub: RolloutStub, mode: str, reach: Callable[[str, Callable[[], Awaitable]], Awaitable]
    ) -> None:
        check_pause_mode(mode)
        self.stub = stub
        self.mode = mode
        self.reach = reach  # the pusher's when_reachable: names the rollout service in its errors
        self.continued = False

    async def begin(self) -> None:
        if self.mode:
            request = rollout_pb2.PauseGenerationRequest(mode=self.mode)
            await self.reach(
                "PauseGeneration", lambda: self.stub.PauseGeneration(request, timeout=CALL_DEADLINE_SECONDS)
            )

    async def end(self) -> None:
        if not self.mode:
            return
        try:
            await self.stub.ContinueGeneration(rollout_pb2.ContinueGenerationRequest(), timeout=CALL_DEADLINE_SECONDS)
            self.continued = True
        except grpc.aio.AioRpcError as e:  # the push itself succeeded: the caller continues them
            log.warning("weights pushed, but the engines could not be let continue: %s", e.details())
