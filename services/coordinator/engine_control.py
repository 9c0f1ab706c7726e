"""A run's hold on the engines' state, through the rollout service: their pause (a push with
a pause mode, or one cut short, leaves them paused: a paused engine holds every new request)
and, in colocated runs, their memory (released for training, resumed to generate)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import grpc

from rlmesh.v1 import rollout_pb2, rollout_pb2_grpc

log = logging.getLogger(__name__)


class EngineControl:
    def __init__(
        self,
        rollout: rollout_pb2_grpc.RolloutStub,
        run_id: str,
        deadline_seconds: float,
        patiently: Callable[[Callable[[], Awaitable]], Awaitable],
    ) -> None:
        self.rollout, self.run_id, self.deadline = rollout, run_id, deadline_seconds
        self.patiently = patiently  # (a rollout call retried through the service's outage)

    async def memory_occupation(self, resume: bool, tags: list[str] | None = None) -> None:
        """Colocated runs: every engine releases (or resumes) the tagged memory (none: all)."""
        request = rollout_pb2.MemoryOccupationRequest(tags=tags or [])
        call = self.rollout.ResumeMemoryOccupation if resume else self.rollout.ReleaseMemoryOccupation
        await self.patiently(lambda: call(request, timeout=self.deadline))

    async def wake(self) -> None:
        """Best effort, one call each: engines that a run left paused (a weight push cut short:
        its coordinator died, or the run was stopped mid-way) or asleep (a colocated run failed,
        or its coordinator died) generate nothing until continued and resumed, whatever run
        comes next. An engine without the memory routes (SGLang without
        --enable-memory-saver) only costs a warning."""
        await self.let_continue()
        await self.resume()

    async def resume(self) -> None:
        """Best effort, one call: every engine's memory resumed (none is released but in a
        colocated run's training)."""
        await self._best_effort(
            "resume the engines' memory",
            lambda: self.rollout.ResumeMemoryOccupation(rollout_pb2.MemoryOccupationRequest(), timeout=self.deadline),
        )

    async def let_continue(self, patiently: bool = False) -> None:
        """Paused engines generate again: after a push, patiently (through a rollout outage);
        else best effort, one call (engines a push cut short left paused)."""

        def call():
            return self.rollout.ContinueGeneration(rollout_pb2.ContinueGenerationRequest(), timeout=self.deadline)

        if patiently:
            await self.patiently(call)
        else:
            await self._best_effort("let the engines continue", call)

    async def _best_effort(self, what: str, call: Callable[[], Awaitable]) -> None:
        try:
            await call()
        except grpc.aio.AioRpcError as e:
            log.warning("run %s: could not %s: %s", self.run_id, what, e.details())
