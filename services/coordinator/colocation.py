"""Colocated runs (weight_sync.method "colocated"): the engines and the trainer share the
accelerators, so generation and training take turns on them. Each iteration:

    resume (all) -> generate -> release (all) -> train -> resume weights -> update in place -> resume (all)

The first resume is idempotent and wakes engines a failed iteration (or a coordinator that
died mid-step) left released. The update is the trainer's colocated push (shared memory on
CPU, CUDA IPC for SGLang), which the run's `_publish_once` precedes with the weights' resume.

sync: the batch is generated and trained in turn (staleness 0). one_step_off keeps its
staleness of exactly one version without overlap (the accelerators cannot do both at once):
each iteration first generates the next batch with the current weights, so two are queued,
then trains the older one. fully_async cannot be colocated (the run config refuses it)."""

from __future__ import annotations

import time

from rlmesh.common.run_config import RunConfig
from rlmesh.coordinator.modes import MODES, EnvironmentsMode, RunMode, iteration_record, publish_and_buffer_metrics


class ColocatedMode(RunMode):
    async def iteration(self, rollout_id: int) -> dict:
        calls, cfg = self.calls, self.calls.cfg
        t0 = time.monotonic()
        await self.wake()
        # one_step_off: the next batch too (generated on these weights, trained one version later)
        batches = 2 if cfg.mode == "one_step_off" and rollout_id + 1 < cfg.num_rollouts else 1
        generation, generate_seconds = await calls.generate_batch(batches)
        await self.release()
        try:
            # (a trainer set up again mid-step has the run's weights pushed, which resumes them)
            t, train_seconds = await calls.train_batch(self.on_no_batch, before_retry=self.release)
        except BaseException:
            await self._wake_after_failure()
            raise
        t1 = time.monotonic()
        # (resumes the weights first; the buffer's figures are read meanwhile)
        w, buffer = await publish_and_buffer_metrics(calls)
        await self.wake()
        phases = {"generate": generate_seconds, "train": train_seconds, "update": time.monotonic() - t1}
        return {**iteration_record(rollout_id, generation, t, w, phases, t0, phases), **buffer}

    async def wake(self) -> None:
        await self.calls.engines.memory_occupation(resume=True)

    async def release(self) -> None:
        await self.calls.engines.memory_occupation(resume=False)

    async def _wake_after_failure(self) -> None:
        """The engines should not stay asleep because a step failed or the run ended (the next
        iteration, or the next run's setup, wakes them anyway)."""
        await self.calls.engines.wake()

    async def on_no_batch(self) -> str:
        """Generating what is missing needs the engines awake; they sleep again for training."""
        await self.wake()
        try:
            return await super().on_no_batch()
        finally:
            await self.release()

    async def settle(self, keep_metrics: bool = False) -> None:
        await self.wake()

    async def close(self) -> None:
        await self._wake_after_failure()


def mode_class(cfg: RunConfig) -> type[RunMode]:
    """The RunMode that drives a run of this config."""
    if cfg.source == "environments":
        return EnvironmentsMode
    return ColocatedMode if cfg.weight_sync.method == "colocated" else MODES[cfg.mode]
