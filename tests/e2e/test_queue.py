"""The run queue on a real stack (every service on loopback, the engine in its own process):
runs posted while one trains wait their turn and each trains in full after the one before
it has ended, in the queue's order after a move; a deleted queued run never starts; the
queue carries on across a coordinator restart."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from rlmesh.cli.demo import run_metrics
from rlmesh.common.auth import client_headers
from rlmesh.coordinator.app import API_TASK
from rlmesh.coordinator.app import start as start_coordinator
from rlmesh.coordinator.config import Settings as CoordinatorSettings
from tests.helpers.runs import run_config
from tests.helpers.stack import start_local_stack, wait_for_run


def span(api: httpx.Client, run_id: str) -> tuple[float, float]:
    """When the run's first and last metric records were written."""
    times = [m["time"] for m in run_metrics(api, run_id)]
    return min(times), max(times)


@pytest.mark.slow
def test_queued_runs_start_in_order_after_the_active_one(services, tmp_path, tiny_model_dir):
    api, _ = services
    active = api.post("/runs", json=run_config(tmp_path, tiny_model_dir, num_rollouts=2)).json()["id"]
    b, c, d = (api.post("/runs", json=run_config(tmp_path, tiny_model_dir, num_rollouts=1)).json() for _ in range(3))
    assert [(r["status"], r["queue_position"]) for r in (b, c, d)] == [("queued", 1), ("queued", 2), ("queued", 3)]
    assert api.post(f"/runs/{c['id']}/queue-position", json={"position": 1}).json()["queue_position"] == 1
    assert api.delete(f"/runs/{d['id']}").json()["deleted"] is True

    runs = [wait_for_run(api, run_id) for run_id in (active, c["id"], b["id"])]
    assert [r["status"] for r in runs] == ["completed"] * 3, [r["error"] for r in runs]
    assert [r["rollout_id"] for r in runs] == [2, 1, 1]
    # one after the other, in the queue's order: each began after the one before had ended
    spans = [span(api, r["id"]) for r in runs]
    assert spans[0][1] < spans[1][0] and spans[1][1] < spans[2][0]
    assert api.get(f"/runs/{d['id']}").status_code == 404
    assert {r["id"] for r in api.get("/runs").json()} == {active, b["id"], c["id"]}


async def _stop_coordinator(server) -> None:
    """Shut the coordinator down as SIGTERM would: its runs stay in Redis as they are."""
    serving = next(t for t in asyncio.all_tasks() if t.get_name() == API_TASK)
    server.should_exit = True
    await serving


@pytest.mark.slow
def test_the_queue_carries_on_across_a_coordinator_restart(
    redis_url, start_in_loop, loop_thread, engine_url, tmp_path, tiny_model_dir
):
    stack = start_local_stack(start_in_loop, redis_url, engine_url, tmp_path)
    # Long enough that the active run cannot end while the coordinator shuts down (it drives
    # the run until its lifespan ends), which would start the queued one.
    active = stack.api.post("/runs", json=run_config(tmp_path, tiny_model_dir, num_rollouts=20)).json()["id"]
    queued = stack.api.post("/runs", json=run_config(tmp_path, tiny_model_dir, num_rollouts=1)).json()
    assert queued["status"] == "queued"
    wait_for_run(stack.api, active, lambda run: run["rollout_id"] >= 1)

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
    assert api.get(f"/runs/{queued['id']}").json()["queue_position"] == 1
    first, second = wait_for_run(api, active), wait_for_run(api, queued["id"])
    assert (first["status"], second["status"]) == ("completed", "completed"), (first["error"], second["error"])
    assert span(api, active)[1] < span(api, queued["id"])[0]
