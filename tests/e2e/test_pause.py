"""Pausing and resuming a run in each mode through the REST API (every service real, on
loopback): a paused run comes to rest at a step boundary, where it neither generates nor
trains; resumed, it completes and has trained every step on a full batch, each group once
(nothing that was in flight when it paused is lost)."""

from __future__ import annotations

import time

import pytest

from rlmesh.v1 import buffer_pb2
from tests.e2e.test_runs import run_config, services  # noqa: F401 - the fixture
from tests.helpers.stack import wait_for_run

ROLLOUTS = 8


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "one_step_off", "fully_async"])
def test_a_paused_run_rests_and_resumed_loses_nothing(services, tmp_path, tiny_model_dir, mode):  # noqa: F811
    api, buffer = services
    config = {**run_config(tmp_path, tiny_model_dir, num_rollouts=ROLLOUTS), "mode": mode}
    config["rollout"]["partial_rollout"] = mode == "fully_async"
    run_id = api.post("/runs", json=config).json()["id"]
    wait_for_run(api, run_id, lambda run: run["rollout_id"] >= 2)
    assert api.post(f"/runs/{run_id}/pause").json()["status"] == "paused"
    run = wait_for_run(api, run_id, lambda run: run["held"], timeout=120)
    assert run["status"] == "paused" and run["rollout_id"] < ROLLOUTS

    def progress():
        s = buffer.GetStats(buffer_pb2.GetStatsRequest(run_id=run_id))
        return api.get(f"/runs/{run_id}").json()["rollout_id"], s.prompts_handed_out, s.groups_written, \
            s.acknowledged_groups, s.leased_groups

    at_rest = progress()
    assert at_rest[4] == 0  # no batch leased: training rests
    time.sleep(2)
    assert progress() == at_rest  # no generation (fully_async's loop is stopped too), no training

    assert api.post(f"/runs/{run_id}/resume").json()["status"] == "running"
    run = wait_for_run(api, run_id)
    assert run["status"] == "completed", run["error"]
    assert not run["held"]
    rl = [m for m in run["metrics"] if "iteration/seconds" in m]
    assert [m["rollout_id"] for m in rl] == list(range(1, ROLLOUTS + 1))
    assert all(m["train/samples"] == 6 for m in rl)  # a full batch every step
    s = buffer.GetStats(buffer_pb2.GetStatsRequest(run_id=run_id))
    assert s.leased_groups == 0 and s.redelivered_groups == 0
    assert s.acknowledged_groups == 2 + ROLLOUTS * 2  # the SFT batch and every RL batch, each group once
