"""The trainer's checkpoints: saved on request (SaveCheckpoint) or when due after a step
(written in the background, then the step's acknowledgments made final), the final model
at a run's end, and the list of a run's checkpoints. A part of Trainer (trainer.py), kept
apart by its section."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path

from rlmesh.common import errors
from rlmesh.trainer.buffer_client import BufferClient
from rlmesh.trainer.checkpoints import (
    CHECKPOINT,
    CheckpointInfo,
    checkpoint_extra,
    commit_checkpoint,
    list_checkpoints,
    write_in_background,
)
from rlmesh.trainer.final_model import FINAL_MODEL_DIR, final_model_entry, final_model_info, write_final_model
from rlmesh.trainer.run_paths import RunPaths
from rlmesh.trainer.run_state import Run

log = logging.getLogger(__name__)


class TrainerCheckpoints:
    """Trainer's checkpoint methods; Trainer provides what is declared here."""

    clock: Callable[[], float]  # of checkpoint_interval_seconds
    paths: RunPaths
    _buffer: BufferClient

    def _get(self, run_id: str) -> Run: ...

    def _holding(self, run: Run) -> AbstractAsyncContextManager[None]: ...

    async def save_checkpoint(self, run_id: str, path: str = "") -> Path:
        """Save to `path`, or by default <checkpoint_dir or <run>/checkpoints>/step_<n>, all
        under work_dir (relative paths are taken under it). What is there already is
        replaced only if it is a checkpoint this trainer wrote."""
        run = self._get(run_id)
        async with self._holding(run):
            target = self.paths.checkpoint_dir(run.run_id, run.config) / f"step_{run.backend.step}"
            if path:
                target = self.paths.under_work_dir(path, "path")
            await run.saved()  # one writer at a time, were it the same directory
            try:
                snapshot = await asyncio.to_thread(run.backend.snapshot)
                await asyncio.to_thread(run.trained.flush)
                extra = checkpoint_extra(run.run_id, run.weight_version, run.trained.state(target))
                written = await asyncio.to_thread(commit_checkpoint, snapshot, target, extra)
            except OSError as e:
                raise errors.FailedPrecondition(
                    f"cannot write checkpoint {target.name!r}: {errors.unexpected(e)}"
                ) from None
            resumable = written.parent == self.paths.checkpoint_dir(run.run_id, run.config) and CHECKPOINT.fullmatch(
                written.name
            )
            if run.acks_wait_for_checkpoints and resumable:
                await self._buffer.commit_acks(run, run.backend.step)  # a restart would resume from it
            return written

    async def _checkpoint_if_due(self, run: Run) -> None:
        """After a step, holding the lock: when the step count reached the next multiple of
        checkpoint_interval, copy the state to CPU memory now and write it in the
        background. A step never fails for a checkpoint: a failure is logged."""
        interval, step = run.config.checkpoint_interval, run.backend.step
        by_steps = interval and step // interval > run.last_checkpoint_step // interval
        seconds = run.config.checkpoint_interval_seconds
        by_time = seconds and step > run.last_checkpoint_step and self.clock() - run.last_checkpoint_time >= seconds
        if by_steps or by_time:
            await self._checkpoint(run)

    async def _checkpoint(self, run: Run) -> None:
        """An automatic checkpoint of the current step: the state copied to CPU memory now,
        written (and then the step's acknowledgments made final) in the background."""
        step = run.backend.step
        if run.saving is not None and not run.saving.done():
            # At most one save in flight. Waiting (not skipping) keeps checkpoints where the
            # interval puts them; training only waits when the disk is slower than
            # `interval` steps, and then the interval is too short.
            log.warning("run %s: checkpoint at step %d waits for the previous one to be written", run.run_id, step)
            await run.saved()
        try:
            snapshot = await asyncio.to_thread(run.backend.snapshot)
            await asyncio.to_thread(run.trained.flush)  # (synced before the checkpoint is marked complete)
        except Exception:
            log.exception("run %s: no checkpoint at step %d: copying the state failed", run.run_id, step)
            return
        target = self.paths.checkpoint_dir(run.run_id, run.config) / f"step-{step:06d}"
        run.last_checkpoint_step, run.last_checkpoint_time = step, self.clock()

        async def written() -> None:
            run.written_step = max(run.written_step, step)
            await self._buffer.commit_acks(run, step)

        run.saving = asyncio.create_task(
            write_in_background(
                run.run_id,
                snapshot,
                target,
                checkpoint_extra(run.run_id, run.weight_version, run.trained.state(target)),
                run.config.keep_last,
                on_written=written,
            )
        )

    async def _write_final_model(self, run: Run) -> tuple[str, str]:
        """The run's final policy as a model directory <checkpoint_dir>/final; its path
        relative to work_dir (what a person names it by; the server's own directories stay
        its own), or "" and why it was not written."""
        target = self.paths.checkpoint_dir(run.run_id, run.config) / FINAL_MODEL_DIR
        info = final_model_info(run.run_id, run.backend.step, run.weight_version)
        try:
            await asyncio.to_thread(write_final_model, run.backend, target, info)
        except errors.FailedPrecondition as e:  # another run's there: no retry would change that
            log.error("run %s: no final model: %s", run.run_id, e)
            return "", str(e)
        except (OSError, errors.RlmeshError) as e:
            log.error("run %s: the final model could not be written to %s: %s", run.run_id, target, e)
            raise errors.FailedPrecondition(
                f"run {run.run_id!r}: its final model could not be written under checkpoint_dir (the trainer's log "
                "says why); the run stays set up: EndRun again to retry"
            ) from None
        log.info("run %s: final model at %s (the trainer at step %d)", run.run_id, target, run.backend.step)
        return self.paths.relative_to_work_dir(target), ""

    async def list_checkpoints(self, run_id: str, checkpoint_dir: str = "") -> list[CheckpointInfo]:
        """The complete checkpoints of `run_id` in its checkpoint directory (the run config's
        checkpoint_dir, "" = the default), oldest step first; the run need not be set up here."""
        directory = self.paths.checkpoints_at(run_id, checkpoint_dir)
        found = await asyncio.to_thread(list_checkpoints, directory, run_id)
        final = await asyncio.to_thread(final_model_entry, directory, run_id)
        return [*found, final] if final is not None else found
