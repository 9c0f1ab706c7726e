"""The coordinator's REST API against bad input: bounded bodies (413), bounded counts and
well-formed values (422 naming the field, never echoing the input), one run at a time
even under concurrent submissions. A real coordinator and Redis; the services it would
drive are a socket that accepts connections and never answers, so a run stays active."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import re
import threading

import httpx
import pytest
import redis
import redis.asyncio as aioredis

from rlmesh.buffer.config import Settings as BufferSettings
from rlmesh.buffer.server import start as start_buffer
from rlmesh.cli.demo import run_metrics
from rlmesh.common.auth import client_headers
from rlmesh.common.grpc_server import aio_channel
from rlmesh.common.run_config import RunConfig
from rlmesh.coordinator.app import patient_redis_client, server_config
from rlmesh.coordinator.app import start as start_coordinator
from rlmesh.coordinator.calls import Clients
from rlmesh.coordinator.config import Settings
from rlmesh.coordinator.runs import RunDriver
from rlmesh.coordinator.schemas import RunDetail
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
                check_deadline_seconds=0.5,  # (services that never answer: the door's checks give up)
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


def test_concurrent_submissions_start_one_run_and_queue_the_rest(api):
    answers: list[httpx.Response] = []

    def submit():
        answers.append(api.post("/runs", json=body()))

    threads = [threading.Thread(target=submit) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.status_code for r in answers] == [201] * 8
    started = [r.json() for r in answers if r.json()["status"] == "pending"]
    queued = sorted((r.json() for r in answers if r.json()["status"] == "queued"), key=lambda r: r["queue_position"])
    assert len(started) == 1 and started[0]["queue_position"] is None
    assert [r["queue_position"] for r in queued] == list(range(1, 8))
    runs = {r["id"]: r for r in api.get("/runs").json()}
    assert len(runs) == 8
    assert [runs[r["id"]]["queue_position"] for r in queued] == list(range(1, 8))
    # an active run cannot be deleted; unknown and malformed ids are told apart
    r = api.delete(f"/runs/{started[0]['id']}")
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
    # the new run is active and indexed: it holds the claim as before (the next one waits)
    assert api.post("/runs", json=body()).json()["status"] == "queued"


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
            run_id = (await store.create(RunConfig.model_validate(body()))).id
            await store.update(run_id, status="completed")
            await store.release_and_promote(run_id)
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
    # lean by default: the newest few records (the whole history was 355 KB for a small run)
    run = api.get(f"/runs/{run_id}").json()
    assert run["metrics"] == [{"rollout_id": i} for i in range(1191, 1201)]
    assert run["latest_metrics"] == {"rollout_id": 1200}
    assert set(run) == set(RunDetail.model_fields)  # (the stored records are spliced into the answer)
    run = api.get(f"/runs/{run_id}", params={"metrics_last": 1000}).json()
    assert len(run["metrics"]) == 1000 and run["metrics"][-1] == {"rollout_id": 1200}
    run = api.get(f"/runs/{run_id}", params={"metrics_last": 0}).json()
    assert run["metrics"] == [] and run["latest_metrics"] == {"rollout_id": 1200}
    assert api.get(f"/runs/{run_id}", params={"metrics_last": 10**6}).status_code == 422
    # all of it, a page at a time, from the metrics route
    page = api.get(f"/runs/{run_id}/metrics").json()
    assert page["records"] == [{"rollout_id": i} for i in range(1, 101)] and page["total"] == 1200
    assert run_metrics(api, run_id, page=500) == [{"rollout_id": i} for i in range(1, 1201)]
    # a non-finite value (json.dumps writes NaN, which is not JSON) is answered as null
    store.rpush(f"rlmesh:coord:run:{run_id}:metrics", json.dumps({"rollout_id": 1201, "train/loss": float("nan")}))
    page = api.get(f"/runs/{run_id}/metrics", params={"since": 1200})
    assert json.loads(page.text, parse_constant=lambda c: pytest.fail(f"{c} in {page.text}")) == {
        "records": [{"rollout_id": 1201, "train/loss": None}],
        "next": 1201,
        "total": 1201,
    }
    run = api.get(f"/runs/{run_id}", params={"metrics_last": 2})
    assert json.loads(run.text, parse_constant=lambda c: pytest.fail(f"{c} in {run.text}"))["metrics"] == [
        {"rollout_id": 1200},
        {"rollout_id": 1201, "train/loss": None},
    ]
    assert run.json()["latest_metrics"] == {"rollout_id": 1201, "train/loss": None}


def test_successful_reads_are_left_out_of_the_access_log(redis_url):
    """200 dashboards polling once a second wrote 200 access-log lines a second; changes,
    refusals and errors are still logged, and everything with log_successful_reads."""
    access = logging.getLogger("uvicorn.access")

    def logged(method: str, status: int) -> bool:
        args = ("127.0.0.1:5000", method, "/runs", "1.1", status)
        return bool(
            access.filter(access.makeRecord(access.name, logging.INFO, __file__, 0, "%s %s %s %s %d", args, None))
        )

    server_config(Settings(redis_url=redis_url))
    assert not logged("GET", 200) and not logged("HEAD", 304)
    assert logged("GET", 404) and logged("GET", 503) and logged("POST", 201) and logged("DELETE", 409)
    server_config(Settings(redis_url=redis_url, log_successful_reads=True))
    assert logged("GET", 200)


def test_a_metric_record_whose_reply_was_lost_is_kept_once(redis_url):
    """The coordinator's Redis client sends a command again when its connection breaks: a
    connection cut after Redis took the append, before its reply came back, wrote the
    iteration's record twice (every curve and count after it off by one)."""
    target = redis.Redis.from_url(redis_url).connection_pool.connection_kwargs
    cut = {"done": False}

    async def scenario() -> list[dict]:
        async def relay(reader, writer, upstream_reader, upstream_writer):
            # client -> Redis; the first command that touches the metrics list goes through
            # and the connection is then cut before Redis's reply is relayed.
            while data := await reader.read(65536):
                cutting = b":metrics" in data and not cut["done"]
                cut["done"] = cut["done"] or cutting  # (from now on this connection relays no reply)
                upstream_writer.write(data)
                await upstream_writer.drain()
                if cutting:
                    await asyncio.sleep(0.2)  # (Redis has it)
                    writer.close()
                    upstream_writer.close()
                    return

        async def handle(reader, writer):
            up_reader, up_writer = await asyncio.open_connection(target["host"], target["port"])

            before = cut["done"]

            async def back():
                while data := await up_reader.read(65536):
                    if cut["done"] != before:
                        return  # the reply to the cut command is lost
                    writer.write(data)
                    await writer.drain()

            back_task = asyncio.create_task(back())
            await relay(reader, writer, up_reader, up_writer)
            back_task.cancel()

        proxy = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = proxy.sockets[0].getsockname()[1]
        url = redis_url.replace(f"{target['host']}:{target['port']}", f"127.0.0.1:{port}")
        client = patient_redis_client(url, 10)
        store = RunStore(client, "lost-reply")
        try:
            async with proxy:
                await client.hset("lost-reply:coord:run:r1", "status", "running")  # (the run's record)
                await store.append_metrics("r1", {"rollout_id": 1, "time": 1.5})
                return await store.metrics("r1")
        finally:
            await client.aclose()

    assert asyncio.run(scenario()) == [{"rollout_id": 1, "time": 1.5}]
    assert cut["done"]


