"""What bounds Redis: the services' ACL user, which may not administer the server; its
maxmemory, past which the buffer answers RESOURCE_EXHAUSTED naming it (nothing evicted);
and a run's end, which leaves none of its dataset copies, prompts or acknowledged ids
behind. Real Redis servers (the embedded one), a real buffer and coordinator over loopback."""

from __future__ import annotations

import json
import time

import grpc
import httpx
import pytest
import redis

from rlmesh.buffer.config import Settings as BufferSettings
from rlmesh.buffer.server import start as start_buffer
from rlmesh.cli.embedded_redis import EmbeddedRedisSettings, start_redis
from rlmesh.common.auth import client_headers
from rlmesh.common.grpc_server import sync_channel
from rlmesh.coordinator.app import start as start_coordinator
from rlmesh.coordinator.config import Settings as CoordinatorSettings
from rlmesh.v1 import buffer_pb2, buffer_pb2_grpc
from tests.helpers.buffer import code_of, completed, create, prompts, put, stats

FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION


def test_the_services_user_cannot_administer_the_embedded_redis(redis_server):
    services, admin = redis.Redis.from_url(redis_server.url), redis.Redis.from_url(redis_server.admin_url)
    for command in (
        ["CONFIG", "SET", "maxmemory", "1"],
        ["FLUSHALL"],
        ["FLUSHDB"],
        ["DEBUG", "SLEEP", "0"],
        ["SHUTDOWN", "NOSAVE"],
        ["ACL", "SETUSER", "rlmesh", "+@all"],
        ["KEYS", "*"],
        ["SCRIPT", "FLUSH"],
        ["FUNCTION", "FLUSH"],
        ["BGREWRITEAOF"],
    ):
        with pytest.raises(redis.exceptions.ResponseError):
            services.execute_command(*command)
        # (DEBUG is refused before its permission is checked: ask the ACL what it allows)
        assert "no permissions" in admin.execute_command("ACL", "DRYRUN", "rlmesh", *command).decode(), command
    # What the services do is allowed: data, scripts, transactions.
    services.set("bounds:k", "v")
    assert services.eval("return redis.call('GET', KEYS[1])", 1, "bounds:k") == b"v"
    with services.pipeline(transaction=True) as pipe:
        assert pipe.unlink("bounds:k").execute() == [1]
    with pytest.raises(redis.exceptions.AuthenticationError):  # the default user is off
        redis.Redis(port=redis_server.port).ping()
    assert services.ping() and admin.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}

    conf = redis_server.data_dir / "redis.conf"
    assert conf.stat().st_mode & 0o777 == 0o600
    assert redis_server.password in conf.read_text()
    cmdline = (open(f"/proc/{redis_server.process.pid}/cmdline", "rb").read()).decode(errors="replace")
    assert redis_server.password not in cmdline and redis_server.admin_password not in cmdline


def test_the_embedded_redis_settings_are_checked():
    assert EmbeddedRedisSettings(maxmemory="2gb").maxmemory_bytes() == 2 * 1024**3
    assert EmbeddedRedisSettings(maxmemory="0").maxmemory_bytes() == 0
    assert 0 < EmbeddedRedisSettings(maxmemory="10%").maxmemory_bytes() < EmbeddedRedisSettings().maxmemory_bytes()
    for bad in ("lots", "-1gb", "0%", "150%", "4 tb"):
        with pytest.raises(ValueError, match="maxmemory|share of memory|size"):
            EmbeddedRedisSettings(maxmemory=bad)
    with pytest.raises(ValueError, match="appendfsync"):
        EmbeddedRedisSettings(appendfsync="no")


def test_a_full_redis_makes_the_buffer_answer_resource_exhausted(tmp_path, start_in_loop, dataset):
    server = start_redis(tmp_path / "redis", settings=EmbeddedRedisSettings(maxmemory="8mb"))
    try:
        _, port = start_in_loop(lambda: start_buffer(BufferSettings(redis_url=server.url, port=0, cache_megabytes=0)))
        stub = buffer_pb2_grpc.BufferStub(sync_channel(f"127.0.0.1:{port}"))
        create(stub, dataset)
        template = completed(prompts(stub, 1)[0])
        template.samples[0].response = "x" * 256 * 1024  # a quarter MiB a group
        stored = 0
        for i in range(100):  # 25 MiB: far past the limit
            group = sample_group_copy(template, f"big{i}")
            try:
                stored += put(stub, [group]).stored
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (e.code(), e.details())
                assert "maxmemory" in e.details() and "nothing is evicted" in e.details()
                break
        else:
            pytest.fail("100 quarter-MiB groups fitted under an 8 MB maxmemory")
        assert 0 < stored < 40
        # Reads still answer, nothing was evicted, even when GetStats's own write (a snapshot
        # of its rates, due after a second) is refused: Redis well over its limit.
        direct = redis.Redis.from_url(server.admin_url)
        direct.config_set("maxmemory", "1mb")
        time.sleep(1.1)
        assert stats(stub).queued_groups == stored
        direct.config_set("maxmemory", "8mb")
        direct.close()
        assert stub.DeleteRun(buffer_pb2.DeleteRunRequest(run_id="r1")).keys_deleted > 0  # deletes pass
        create(stub, dataset)
        assert put(stub, [completed(prompts(stub, 1)[0])]).stored == 1  # and writes fit again
    finally:
        server.stop()


