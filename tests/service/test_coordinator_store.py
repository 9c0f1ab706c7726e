"""The coordinator's run records on a real Redis: a run's train steps are a Redis list that
each step trims and extends at its tail (they were a JSON list in the run's hash, parsed and
rewritten whole at every step and read: O(n^2) over a run), by the same rules as
rlmesh.coordinator.runs.steps_after_train_step and steps_held; records written before
keep working. The run queue: order, moves, deletes, its bound, and the claim handed to its
next run in the script that releases it."""

from __future__ import annotations

import json
import random
import time
import uuid

import pytest
import redis.asyncio as aioredis

from rlmesh.common.errors import FailedPrecondition, NotFound
from rlmesh.common.run_config import RunConfig
from rlmesh.coordinator import store as store_module
from rlmesh.coordinator.runs import steps_after_train_step, steps_held
from rlmesh.coordinator.store import RunStore

CONFIG = {"model_path": "/models/m", "datasets": [{"name": "d", "path": "d.jsonl"}], "sft_warmup": {"steps": 2}}


def test_the_train_steps_list_follows_the_rules(loop_thread, redis_url):
    rng = random.Random(7)

    async def scenario() -> None:
        redis = aioredis.Redis.from_url(redis_url)
        store = RunStore(redis, "test")
        run_id = (await store.create(RunConfig.model_validate(CONFIG))).id
        model: list[int] = []
        trainer = 0
        for _ in range(300):
            # the trainer mostly moves on (or trains nothing); now and then it resumed from
            # an older checkpoint, or the coordinator asks where it stands
            trainer = rng.choice([trainer + 1, trainer + 1, trainer, max(trainer - rng.randint(1, 5), 0)])
            answered = rng.random() < 0.8
            want = steps_after_train_step(model, trainer) if answered else steps_held(model, trainer)
            assert await store.realign(run_id, trainer, answered) == (len(model), len(want))
            model = want
            assert await store.train_steps(run_id) == model
            assert (await store.get(run_id))["rollout_id"] == max(len(model) - 2, 0)
        await store.delete(run_id)
        assert not [k async for k in redis.scan_iter("test:coord:run:*")]
        await redis.aclose()

    loop_thread.run(scenario())


def test_a_record_written_before_the_list_existed_is_read_and_carried_on(loop_thread, redis_url):
    async def scenario() -> None:
        redis = aioredis.Redis.from_url(redis_url)
        store = RunStore(redis, "test")
        run_id = (await store.create(RunConfig.model_validate(CONFIG))).id
        await redis.hset(f"test:coord:run:{run_id}", "train_steps", json.dumps([1, 2, 3, 4, 5]))
        assert (await store.get(run_id))["rollout_id"] == 3
        assert (await store.list())[0]["rollout_id"] == 3
        assert await store.train_steps(run_id) == [1, 2, 3, 4, 5]
        assert await store.realign(run_id, 3, answered=False) == (5, 3)  # resumed from step 3
        assert not await redis.hexists(f"test:coord:run:{run_id}", "train_steps")  # moved to the list
        assert await store.train_steps(run_id) == [1, 2, 3]
        assert await store.realign(run_id, 4, answered=True) == (3, 4)
        assert (await store.get(run_id))["rollout_id"] == 2
        await store.delete(run_id)
        await redis.aclose()

    loop_thread.run(scenario())


def test_the_queue_starts_its_runs_in_order_each_with_the_claim(loop_thread, redis_url):
    async def scenario() -> None:
        redis = aioredis.Redis.from_url(redis_url)
        store = RunStore(redis, "queue", max_queued=3)
        config = RunConfig.model_validate(CONFIG)
        a, b, c, d = [await store.create(config) for _ in range(4)]
        assert (a.status, b.status, c.status, d.status) == ("pending", "queued", "queued", "queued")
        assert [b.queue_position, c.queue_position, d.queue_position] == [1, 2, 3]
        with pytest.raises(FailedPrecondition, match="queue is full"):
            await store.create(config)  # (the bound: 3 wait)
        assert await store.move(d.id, 1) == 1
        assert await store.queue() == [d.id, b.id, c.id]
        assert await store.move(b.id, 99) == 3  # past the end: last
        assert await store.queue() == [d.id, c.id, b.id]
        with pytest.raises(FailedPrecondition, match="only a queued run"):
            await store.move(a.id, 1)
        assert await store.delete_queued(c.id) == "deleted"
        assert await store.queue() == [d.id, b.id]
        # the active run holds the claim: nothing starts until it releases it (a run never set up
        # is answered: its caller starts it unless it runs)
        assert await store.release_and_promote("") == a.id
        await store.update(a.id, status="running")
        assert await store.release_and_promote("") == ""
        await store.update(a.id, status="completed")
        assert await store.release_and_promote(a.id) == d.id
        assert (await store.get(d.id))["status"] == "pending" and (await store.active())[0] == d.id
        assert (await store.get(b.id))["queue_position"] == 1
        e = await store.create(config)  # behind b, not ahead of it
        assert (e.status, e.queue_position) == ("queued", 2)
        assert await store.mark_stopping(b.id) == "stopped"  # a queued run stops at once, off the queue
        assert await store.queue() == [e.id]
        await store.update(d.id, status="failed")
        assert await store.release_and_promote(d.id) == e.id
        assert await store.queue() == [] and (await store.active())[0] == e.id
        await redis.aclose()

    loop_thread.run(scenario())


