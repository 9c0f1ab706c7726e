"""The run queue through the coordinator's REST API: a run posted while another is active
waits (201, `queued`, its position), can be moved, stopped or deleted, the queue has a bound
(409 past it), and it survives a coordinator restart. A real coordinator and Redis; the
services it drives are a socket that never answers, so the first run stays active (in its
setup) for the test. That a queued run starts and trains once the active one ends is shown
on a real stack (tests/e2e/test_queue.py)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import redis

from rlmesh.common.auth import client_headers
from rlmesh.coordinator.app import API_TASK
from rlmesh.coordinator.app import start as start_coordinator
from rlmesh.coordinator.config import Settings

CONFIG = {"model_path": "/models/m", "datasets": [{"name": "d", "path": "d.jsonl"}]}


def coordinator(start_in_loop, redis_url: str, silent_address: str, **settings) -> tuple[object, httpx.Client]:
    server, port = start_in_loop(
        lambda: start_coordinator(
            Settings(
                port=0,
                redis_url=redis_url,
                buffer_address=silent_address,
                rollout_address=silent_address,
                reward_address=silent_address,
                trainer_address=silent_address,
                check_deadline_seconds=0.5,  # (services that never answer: the door's checks give up)
                **settings,
            )
        )
    )
    return server, httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30, headers=client_headers())


async def _stop_coordinator(server) -> None:
    """Shut the coordinator down as SIGTERM would: its runs stay in Redis as they are."""
    serving = next(t for t in asyncio.all_tasks() if t.get_name() == API_TASK)
    server.should_exit = True
    await serving


def queue(api: httpx.Client) -> list[str]:
    """Queued runs' ids, next first, as GET /runs shows them."""
    return [
        r["id"] for r in sorted(api.get("/runs").json(), key=lambda r: r["queue_position"] or 0) if r["queue_position"]
    ]


@pytest.fixture
def api(start_in_loop, redis_url, silent_address):
    _, client = coordinator(start_in_loop, redis_url, silent_address, max_queued_runs=3)
    with client:
        yield client


def test_runs_posted_while_one_is_active_wait_in_order_and_can_be_moved(api):
    active = api.post("/runs", json=CONFIG)
    assert active.status_code == 201 and active.json() == {
        "id": active.json()["id"],
        "status": "pending",
        "queue_position": None,
    }
    waiting = [api.post("/runs", json={**CONFIG, "name": f"w{i}"}) for i in range(3)]
    assert [r.status_code for r in waiting] == [201] * 3
    assert [(r.json()["status"], r.json()["queue_position"]) for r in waiting] == [("queued", i) for i in (1, 2, 3)]
    a, b, c = (r.json()["id"] for r in waiting)
    assert queue(api) == [a, b, c]
    run = api.get(f"/runs/{c}").json()
    assert (run["status"], run["phase"], run["queue_position"]) == ("queued", "queued", 3)

    r = api.post(f"/runs/{c}/queue-position", json={"position": 1})
    assert r.json() == {"id": c, "status": "queued", "queue_position": 1}
    assert queue(api) == [c, a, b]
    assert api.post(f"/runs/{c}/queue-position", json={"position": 50}).json()["queue_position"] == 3
    assert queue(api) == [a, b, c]
    # bad moves: not queued, unknown, out of bounds
    r = api.post(f"/runs/{active.json()['id']}/queue-position", json={"position": 1})
    assert r.status_code == 409 and "only a queued run" in r.json()["detail"]
    assert api.post("/runs/nope/queue-position", json={"position": 1}).status_code == 404
    assert api.post(f"/runs/{a}/queue-position", json={"position": 0}).status_code == 422
    assert api.post(f"/runs/{a}/queue-position", json={"position": 1, "positon": 2}).status_code == 422
    # a queued run cannot be paused; it can be stopped (at once, off the queue) and deleted
    assert api.post(f"/runs/{a}/pause").status_code == 409
    assert api.post(f"/runs/{a}/stop").json() == {"id": a, "status": "stopped"}
    assert queue(api) == [b, c]
    assert api.delete(f"/runs/{b}").json() == {"id": b, "deleted": True}
    assert api.get(f"/runs/{b}").status_code == 404
    assert queue(api) == [c]
    assert api.get(f"/runs/{c}").json()["queue_position"] == 1


def test_past_its_bound_the_queue_answers_409(api):
    api.post("/runs", json=CONFIG)
    for _ in range(3):
        assert api.post("/runs", json=CONFIG).json()["status"] == "queued"
    r = api.post("/runs", json=CONFIG)
    assert r.status_code == 409 and "queue is full" in r.json()["detail"] and "max_queued_runs=3" in r.json()["detail"]
    assert len(api.get("/runs").json()) == 4  # nothing was kept of the refused run


def test_without_a_queue_a_second_run_answers_409(start_in_loop, redis_url, silent_address):
    _, api = coordinator(start_in_loop, redis_url, silent_address, max_queued_runs=0)
    active = api.post("/runs", json=CONFIG).json()["id"]
    r = api.post("/runs", json=CONFIG)
    assert r.status_code == 409 and f"run {active} is still active; stop it first" in r.json()["detail"]


def test_the_queue_survives_a_coordinator_restart(start_in_loop, loop_thread, redis_url, silent_address):
    server, api = coordinator(start_in_loop, redis_url, silent_address)
    active = api.post("/runs", json=CONFIG).json()["id"]
    a, b, c = (api.post("/runs", json=CONFIG).json()["id"] for _ in range(3))
    api.post(f"/runs/{c}/queue-position", json={"position": 2})
    loop_thread.run(_stop_coordinator(server), timeout=60)

    server, api = coordinator(start_in_loop, redis_url, silent_address)
    assert queue(api) == [a, c, b]
    assert api.get(f"/runs/{active}").json()["status"] in ("pending", "running")  # resumed, still the active one
    # The active run ends while no coordinator runs (as another replica would record it): the
    # next coordinator starts the queue's first run.
    loop_thread.run(_stop_coordinator(server), timeout=60)
    redis.Redis.from_url(redis_url).hset(f"rlmesh:coord:run:{active}", "status", "failed")
    _, api = coordinator(start_in_loop, redis_url, silent_address)
    run = api.get(f"/runs/{a}").json()
    assert run["status"] in ("pending", "running") and (run["phase"], run["queue_position"]) == ("setup", None)
    assert queue(api) == [c, b]
    assert api.post("/runs", json=CONFIG).json()["queue_position"] == 3
