"""Operating runs through the coordinator's REST API: pause and resume (statuses, 409s, kept
in Redis), metric records from a cursor with a field filter, the recent groups (kept by a
real buffer, paged), checkpoints, and the page's files. A real coordinator, Redis and
buffer; the rollout service and trainer are a socket that never answers, so a run stays
active (it waits in its setup) for the test."""

from __future__ import annotations

import json
import time

import grpc
import httpx
import pytest
import redis

from rlmesh.buffer.config import Settings as BufferSettings
from rlmesh.buffer.server import start as start_buffer
from rlmesh.common.auth import client_headers
from rlmesh.common.grpc_server import sync_channel
from rlmesh.coordinator.app import start as start_coordinator
from rlmesh.coordinator.config import Settings
from rlmesh.v1 import buffer_pb2, buffer_pb2_grpc
from tests.helpers.buffer import completed, prompts, put

RECENT = 5  # groups the buffer keeps per run for browsing


@pytest.fixture
def stack(start_in_loop, redis_url, silent_address):
    _, buffer_port = start_in_loop(
        lambda: start_buffer(BufferSettings(redis_url=redis_url, port=0, recent_groups=RECENT))
    )
    _, port = start_in_loop(
        lambda: start_coordinator(
            Settings(
                port=0,
                redis_url=redis_url,
                buffer_address=f"127.0.0.1:{buffer_port}",
                rollout_address=silent_address,
                reward_address=silent_address,
                trainer_address=silent_address,
                call_deadline_seconds=2.0,
            )
        )
    )
    buffer = buffer_pb2_grpc.BufferStub(sync_channel(f"127.0.0.1:{buffer_port}"))
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30, headers=client_headers()) as client:
        yield client, buffer


@pytest.fixture
def config(tmp_path) -> dict:
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"p{i}", "label": str(i)}) + "\n" for i in range(20)))
    return {
        "model_path": "/models/m",
        "datasets": [{"name": "train", "path": str(data)}],
        "rollout": {"n_samples_per_prompt": 2},
    }


def set_status(redis_url: str, run_id: str, status: str) -> None:
    redis.Redis.from_url(redis_url).hset(f"rlmesh:coord:run:{run_id}", "status", status)


def test_pause_and_resume_follow_the_runs_status(stack, config, redis_url):
    api, _ = stack
    run_id = api.post("/runs", json=config).json()["id"]
    assert api.post(f"/runs/{run_id}/pause").json() == {"id": run_id, "status": "paused"}
    assert api.post(f"/runs/{run_id}/pause").json()["status"] == "paused"  # idempotent
    run = api.get(f"/runs/{run_id}").json()
    # paused, but still in its setup (the trainer never answers): not at rest yet
    assert run["status"] == "paused" and run["held"] is False
    assert api.delete(f"/runs/{run_id}").status_code == 409  # a paused run is active
    assert api.post("/runs", json=config).json()["status"] == "queued"  # and holds the one slot
    assert api.post(f"/runs/{run_id}/resume").json() == {"id": run_id, "status": "running"}
    assert api.post(f"/runs/{run_id}/resume").json()["status"] == "running"  # idempotent
    assert api.post(f"/runs/{run_id}/pause").json()["status"] == "paused"
    # a paused run can be stopped; a stopping run can be neither paused nor resumed
    assert api.post(f"/runs/{run_id}/stop").json()["status"] == "stopping"
    for action in ("pause", "resume"):
        r = api.post(f"/runs/{run_id}/{action}")
        assert r.status_code == 409 and "stopping" in r.json()["detail"]
    set_status(redis_url, run_id, "completed")
    r = api.post(f"/runs/{run_id}/pause")
    assert r.status_code == 409 and "completed" in r.json()["detail"]
    assert api.post(f"/runs/{run_id}/resume").status_code == 409
    for action in ("pause", "resume"):
        assert api.post(f"/runs/nope/{action}").status_code == 404
        assert api.post(f"/runs/..%2F/{action}").status_code in (404, 422)


