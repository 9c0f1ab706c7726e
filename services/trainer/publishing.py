"""A run's weights on their way to the engines, by one of three methods: a broadcast over a
weight group (weight_sync.py), a directory the engines reload (disk), or a file in shared
memory the engines map on the same machine (colocated.py). Each pusher is made on first use
and kept with the run."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import torch

from rlmesh.common import errors, weight_file
from rlmesh.common.faults import fault_point
from rlmesh.trainer.colocated import ColocatedPusher, discard_weight_files
from rlmesh.trainer.config import Settings
from rlmesh.trainer.engine_pause import check_pause_mode
from rlmesh.trainer.run_state import Run
from rlmesh.trainer.weight_sync import PushResult, WeightPusher

PUBLISH_METHODS = ("distributed", "disk", "colocated")

log = logging.getLogger(__name__)


def publish_method(run: Run, method: str, version: int, pause_mode: str, background: bool) -> str:
    """The method a push of the run's weights asks for ("": the run config's), its request checked."""
    method = method or run.config.weight_sync.method
    if method not in PUBLISH_METHODS:
        raise errors.InvalidArgument(f"method must be one of {', '.join(PUBLISH_METHODS)} (or empty), got {method!r}")
    if background and method != "distributed":
        raise errors.InvalidArgument(f"background pushes need method 'distributed', not {method!r}")
    if version < 0:
        raise errors.InvalidArgument(f"version must not be negative, got {version}")
    check_pause_mode(pause_mode)
    return method


def log_failed_push(run_id: str, version: int, push: asyncio.Future) -> None:
    """A push's failure said in the trainer's log (its caller may have gone away)."""
    if not push.cancelled() and push.exception() is not None:
        log.warning("run %s: the push of weights v%d failed: %s", run_id, version, push.exception())


async def push_weights(run: Run, settings: Settings, version: int, method: str, pause_mode: str = "") -> PushResult:
    """Push the run's current weights as `version` by `method` (one of PUBLISH_METHODS), the
    engines paused meanwhile in `pause_mode` ("": not paused); the caller holds the model."""
    wire_dtype = _wire_dtype(settings)
    if method == "colocated":
        if run.colocated is None:
            run.colocated = ColocatedPusher(
                settings.rollout_address, run.run_id, weight_file_dir(settings), settings.weight_sync_timeout_seconds
            )
        return await run.colocated.push(
            list(run.backend.state_dict_for_sync()),
            version,
            wire_dtype,
            run.config.weight_sync.bucket_bytes,
            pause_mode,
        )
    pusher = _pusher(run, settings)
    if method == "distributed":
        return await pusher.push_distributed(
            list(run.backend.state_dict_for_sync()), version, run.config.weight_sync, wire_dtype, pause_mode
        )
    directory = settings.work_dir / run.run_id / "weights"
    return await pusher.push_from_disk(run.backend.save_weights, directory, version, pause_mode)


def start_background_push(run: Run, settings: Settings, version: int, pause_mode: str = "") -> PushResult:
    """The run's current weights copied (on their device, in the wire dtype) and pushed from the
    copy as `version` by a task kept in run.background_push, while the caller goes on training;
    the caller holds the model and has waited for the run's previous background push. The
    result says how long the copy took."""
    start = time.monotonic()
    wire_dtype = _wire_dtype(settings)
    copy = [(name, t.to(wire_dtype or t.dtype, copy=True)) for name, t in run.backend.state_dict_for_sync()]
    pusher = _pusher(run, settings)

    async def push() -> PushResult:
        try:
            await fault_point("trainer.background_push")  # (the weights copied, nothing sent yet)
            result = await pusher.push_distributed(copy, version, run.config.weight_sync, None, pause_mode)
        except Exception as e:
            log.warning("run %s: the background push of weights v%d failed: %s", run.run_id, version, e)
            raise errors.Aborted(f"the background push of weights v{version} failed (push again): {e}") from None
        result.version = version
        log.info(
            "run %s: weights v%d pushed in the background (%d bytes, %d buckets, %.2f s)",
            run.run_id,
            version,
            result.bytes,
            result.buckets,
            result.seconds,
        )
        return result

    task = asyncio.create_task(push(), name=f"push-{run.run_id}-v{version}")
    task.add_done_callback(lambda t: t.cancelled() or t.exception())  # (its failure is WaitForPush's to report)
    run.background_push = (version, task)
    return PushResult(seconds=time.monotonic() - start, bytes=0, buckets=0, version=version)


def weight_file_dir(settings: Settings) -> Path:
    return settings.weight_file_dir or weight_file.default_dir()


def discard_lost_weight_files(settings: Settings, run_id: str) -> None:
    """The colocated weight files of a run this trainer does not hold removed: a trainer that
    died with the run left them, in shared memory (the run's own pusher removes them at its end)."""
    discard_weight_files(weight_file_dir(settings), run_id)


def _wire_dtype(settings: Settings) -> torch.dtype | None:
    return getattr(torch, settings.weight_sync_dtype) if settings.weight_sync_dtype else None


def _pusher(run: Run, settings: Settings) -> WeightPusher:
    if run.pusher is None:
        run.pusher = WeightPusher(
            settings.rollout_address,
            run.run_id,
            settings.weight_sync_master_address,
            settings.weight_sync_timeout_seconds,
            settings.weight_sync_bind_address,
        )
    return run.pusher