def test_a_call_repeated_after_its_reply_was_lost_answers_as_the_first(loop_thread, redis_url, monkeypatch):
    """The driver's Redis client sends a command again when the connection drops before its
    reply (Redis may have run it): a train step is recorded once, and a run the first call
    promoted from the queue is answered again, so that it is started."""

    async def scenario() -> None:
        redis = aioredis.Redis.from_url(redis_url)
        store = RunStore(redis, "repeat")
        config = RunConfig.model_validate(CONFIG)
        a, b = await store.create(config), await store.create(config)
        monkeypatch.setattr(store_module.uuid, "uuid4", lambda: uuid.UUID(int=1))  # (one call, sent twice)
        assert await store.realign(a.id, 1, answered=True) == (0, 1)
        assert await store.realign(a.id, 1, answered=True) == (0, 1)
        assert await store.train_steps(a.id) == [1]
        monkeypatch.undo()
        assert await store.realign(a.id, 1, answered=True) == (1, 2)  # another call: another step
        assert "realign_call" not in await store.get(a.id)
        await store.update(a.id, status="completed")
        assert await store.release_and_promote(a.id) == b.id
        assert await store.release_and_promote(a.id) == b.id  # (b pending, never set up)
        await redis.aclose()

    loop_thread.run(scenario())


def test_when_each_environment_was_last_heard_from_is_kept_with_the_run(loop_thread, redis_url):
    async def scenario() -> None:
        redis = aioredis.Redis.from_url(redis_url)
        store = RunStore(redis, "heard")
        run_id = (await store.create(RunConfig.model_validate(CONFIG))).id
        assert await store.environments_seen(run_id) == {}
        await store.environments_heard(run_id, {0, 2})
        seen = await store.environments_seen(run_id)
        assert sorted(seen) == [0, 2] and all(time.time() - t < 60 for t in seen.values())
        await store.update(run_id, status="completed")
        await store.delete(run_id)
        assert not [k async for k in redis.scan_iter("heard:coord:run:*")]
        await redis.aclose()

    loop_thread.run(scenario())


def test_with_no_queue_a_second_run_is_refused(loop_thread, redis_url):
    async def scenario() -> None:
        redis = aioredis.Redis.from_url(redis_url)
        store = RunStore(redis, "noqueue", max_queued=0)
        first = await store.create(RunConfig.model_validate(CONFIG))
        with pytest.raises(FailedPrecondition, match=f"run {first.id} is still active; stop it first"):
            await store.create(RunConfig.model_validate(CONFIG))
        await redis.aclose()

    loop_thread.run(scenario())


def test_a_record_that_redis_lost_is_not_written_into(loop_thread, redis_url):
    """After a Redis that lost the run (wiped, a failover to a replica without it), the run
    driver's writes make no record of a few fields (which the API answered with a 500): the
    run stays unknown (404)."""

    async def scenario() -> None:
        redis = aioredis.Redis.from_url(redis_url)
        store = RunStore(redis, "test")
        run_id = (await store.create(RunConfig.model_validate(CONFIG))).id
        await store.update(run_id, waiting_for="the trainer", eval_before={"eval/reward": 0.5})
        await store.count(run_id, "environment_groups_received", 3)
        record = await store.get(run_id)
        assert (record["waiting_for"], record["eval_before"]) == ("the trainer", {"eval/reward": 0.5})
        assert record["environment_groups_received"] == "3"  # (the API converts its counters)

        await redis.delete(f"test:coord:run:{run_id}")
        writes = (
            store.update(run_id, status="failed", waiting_for=""),
            store.count(run_id, "x"),
            store.append_metrics(run_id, {"rollout_id": 1}),
        )
        for write in writes:
            with pytest.raises(NotFound, match=run_id):
                await write
        assert not await redis.exists(f"test:coord:run:{run_id}", f"test:coord:run:{run_id}:metrics")
        with pytest.raises(NotFound):
            await store.get(run_id)
        await redis.aclose()

    loop_thread.run(scenario())