def sample_group_copy(group, group_id: str):
    copy = type(group)()
    copy.CopyFrom(group)
    copy.group_id = group_id
    return copy


def run_keys(r: redis.Redis, run_id: str) -> set[str]:
    prefix = f"rlmesh:run:{run_id}:"
    return {k.decode()[len(prefix) :] for k in r.scan_iter(match=prefix + "*")}


# What a closed run no longer holds, and what it keeps for people (stats, groups never
# trained, recent groups); `closed` marks it.
GONE = {"data:train", "prompts", "prompt_leases", "partial", "partial_groups", "acked", "discarded"}


def test_a_closed_run_keeps_no_dataset_copy_and_takes_no_more_writes(buffer, dataset, redis_url):
    stub, r = buffer(), redis.Redis.from_url(redis_url)
    create(stub, dataset)
    groups = prompts(stub, 5)  # the fifth stays handed out
    put(stub, [completed(g) for g in groups[:2]])
    stub.DropGroups(buffer_pb2.DropGroupsRequest(run_id="r1", group_ids=[groups[2].group_id], reason="filtered"))
    stub.ReturnPartialGroups(buffer_pb2.PutGroupsRequest(run_id="r1", groups=[groups[3]]))
    leased = stub.LeaseBatch(buffer_pb2.LeaseBatchRequest(run_id="r1", num_groups=1))
    stub.AckBatch(buffer_pb2.AckBatchRequest(run_id="r1", lease_id=leased.lease_id))
    assert {"data:train", "prompts", "partial", "acked", "discarded"} <= run_keys(r, "r1")

    closed = stub.CloseRun(buffer_pb2.CloseRunRequest(run_id="r1"))
    assert closed.keys_deleted >= 5
    left = run_keys(r, "r1")
    assert not left & GONE, left & GONE
    assert {"spec", "groups", "queue", "recent_ids", "stats", "closed"} <= left
    assert stub.CloseRun(buffer_pb2.CloseRunRequest(run_id="r1")).keys_deleted == 0  # idempotent

    s = stats(stub)  # what people look at stays
    assert (s.queued_groups, s.acknowledged_groups, s.groups_written) == (1, 1, 2)
    for call in (
        lambda: prompts(stub, 1),
        lambda: stub.GetEvalPrompts(buffer_pb2.GetEvalPromptsRequest(run_id="r1", dataset="train")),
        lambda: put(stub, [completed(groups[0])]),
        lambda: stub.ReturnPartialGroups(buffer_pb2.PutGroupsRequest(run_id="r1", groups=[groups[3]])),
        lambda: stub.DropGroups(buffer_pb2.DropGroupsRequest(run_id="r1", group_ids=["g9"], reason="x")),
    ):
        code, details = code_of(call)
        assert code == FAILED_PRECONDITION and "has ended" in details, (code, details)
    assert not run_keys(r, "r1") & GONE  # nothing came back
    assert code_of(lambda: stub.CloseRun(buffer_pb2.CloseRunRequest(run_id="nope")))[0] == grpc.StatusCode.NOT_FOUND
    kept = run_keys(r, "r1")
    assert stub.DeleteRun(buffer_pb2.DeleteRunRequest(run_id="r1")).keys_deleted == len(kept)
    assert run_keys(r, "r1") == set()


def test_a_run_that_ends_leaves_no_dataset_copy_in_redis_and_no_task(
    start_in_loop, redis_url, silent_address, tmp_path
):
    """A run stopped through the API: the coordinator closes it in the buffer (after the
    trainer's EndRun, here a silent trainer past its deadline and the stop's wait for it), and
    forgets its task."""
    _, buffer_port = start_in_loop(lambda: start_buffer(BufferSettings(redis_url=redis_url, port=0)))
    coordinator, port = start_in_loop(
        lambda: start_coordinator(
            CoordinatorSettings(
                port=0,
                redis_url=redis_url,
                buffer_address=f"127.0.0.1:{buffer_port}",
                rollout_address=silent_address,
                reward_address=silent_address,
                trainer_address=silent_address,
                call_deadline_seconds=1.0,
                setup_deadline_seconds=1.0,
                check_deadline_seconds=0.5,
                stop_trainer_wait_seconds=2.0,  # (then stopped without a final model)
            )
        )
    )
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"p{i}", "label": str(i)}) + "\n" for i in range(20)))
    config = {"model_path": "/models/m", "datasets": [{"name": "train", "path": str(data)}]}
    r = redis.Redis.from_url(redis_url)
    driver = coordinator.config.app.state.driver
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30, headers=client_headers()) as api:
        run_id = api.post("/runs", json=config).json()["id"]
        until(lambda: "data:train" in run_keys(r, run_id), "the buffer loaded the run's dataset")
        assert run_id in driver.tasks
        assert api.post(f"/runs/{run_id}/stop").status_code == 200
        until(lambda: "closed" in run_keys(r, run_id), "the run was closed in the buffer")
        assert api.get(f"/runs/{run_id}").json()["status"] == "stopped"
    assert not run_keys(r, run_id) & GONE
    until(lambda: run_id not in driver.tasks, "the run's task was forgotten")


def until(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}"
        time.sleep(0.05)
