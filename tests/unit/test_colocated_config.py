"""A colocated run's config (weight_sync.method "colocated"): sync and one_step_off are
accepted, fully_async is refused naming why, and a queue cap too small for one_step_off's two
queued batches is refused; the coordinator drives such a run with the colocated mode."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rlmesh.common.run_config import RunConfig
from rlmesh.coordinator.colocation import ColocatedMode, mode_class
from rlmesh.coordinator.modes import OneStepOffMode, SyncMode


def _config(**fields) -> RunConfig:
    base = {
        "model_path": "m",
        "datasets": [{"name": "d", "path": "p"}],
        "rollout": {"rollout_batch_size": 4},
        "weight_sync": {"method": "colocated"},
    }
    return RunConfig.model_validate({**base, **fields})


def test_colocated_runs_take_sync_and_one_step_off_and_refuse_fully_async():
    assert mode_class(_config(mode="sync")) is ColocatedMode
    assert mode_class(_config(mode="one_step_off")) is ColocatedMode
    with pytest.raises(ValidationError, match="fully_async the engines generate while the trainer trains"):
        _config(mode="fully_async")
    plain = RunConfig.model_validate({"model_path": "m", "datasets": [{"name": "d", "path": "p"}]})
    assert mode_class(plain) is SyncMode
    assert mode_class(plain.model_copy(update={"mode": "one_step_off"})) is OneStepOffMode


def test_one_step_off_colocated_needs_room_for_two_batches():
    with pytest.raises(ValidationError, match="at least 2 x rollout_batch_size"):
        _config(mode="one_step_off", max_queued_groups=4)
    assert _config(mode="one_step_off", max_queued_groups=8).max_queued_groups == 8
    assert _config(mode="sync", max_queued_groups=4).max_queued_groups == 4
