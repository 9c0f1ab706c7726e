"""Pausing and resuming a run in each mode through the REST API (every service real, on
loopback): a paused run comes to rest at a step boundary, where it neither generates nor
trains; resumed, it completes and has trained every step on a full batch, each group once
(nothing that was in flight when it paused is lost)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import redis

from rlmesh.cli.demo import run_metrics
from rlmesh.common.auth import client_headers
from rlmesh.coordinator.app import API_TASK
from rlmesh.coordinator.app import start as start_coordinator
from rlmesh.coordinator.config import Settings as CoordinatorSettings
from rlmesh.v1 import buffer_pb2
from tests.helpers.runs import run_config
from tests.helpers.stack import start_local_stack, wait_for_run

ROLLOUTS = 8


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "one_step_off", "fully_async"])
def test_a_paused_run_rests_and_resumed_loses_nothing(services, tmp_path, tiny_model_dir, mode):
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
        return (
            api.get(f"/runs/{run_id}").json()["rollout_id"],
            s.prompts_handed_out,
            s.groups_written,
            s.acknowledged_groups,
            s.leased_groups,
        )

    at_rest = progress()
    assert at_rest[4] == 0  # no batch leased: training rests
    time.sleep(2)
    assert progress() == at_rest  # no generation (fully_async's loop is stopped too), no training

    assert api.post(f"/runs/{run_id}/resume").json()["status"] == "running"
    run = wait_for_run(api, run_id)
    assert run["status"] == "completed", run["error"]
    assert not run["held"]
    rl = [m for m in run_metrics(api, run["id"]) if "iteration/seconds" in m]
    assert [m["rollout_id"] for m in rl] == list(range(1, ROLLOUTS + 1))
    assert all(m["train/samples"] == 6 for m in rl)  # a full batch every step
    s = buffer.GetStats(buffer_pb2.GetStatsRequest(run_id=run_id))
    assert s.leased_groups == 0 and s.redelivered_groups == 0
    assert s.acknowledged_groups == 2 + ROLLOUTS * 2  # the SFT batch and every RL batch, each group once


async def _stop_coordinator(server) -> None:
    """Shut the coordinator down as SIGTERM would: its run loop is cancelled, the run stays
    active in Redis."""
    serving = next(t for t in asyncio.all_tasks() if t.get_name() == API_TASK)
    server.should_exit = True
    await serving


@pytest.mark.slow
def test_a_paused_run_stays_paused_across_a_coordinator_restart(
    redis_url, start_in_loop, loop_thread, engine_url, tmp_path, tiny_model_dir
):
    stack = start_local_stack(start_in_loop, redis_url, engine_url, tmp_path)
    api = stack.api
    run_id = api.post("/runs", json=run_config(tmp_path, tiny_model_dir, num_rollouts=ROLLOUTS)).json()["id"]
    wait_for_run(api, run_id, lambda run: run["rollout_id"] >= 2)
    api.post(f"/runs/{run_id}/pause")
    rollouts = wait_for_run(api, run_id, lambda run: run["held"])["rollout_id"]

    loop_thread.run(_stop_coordinator(stack.servers["coordinator"]), timeout=60)
    a = stack.addresses
    _, port = start_in_loop(
        lambda: start_coordinator(
            CoordinatorSettings(
                port=0,
                redis_url=redis_url,
                buffer_address=a["buffer"],
                rollout_address=a["rollout"],
                reward_address=a["reward"],
                trainer_address=a["trainer"],
            )
        )
    )
    api = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30, headers=client_headers())
    run = wait_for_run(api, run_id, lambda run: run["held"])  # the new coordinator's loop rests too
    time.sleep(2)
    run = api.get(f"/runs/{run_id}").json()
    assert (run["status"], run["held"], run["rollout_id"]) == ("paused", True, rollouts)

    api.post(f"/runs/{run_id}/resume")
    run = wait_for_run(api, run_id)
    assert run["status"] == "completed", run["error"]
    rl = [m for m in run_metrics(api, run["id"]) if "iteration/seconds" in m]
    assert [m["rollout_id"] for m in rl] == list(range(1, ROLLOUTS + 1))


@pytest.mark.slow
def test_a_fully_async_run_stopped_while_its_coordinator_is_down_leaves_no_generation_behind(
    redis_url, start_in_loop, loop_thread, engine_url, tmp_path, tiny_model_dir
):
    stack = start_local_stack(start_in_loop, redis_url, engine_url, tmp_path)
    config = {**run_config(tmp_path, tiny_model_dir, num_rollouts=ROLLOUTS), "mode": "fully_async"}
    run_id = stack.api.post("/runs", json=config).json()["id"]
    wait_for_run(stack.api, run_id, lambda run: run["rollout_id"] >= 1)
    # The coordinator goes down with the rollout service's generation loop running, in the
    # middle of a weight push (the engines stay paused: a paused engine holds every new
    # request); the stop comes meanwhile (as another coordinator replica would write it).
    loop_thread.run(_stop_coordinator(stack.servers["coordinator"]), timeout=60)
    _pause(engine_url)
    redis.Redis.from_url(redis_url).hset(f"rlmesh:coord:run:{run_id}", "status", "stopping")
    a = stack.addresses
    _, port = start_in_loop(
        lambda: start_coordinator(
            CoordinatorSettings(
                port=0,
                redis_url=redis_url,
                buffer_address=a["buffer"],
                rollout_address=a["rollout"],
                reward_address=a["reward"],
                trainer_address=a["trainer"],
            )
        )
    )
    api = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30, headers=client_headers())
    assert wait_for_run(api, run_id)["status"] == "stopped"
    # The next fully_async run gets the rollout service's generation to itself, and engines
    # left paused (by a push cut short in any run) generate for it.
    _pause(engine_url)
    next_id = api.post("/runs", json={**config, "num_rollouts": 2}).json()["id"]
    run = wait_for_run(api, next_id)
    assert run["status"] == "completed", run["error"]


def _pause(engine_url: str) -> None:
    """The engine paused, as a weight push cut short leaves it."""
    paused = httpx.post(
        f"{engine_url}/pause_generation", json={"mode": "in_place"}, headers=client_headers(), timeout=30
    )
    paused.raise_for_status()