def test_metrics_come_from_a_cursor_with_a_field_filter(stack, config, redis_url):
    api, _ = stack
    run_id = api.post("/runs", json=config).json()["id"]
    store = redis.Redis.from_url(redis_url)
    key = f"rlmesh:coord:run:{run_id}:metrics"
    store.rpush(key, json.dumps({"sft_step": 1, "time": 1.0, "sft/loss": 2.5}))
    store.rpush(
        key,
        *(
            json.dumps(
                {
                    "rollout_id": i,
                    "time": 1.0 + i,
                    "step": i,
                    "rollout/reward_mean": i / 10,
                    "train/entropy": 4.0,
                    "train/grad_norm": 0.5,
                }
            )
            for i in range(1, 6)
        ),
    )

    page = api.get(f"/runs/{run_id}/metrics").json()
    assert page["total"] == page["next"] == 6 and len(page["records"]) == 6
    page = api.get(f"/runs/{run_id}/metrics", params={"since": 2, "limit": 2}).json()
    assert [r["rollout_id"] for r in page["records"]] == [2, 3] and page["next"] == 4
    # polling: nothing new, then what was appended since
    assert api.get(f"/runs/{run_id}/metrics", params={"since": 6}).json() == {"records": [], "next": 6, "total": 6}
    store.rpush(key, json.dumps({"rollout_id": 6, "time": 7.0, "rollout/reward_mean": 0.6}))
    page = api.get(f"/runs/{run_id}/metrics", params={"since": 6}).json()
    assert page["records"] == [{"rollout_id": 6, "time": 7.0, "rollout/reward_mean": 0.6}] and page["next"] == 7
    # a cursor past the end answers the end (it never skips records written later)
    assert api.get(f"/runs/{run_id}/metrics", params={"since": 100}).json()["next"] == 7

    # only some fields (a trailing * is a prefix); where a point lies always comes along;
    # records with none of the fields are left out, and the cursor still moves past them
    page = api.get(f"/runs/{run_id}/metrics", params={"fields": ["train/*", "nothing"], "limit": 3}).json()
    assert page["records"] == [
        {"rollout_id": 1, "step": 1, "time": 2.0, "train/entropy": 4.0, "train/grad_norm": 0.5},
        {"rollout_id": 2, "step": 2, "time": 3.0, "train/entropy": 4.0, "train/grad_norm": 0.5},
    ]
    assert page["next"] == 3
    page = api.get(f"/runs/{run_id}/metrics", params={"fields": "sft/loss"}).json()
    assert page["records"] == [{"sft_step": 1, "time": 1.0, "sft/loss": 2.5}]

    for bad in ({"since": -1}, {"limit": 0}, {"limit": 10_001}, {"fields": ""}, {"fields": "x" * 201}):
        assert api.get(f"/runs/{run_id}/metrics", params=bad).status_code == 422, bad
    assert api.get("/runs/nope/metrics").status_code == 404