def test_runs_are_listed_a_page_at_a_time(api, redis_url):
    store = redis.Redis.from_url(redis_url)
    ids = []
    for _ in range(5):
        ids.append(api.post("/runs", json=body()).json()["id"])
        store.hset(f"rlmesh:coord:run:{ids[-1]}", "status", "completed")
        store.delete("rlmesh:coord:active")
    r = api.get("/runs")
    assert [run["id"] for run in r.json()] == ids and r.headers["x-total-count"] == "5"
    r = api.get("/runs", params={"offset": 1, "limit": 2})
    assert [run["id"] for run in r.json()] == ids[1:3] and r.headers["x-total-count"] == "5"
    assert api.get("/runs", params={"offset": 5}).json() == []
    for bad in ({"limit": 0}, {"limit": 1001}, {"offset": -1}):
        assert api.get("/runs", params=bad).status_code == 422, bad


def test_a_burst_of_readers_waits_for_a_small_redis_pool_instead_of_failing(start_in_loop, redis_url, silent_address):
    # 200 requests at once on a pool of 2 connections: each waits its turn. (A pool that
    # refused requests past its size answered such a burst 503: 135 of 200.)
    services = {f"{name}_address": silent_address for name in ("buffer", "rollout", "reward", "trainer")}
    _, port = start_in_loop(
        lambda: start_coordinator(Settings(port=0, redis_url=redis_url, redis_max_connections=2, **services))
    )
    base = f"http://127.0.0.1:{port}"
    with httpx.Client(base_url=base, timeout=30, headers=client_headers()) as client:
        run_id = client.post("/runs", json=body()).json()["id"]

    async def burst() -> list[int]:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(base_url=base, timeout=60, headers=client_headers(), limits=limits) as client:
            paths = [f"/runs/{run_id}", "/runs", f"/runs/{run_id}/metrics"] * 67
            answers = await asyncio.gather(*(client.get(path) for path in paths[:200]))
        return [r.status_code for r in answers]

    assert asyncio.run(burst()) == [200] * 200


def test_the_api_docs_load_from_this_machine(api):
    r = api.get("/docs", headers={"authorization": ""})  # (no token needed)
    assert r.status_code == 200
    html = r.text
    urls = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert urls and all(u.startswith("/docs/assets/") for u in urls), urls
    for url in urls:
        asset = api.get(url, headers={"authorization": ""})
        assert asset.status_code == 200 and len(asset.content) > 100, url
    # its policy lets its own scripts run (the files, and the inline set-up by its hash), nothing else
    csp = r.headers["content-security-policy"]
    (setup,) = re.findall(r"<script>(.*?)</script>", html, re.DOTALL)
    digest = base64.b64encode(hashlib.sha256(setup.encode()).digest()).decode()
    assert f"script-src 'self' 'sha256-{digest}';" in csp and "default-src 'none'" in csp
    assert "'/openapi.json'" in setup
    assert api.get("/redoc").status_code in (401, 404)  # (ReDoc came from a CDN: gone)


def test_the_spec_declares_the_bearer_token(api):
    spec = api.get("/openapi.json").json()
    assert spec["components"]["securitySchemes"]["bearer"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "The stack's token (RLMESH_TOKEN).",
    }
    for path in ("/runs", "/runs/{run_id}", "/runs/{run_id}/metrics", "/reward-services"):
        for method, operation in spec["paths"][path].items():
            assert operation["security"] == [{"bearer": []}], (path, method)
    assert "security" not in spec["paths"]["/health"]["get"]


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
