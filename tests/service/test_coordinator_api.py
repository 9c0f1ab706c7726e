"""The coordinator's REST API against bad input: bounded bodies (413), bounded counts and
well-formed values (422 naming the field, never echoing the input), one run at a time
even under concurrent submissions. A real coordinator and Redis; the services it would
drive are a socket that accepts connections and never answers, so a run stays active."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
import redis
import redis.asyncio as aioredis

from rlmesh.buffer.config import Settings as BufferSettings
from rlmesh.buffer.server import start as start_buffer
from rlmesh.common.auth import client_headers
from rlmesh.common.grpc_server import aio_channel
from rlmesh.common.run_config import RunConfig
from rlmesh.coordinator.app import start as start_coordinator
from rlmesh.coordinator.calls import Clients
from rlmesh.coordinator.config import Settings
from rlmesh.coordinator.runs import RunDriver
from rlmesh.coordinator.store import RunStore
from rlmesh.v1 import buffer_pb2_grpc


@pytest.fixture
def api(start_in_loop, redis_url, silent_address):
    _, port = start_in_loop(
        lambda: start_coordinator(
            Settings(
                port=0,
                redis_url=redis_url,
                buffer_address=silent_address,
                rollout_address=silent_address,
                reward_address=silent_address,
                trainer_address=silent_address,
                max_request_bytes=64 * 1024,
                limits={"max_groups_per_call": 100},
            )
        )
    )
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30, headers=client_headers()) as client:
        yield client


def body(**overrides) -> dict:
    return {"model_path": "/models/m", "datasets": [{"name": "d", "path": "d.jsonl"}], **overrides}


def test_bodies_over_the_limit_get_413(api):
    big = body(name="x" * 100 * 1024)
    r = api.post("/runs", json=big)
    assert r.status_code == 413 and "65536 bytes" in r.json()["detail"]
    # a chunked body (no Content-Length) is counted as it arrives
    chunks = (json.dumps(big).encode()[i : i + 4096] for i in range(0, 110 * 1024, 4096))
    r = api.post("/runs", content=chunks, headers={"content-type": "application/json"})
    assert r.status_code == 413


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"rollout": {"rollout_batch_size": 2**31 - 1}}, ["body", "rollout", "rollout_batch_size"]),  # above the limit
        (
            {"rollout": {"rollout_batch_size": 60, "over_sampling_groups": 60}},
            ["body", "rollout", "rollout_batch_size"],
        ),
        ({"seed": 2**70}, ["body", "seed"]),  # wider than the wire's int64
        ({"rollout": {"sampling": {"top_k": 2**40}}}, ["body", "rollout", "sampling", "top_k"]),
        ({"reward": {"components": {f"c{i}": 1.0 for i in range(100)}}}, ["body", "reward", "components"]),
        ({"datasets": [{"name": "d", "path": "p", "prompt_key": "k" * 500}]}, ["body", "datasets", 0, "prompt_key"]),
    ],
)
def test_counts_and_sizes_are_bounded(api, overrides, field):
    r = api.post("/runs", json=body(**overrides))
    assert r.status_code == 422, r.text
    errors = r.json()["detail"]
    assert any(e["loc"] == field for e in errors), errors
    assert all(set(e) == {"loc", "msg", "type"} for e in errors)  # no echo of the input


def test_values_json_cannot_carry_safely_get_422(api):
    headers = {"content-type": "application/json"}
    r = api.post("/runs", content=json.dumps(body(optimizer={"lr": float("nan")})), headers=headers)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "optimizer", "lr"]
    r = api.post("/runs", content=json.dumps(body(name="\ud800")), headers=headers)
    assert r.status_code == 422 and "lone surrogate" in r.text
    r = api.post("/runs", content=json.dumps(body(reward={"components": {"\udcff": 1.0}})), headers=headers)
    assert r.status_code == 422
    r = api.post("/runs", content=b"{not json", headers=headers)
    assert r.status_code == 422


def test_concurrent_submissions_start_one_run(api):
    answers: list[int] = []

    def submit():
        answers.append(api.post("/runs", json=body()).status_code)

    threads = [threading.Thread(target=submit) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(answers) == [201] + [409] * 7
    runs = api.get("/runs").json()
    assert len(runs) == 1
    # an active run cannot be deleted; unknown and malformed ids are told apart
    r = api.delete(f"/runs/{runs[0]['id']}")
    assert r.status_code == 409 and "stop it first" in r.json()["detail"]
    assert api.delete("/runs/nope").status_code == 404
    assert api.delete("/runs/..%2F..").status_code in (404, 422)


def test_a_claim_left_by_a_half_created_run_is_taken_over(api, redis_url):
    # What a coordinator killed between the claim and the index write left behind, when run
    # creation was three writes: a pending record that holds the claim but that no list shows
    # and nothing resumes (every POST /runs answered 409 "still active" forever).
    r = redis.Redis.from_url(redis_url)
    r.hset("rlmesh:coord:run:orphan", mapping={"id": "orphan", "status": "pending"})
    r.set("rlmesh:coord:active", "orphan")
    created = api.post("/runs", json=body())
    assert created.status_code == 201, created.text
    assert [run["id"] for run in api.get("/runs").json()] == [created.json()["id"]]
    assert not r.exists("rlmesh:coord:run:orphan")
    # the new run is active and indexed: it holds the claim as before
    assert api.post("/runs", json=body()).status_code == 409


def test_a_reward_service_that_never_answers_is_a_504_not_a_hang(start_in_loop, redis_url, silent_address):
    _, port = start_in_loop(
        lambda: start_coordinator(
            Settings(port=0, redis_url=redis_url, reward_address=silent_address, call_deadline_seconds=1.0)
        )
    )
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30, headers=client_headers()) as client:
        for method, path in (("GET", "/reward-services"), ("GET", "/reward-services/stats"),
                             ("DELETE", "/reward-services/judge")):  # fmt: skip
            r = client.request(method, path)
            assert r.status_code == 504 and r.json()["code"] == "DEADLINE_EXCEEDED", (path, r.text)


def test_the_spec_documents_every_error_status(api):
    spec = api.get("/openapi.json").json()
    post_runs = spec["paths"]["/runs"]["post"]["responses"]
    assert {"201", "401", "409", "413", "422"} <= set(post_runs)
    assert {"200", "401", "404", "409", "503"} <= set(spec["paths"]["/runs/{run_id}"]["delete"]["responses"])


def test_only_the_newest_finished_runs_are_kept(loop_thread, start_in_loop, redis_url):
    _, port = start_in_loop(lambda: start_buffer(BufferSettings(redis_url=redis_url, port=0)))

    async def scenario() -> tuple[list[str], list[str]]:
        redis = aioredis.Redis.from_url(redis_url)
        channel = aio_channel(f"127.0.0.1:{port}")
        store = RunStore(redis, "test")
        driver = RunDriver(
            store,
            Clients(buffer=buffer_pb2_grpc.BufferStub(channel), rollout=None, trainer=None),
            train_wait_seconds=1.0,
            max_finished_runs=2,
        )
        created = []
        for _ in range(4):
            run_id = await store.create(RunConfig.model_validate(body()))
            await store.update(run_id, status="completed")
            await store.release(run_id)
            created.append(run_id)
        await driver._prune()
        kept = [r["id"] for r in await store.list()]
        await channel.close()
        await redis.aclose()
        return created, kept

    created, kept = loop_thread.run(scenario())
    assert kept == created[-2:]


def test_a_runs_metric_history_is_returned_bounded(api, redis_url):
    run_id = api.post("/runs", json=body()).json()["id"]
    store = redis.Redis.from_url(redis_url)
    store.rpush(f"rlmesh:coord:run:{run_id}:metrics", *(json.dumps({"rollout_id": i}) for i in range(1, 1201)))
    run = api.get(f"/runs/{run_id}").json()
    assert len(run["metrics"]) == 1000 and run["metrics"][-1] == run["latest_metrics"] == {"rollout_id": 1200}
    run = api.get(f"/runs/{run_id}", params={"metrics_last": 0}).json()
    assert run["metrics"] == [] and run["latest_metrics"] == {"rollout_id": 1200}
    assert api.get(f"/runs/{run_id}", params={"metrics_last": 10**6}).status_code == 422


def test_off_policy_warnings_are_shown_with_the_run(api, redis_url, loop_thread):
    from rlmesh.coordinator.off_policy_watch import record_warnings

    run_id = api.post("/runs", json=body(mode="fully_async")).json()["id"]
    assert api.get(f"/runs/{run_id}").json()["warnings"] == []

    async def two_far_off_iterations():
        redis_client = aioredis.from_url(redis_url)
        store = RunStore(redis_client, "rlmesh")
        for i in (1, 2):
            await store.append_metrics(run_id, {"rollout_id": i, "train/is_ess": 0.2})
            await record_warnings(store, run_id)
        await redis_client.aclose()

    loop_thread.run(two_far_off_iterations())
    warnings = api.get(f"/runs/{run_id}").json()["warnings"]
    assert len(warnings) == 1 and warnings[0].startswith("train/is_ess < 0.5 for 2 iterations")
