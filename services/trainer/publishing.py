"""A run's weights on their way to the engines, by one of three methods: a broadcast over a
weight group (weight_sync.py), a directory the engines reload (disk), or a file in shared
memory the engines map on the same machine (colocated.py). Each pusher is made on first use
and kept with the run."""

from __future__ import annotations

import torch

from rlmesh.common import weight_file
from rlmesh.trainer.colocated import ColocatedPusher
from rlmesh.trainer.config import Settings
from rlmesh.trainer.run_state import Run
from rlmesh.trainer.weight_sync import PushResult, WeightPusher

PUBLISH_METHODS = ("distributed", "disk", "colocated")


async def push_weights(run: Run, settings: Settings, version: int, method: str, pause_mode: str = "") -> PushResult:
    """Push the run's current weights as `version` by `method` (one of PUBLISH_METHODS), the
    engines paused meanwhile in `pause_mode` ("": not paused); the caller holds the model."""
    wire_dtype = getattr(torch, settings.weight_sync_dtype) if settings.weight_sync_dtype else None
    if method == "colocated":
        if run.colocated is None:
            run.colocated = ColocatedPusher(
                settings.rollout_address,
                run.run_id,
                settings.weight_file_dir or weight_file.default_dir(),
                settings.weight_sync_timeout_seconds,
            )
        return await run.colocated.push(
            list(run.backend.state_dict_for_sync()),
            version,
            wire_dtype,
            run.config.weight_sync.bucket_bytes,
            pause_mode,
        )
    if run.pusher is None:
        run.pusher = WeightPusher(
            settings.rollout_address,
            run.run_id,
            settings.weight_sync_master_address,
            settings.weight_sync_timeout_seconds,
            settings.weight_sync_bind_address,
        )
    if method == "distributed":
        return await run.pusher.push_distributed(
            list(run.backend.state_dict_for_sync()), version, run.config.weight_sync, wire_dtype, pause_mode
        )
    directory = settings.work_dir / run.run_id / "weights"
    return await run.pusher.push_from_disk(run.backend.save_weights, directory, version, pause_mode)