def test_recent_groups_are_paged_newest_first_and_bounded(stack, config):
    api, buffer = stack
    run_id = api.post("/runs", json=config).json()["id"]
    assert api.get(f"/runs/{run_id}/samples").json() == {"groups": [], "offset": 0, "total": 0, "kept": 0}
    # the run waits for the trainer once the buffer holds it: write groups as a rollout would
    for _ in range(200):
        try:
            buffer.GetStats(buffer_pb2.GetStatsRequest(run_id=run_id), timeout=5)
            break
        except grpc.RpcError:
            time.sleep(0.05)
    for rewards in ([0.0, 1.0], [1.0, 1.0], [0.5, 0.0], [0.0, 0.0], [1.0, 0.0], [0.25, 0.75], [0.0, 0.5]):
        put(buffer, [completed(g, rewards, version=3) for g in prompts(buffer, 1, run_id)], run_id)

    page = api.get(f"/runs/{run_id}/samples", params={"limit": 2}).json()
    assert page["total"] == RECENT and page["offset"] == 0
    newest = page["groups"][0]
    assert [s["reward"] for s in newest["samples"]] == [0.0, 0.5]
    assert [s["reward"] for s in page["groups"][1]["samples"]] == [0.25, 0.75]
    sample = newest["samples"][0]
    assert sample["prompt"] == f"p{sample['label']}" and sample["status"] == "completed"
    assert sample["weight_versions"] == [3] and sample["response_length"] == 2
    assert "tokens" not in sample and "rollout_log_probs" not in sample and "loss_mask" not in sample
    page = api.get(f"/runs/{run_id}/samples", params={"offset": 4, "limit": 10}).json()
    assert len(page["groups"]) == 1 and [s["reward"] for s in page["groups"][0]["samples"]] == [0.5, 0.0]
    assert api.get(f"/runs/{run_id}/samples", params={"offset": 5}).json()["groups"] == []

    # Filtered: each group keeps only its matching samples, groups with none are left out, and
    # the pages are of the groups that match.
    page = api.get(f"/runs/{run_id}/samples", params={"min_reward": 0.75}).json()
    assert [[s["reward"] for s in g["samples"]] for g in page["groups"]] == [[0.75], [1.0]]
    assert page["total"] == 2 and page["kept"] == RECENT and page["groups"][0]["samples_total"] == 2
    page = api.get(f"/runs/{run_id}/samples", params={"min_reward": 0.75, "offset": 1, "limit": 1}).json()
    assert [[s["reward"] for s in g["samples"]] for g in page["groups"]] == [[1.0]] and page["total"] == 2
    page = api.get(f"/runs/{run_id}/samples", params={"max_reward": 0, "status": "completed"}).json()
    assert [[s["reward"] for s in g["samples"]] for g in page["groups"]] == [[0.0], [0.0], [0.0, 0.0], [0.0]]
    assert api.get(f"/runs/{run_id}/samples", params={"status": "failed"}).json()["total"] == 0

    bad_filters = ({"status": "lost"}, {"min_reward": "nan"}, {"min_reward": 1, "max_reward": 0})
    for bad in ({"offset": -1}, {"limit": 0}, {"limit": 101}, {"offset": 5000}, *bad_filters):
        assert api.get(f"/runs/{run_id}/samples", params=bad).status_code == 422, bad
    assert api.get("/runs/nope/samples").status_code == 404


def test_checkpoints_of_an_unknown_run_are_404_and_a_silent_trainer_504(stack, config):
    api, _ = stack
    assert api.get("/runs/nope/checkpoints").status_code == 404
    run_id = api.post("/runs", json=config).json()["id"]
    r = api.get(f"/runs/{run_id}/checkpoints")
    assert r.status_code == 504 and r.json()["code"] == "DEADLINE_EXCEEDED"


def test_the_page_is_served_without_the_token_and_the_api_needs_it(stack):
    api, _ = stack
    bare = httpx.Client(base_url=str(api.base_url), timeout=10)
    r = bare.get("/", follow_redirects=False)
    assert r.status_code in (302, 307) and r.headers["location"] == "/ui/"
    page = bare.get("/ui/")
    assert page.status_code == 200 and "<title>rlmesh runs</title>" in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]  # model output cannot run script
    for name in ("app.js", "chart.js", "samples.js", "compare.js", "style.css"):
        assert bare.get(f"/ui/{name}").status_code == 200
    assert bare.get("/runs").status_code == 401
    assert bare.get("/ui/../runs").status_code in (401, 404)
    spec = api.get("/openapi.json").json()["paths"]
    assert {"200", "401", "404", "409"} <= set(spec["/runs/{run_id}/pause"]["post"]["responses"])
    assert {"200", "404", "422", "503"} <= set(spec["/runs/{run_id}/samples"]["get"]["responses"])
    assert {"200", "404", "504"} <= set(spec["/runs/{run_id}/checkpoints"]["get"]["responses"])
