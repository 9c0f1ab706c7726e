"""The engines paused around the moment a push moves the weights, when the caller asks
(fully_async: the engines generate between pushes).

The pusher pauses them itself, at the same time as it asks which engines it pushes to
(its ListEngines), so that no coordinator -> trainer hop and no wait for that answer comes
between the pause and the weights, and lets them continue as soon as every engine has
answered the last bucket, one hop before the coordinator could. A push that fails leaves
them paused: they may hold part of the new weights, so they generate again only once the
caller has pushed again or given up (it then lets them continue itself)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import grpc

from rlmesh.common import errors
from rlmesh.common.run_config import PAUSE_MODES
from rlmesh.v1 import rollout_pb2
from rlmesh.v1.rollout_pb2_grpc import RolloutStub

log = logging.getLogger(__name__)

# A pause or continue is one call to each engine: far shorter than a push's own deadline.
CALL_DEADLINE_SECONDS = 30.0


def check_pause_mode(mode: str) -> None:
    if mode and mode not in PAUSE_MODES:
        raise errors.InvalidArgument(f"pause_mode must be one of {', '.join(PAUSE_MODES)} (or empty), got {mode!r}")


class EnginePause:
    """begin() before the weights move, end() once every engine holds them (not after a
    failure). `mode` "" pauses nothing. `continued`: the engines were paused here and
    generate again."""

    def __init__(self, stub: RolloutStub, mode: str, call: Callable[[str, Awaitable], Awaitable]) -> None:
        check_pause_mode(mode)
        self.stub = stub
        self.mode = mode
        self.call = call  # the pusher's: names the rollout service in its errors
        self.continued = False

    async def begin(self) -> None:
        if self.mode:
            request = rollout_pb2.PauseGenerationRequest(mode=self.mode)
            await self.call("PauseGeneration", self.stub.PauseGeneration(request, timeout=CALL_DEADLINE_SECONDS))

    async def end(self) -> None:
        if not self.mode:
            return
        try:
            await self.stub.ContinueGeneration(rollout_pb2.ContinueGenerationRequest(), timeout=CALL_DEADLINE_SECONDS)
            self.continued = True
        except grpc.aio.AioRpcError as e:  # the push itself succeeded: the caller continues them
            log.warning("weights pushed, but the engines could not be let continue: %s", e.details())
