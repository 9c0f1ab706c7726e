"""The buffer's plain logic over Redis. Every move of a group between states is one
atomic step in Redis (a Lua script or an ownership-claiming ZREM), so several buffer
replicas can serve one Redis and a crash at any point loses nothing.

Keys of a run live under `<prefix>:run:<run_id>:`:
  spec            run spec (JSON)              data:<dataset>  prompt records (list of JSON)
  cursor          hash: <dataset> -> prompts drawn so far; __groups__ -> next group index
  prompts         hash: group_id -> handed-out prompt group (bytes)
  prompt_leases   zset: group_id -> lease expiry (unix seconds)
  partial         list of group ids + partial_groups hash: aborted groups waiting to resume
  groups          hash: group_id -> completed SampleGroup (bytes), until acknowledged
  queue           list of completed group ids waiting for training (FIFO)
  batch_leases    zset: lease_id -> expiry;  batch:<lease_id>  list of its group ids
  acked           set of acknowledged group ids (never delivered or stored again)
  stats           hash of counters
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass

import numpy as np
import redis.asyncio as aioredis

from rlmesh.v1 import buffer_pb2, sample_pb2
from services.buffer.datasets import epoch_order, load_records, record_to_samples
from services.common.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, Unimplemented
from services.common.sample import group_to_proto, SampleGroup, validate_group_proto

# Store completed groups all-or-nothing: skip duplicates (already stored, leased or
# acknowledged), refuse the whole write when it would pass the queue cap.
_PUT_GROUPS = """
local groups, queue, acked, prompt_leases, prompts, stats = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local cap = tonumber(ARGV[1])
local fresh = {}
for i = 2, #ARGV, 2 do
  local id = ARGV[i]
  if redis.call('SISMEMBER', acked, id) == 0 and redis.call('HEXISTS', groups, id) == 0 and not fresh[id] then
    fresh[id] = ARGV[i + 1]
    fresh[#fresh + 1] = id
  end
end
if cap > 0 and redis.call('LLEN', queue) + #fresh > cap then return -1 end
for _, id in ipairs(fresh) do
  redis.call('HSET', groups, id, fresh[id])
  redis.call('RPUSH', queue, id)
end
for i = 2, #ARGV, 2 do
  redis.call('ZREM', prompt_leases, ARGV[i])
  redis.call('HDEL', prompts, ARGV[i])
end
redis.call('HINCRBY', stats, 'groups_written', #fresh)
return #fresh
"""

# Lease exactly n groups or none.
_LEASE = """
local queue, leases, lease_list = KEYS[1], KEYS[2], KEYS[3]
local n = tonumber(ARGV[1])
if redis.call('LLEN', queue) < n then return {} end
local ids = redis.call('LPOP', queue, n)
redis.call('RPUSH', lease_list, unpack(ids))
redis.call('ZADD', leases, ARGV[3], ARGV[2])
return ids
"""

_ACK = """
local leases, lease_list, groups, acked, stats = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
if not redis.call('ZSCORE', leases, ARGV[1]) then return -1 end
local ids = redis.call('LRANGE', lease_list, 0, -1)
for _, id in ipairs(ids) do
  redis.call('HDEL', groups, id)
  redis.call('SADD', acked, id)
end
redis.call('ZREM', leases, ARGV[1])
redis.call('DEL', lease_list)
redis.call('HINCRBY', stats, 'acknowledged_groups', #ids)
return #ids
"""

# Expired batch leases go back to the front of the queue, in their original order.
_REQUEUE_EXPIRED = """
local leases, queue, stats = KEYS[1], KEYS[2], KEYS[3]
local expired = redis.call('ZRANGEBYSCORE', leases, '-inf', ARGV[1])
for _, lease_id in ipairs(expired) do
  local list = ARGV[2] .. lease_id
  local ids = redis.call('LRANGE', list, 0, -1)
  for i = #ids, 1, -1 do redis.call('LPUSH', queue, ids[i]) end
  redis.call('DEL', list)
  redis.call('ZREM', leases, lease_id)
  redis.call('HINCRBY', stats, 'redelivered_groups', #ids)
end
return #expired
"""


@dataclass(frozen=True)
class RunKeys:
    base: str

    def __getattr__(self, name: str) -> str:  # keys.queue -> "<base>queue"
        if name.startswith("_"):
            raise AttributeError(name)
        return self.base + name

    def data(self, dataset: str) -> str:
        return f"{self.base}data:{dataset}"

    def batch(self, lease_id: str) -> str:
        return f"{self.base}batch:{lease_id}"


class BufferStore:
    def __init__(self, redis: aioredis.Redis, key_prefix: str = "rlmesh") -> None:
        self.redis = redis
        self.key_prefix = key_prefix
        self._put = redis.register_script(_PUT_GROUPS)
        self._lease = redis.register_script(_LEASE)
        self._ack = redis.register_script(_ACK)
        self._requeue = redis.register_script(_REQUEUE_EXPIRED)

    def keys(self, run_id: str) -> RunKeys:
        if not run_id:
            raise InvalidArgument("run_id is required")
        return RunKeys(f"{self.key_prefix}:run:{run_id}:")

    async def _spec(self, run_id: str) -> dict:
        raw = await self.redis.get(self.keys(run_id).spec)
        if raw is None:
            raise NotFound(f"unknown run {run_id!r}: create it with CreateRun first")
        return json.loads(raw)

    # ---- runs ---------------------------------------------------------------------------

    async def create_run(self, req: buffer_pb2.CreateRunRequest) -> bool:
        k = self.keys(req.run_id)
        if req.n_samples_per_prompt < 1:
            raise InvalidArgument("n_samples_per_prompt must be at least 1")
        if not any(not d.eval for d in req.datasets):
            raise InvalidArgument("a run needs at least one training dataset (eval = false)")
        datasets = []
        for d in req.datasets:
            if not d.name:
                raise InvalidArgument("every dataset needs a name")
            if d.weight < 0:
                raise InvalidArgument(f"dataset {d.name!r}: weight must not be negative")
            datasets.append({
                "name": d.name, "path": d.path, "prompt_key": d.prompt_key or "prompt",
                "label_key": d.label_key or "label", "metadata_key": d.metadata_key,
                "weight": d.weight or 1.0, "shuffle": d.shuffle, "seed": d.seed, "eval": d.eval,
            })
        spec = {"datasets": datasets, "n_samples_per_prompt": req.n_samples_per_prompt,
                "max_queued_groups": req.max_queued_groups}
        existing = await self.redis.get(k.spec)
        if existing is not None:
            old = json.loads(existing)
            if {kk: v for kk, v in old.items() if kk != "sizes"} != spec:
                raise FailedPrecondition(f"run {req.run_id!r} exists with a different spec; delete it first")
            return False
        sizes = {}
        for d in datasets:
            records = load_records(d["name"], d["path"], d["prompt_key"], d["label_key"], d["metadata_key"])
            pipe = self.redis.pipeline(transaction=True)
            pipe.delete(k.data(d["name"]))
            for start in range(0, len(records), 1000):
                pipe.rpush(k.data(d["name"]), *[json.dumps(r) for r in records[start:start + 1000]])
            await pipe.execute()
            sizes[d["name"]] = len(records)
        spec["sizes"] = sizes
        # SET NX: of two replicas racing to create the same run, one wins; same data either way.
        await self.redis.set(k.spec, json.dumps(spec), nx=True)
        return True

    async def delete_run(self, run_id: str) -> int:
        base = self.keys(run_id).base
        deleted = 0
        async for key in self.redis.scan_iter(match=base + "*", count=1000):
            deleted += await self.redis.delete(key)
        return deleted

    # ---- prompts ------------------------------------------------------------------------

    async def get_prompts(self, run_id: str, num_groups: int, lease_seconds: float) -> list[sample_pb2.SampleGroup]:
        if num_groups < 1:
            raise InvalidArgument("num_groups must be at least 1")
        spec = await self._spec(run_id)
        k = self.keys(run_id)
        out: list[sample_pb2.SampleGroup] = []
        now = time.time()

        # 1. prompts whose worker died (lease expired): claim each with ZREM, then re-lease.
        for gid in await self.redis.zrangebyscore(k.prompt_leases, "-inf", now, start=0, num=num_groups):
            if await self.redis.zrem(k.prompt_leases, gid):
                raw = await self.redis.hget(k.prompts, gid)
                if raw is not None:
                    out.append(sample_pb2.SampleGroup.FromString(raw))
                    await self.redis.hincrby(k.stats, "prompts_reissued", 1)
        # 2. partial groups, to resume where they stopped.
        while len(out) < num_groups:
            gid = await self.redis.lpop(k.partial)
            if gid is None:
                break
            raw = await self.redis.hget(k.partial_groups, gid)
            await self.redis.hdel(k.partial_groups, gid)
            if raw is not None:
                out.append(sample_pb2.SampleGroup.FromString(raw))
        # 3. fresh prompts from the cursor.
        fresh = num_groups - len(out)
        if fresh > 0:
            out.extend(await self._draw_fresh(run_id, spec, fresh))

        pipe = self.redis.pipeline(transaction=True)
        expiry = now + lease_seconds
        for g in out:
            pipe.hset(k.prompts, g.group_id, g.SerializeToString())
            pipe.zadd(k.prompt_leases, {g.group_id: expiry})
        pipe.hincrby(k.stats, "prompts_handed_out", len(out))
        await pipe.execute()
        return out

    async def _draw_fresh(self, run_id: str, spec: dict, count: int) -> list[sample_pb2.SampleGroup]:
        k = self.keys(run_id)
        train = [d for d in spec["datasets"] if not d["eval"]]
        first_group = await self.redis.hincrby(k.cursor, "__groups__", count) - count
        group_indices = list(range(first_group, first_group + count))
        # Which dataset each group draws from: weighted, deterministic in the group index.
        weights = np.array([d["weight"] for d in train], dtype=float)
        weights /= weights.sum()
        picks = [
            train[int(np.random.default_rng([train[0]["seed"], gi]).choice(len(train), p=weights))]
            if len(train) > 1 else train[0]
            for gi in group_indices
        ]
        n = spec["n_samples_per_prompt"]
        groups = []
        for d in train:
            mine = [gi for gi, p in zip(group_indices, picks) if p is d]
            if not mine:
                continue
            end = await self.redis.hincrby(k.cursor, d["name"], len(mine))
            size = spec["sizes"][d["name"]]
            for gi, pos in zip(mine, range(end - len(mine), end)):
                epoch, offset = divmod(pos, size)
                row = int(epoch_order(size, d["seed"], epoch, d["shuffle"])[offset])
                record = json.loads(await self.redis.lindex(k.data(d["name"]), row))
                samples = record_to_samples(record, gi, n, d["name"])
                groups.append(group_to_proto(SampleGroup(f"g{gi}", gi, samples, d["name"])))
        groups.sort(key=lambda g: g.group_index)
        return groups

    async def get_eval_prompts(self, req: buffer_pb2.GetEvalPromptsRequest) -> list[sample_pb2.SampleGroup]:
        spec = await self._spec(req.run_id)
        by_name = {d["name"]: d for d in spec["datasets"]}
        if req.dataset not in by_name:
            raise NotFound(f"run {req.run_id!r} has no dataset {req.dataset!r}; it has {sorted(by_name)}")
        n = req.n_samples_per_prompt or 1
        stop = -1 if req.limit <= 0 else req.offset + req.limit - 1
        rows = await self.redis.lrange(self.keys(req.run_id).data(req.dataset), req.offset, stop)
        groups = []
        for i, raw in enumerate(rows, start=req.offset):
            samples = record_to_samples(json.loads(raw), i, n, req.dataset)
            groups.append(group_to_proto(SampleGroup(f"eval:{req.dataset}:{i}", i, samples, req.dataset)))
        return groups

    # ---- completed and partial groups ---------------------------------------------------

    async def put_groups(self, run_id: str, groups) -> tuple[int, int]:
        if not groups:
            raise InvalidArgument("PutGroups needs at least one group")
        spec = await self._spec(run_id)
        for g in groups:
            validate_group_proto(g)
        k = self.keys(run_id)
        args: list = [spec["max_queued_groups"]]
        for g in groups:
            args += [g.group_id, g.SerializeToString()]
        keys = [k.groups, k.queue, k.acked, k.prompt_leases, k.prompts, k.stats]
        stored = await self._put(keys=keys, args=args)
        if stored < 0:
            queued = await self.redis.llen(k.queue)
            raise ResourceExhausted(
                f"run {run_id!r}: the buffer holds {queued} queued groups and its cap is "
                f"{spec['max_queued_groups']}; retry after the trainer has consumed some"
            )
        return stored, len(groups) - stored

    async def return_partial_groups(self, run_id: str, groups) -> int:
        if not groups:
            raise InvalidArgument("ReturnPartialGroups needs at least one group")
        await self._spec(run_id)
        k = self.keys(run_id)
        pipe = self.redis.pipeline(transaction=True)
        for g in groups:
            validate_group_proto(g)
            pipe.hset(k.partial_groups, g.group_id, g.SerializeToString())
            pipe.rpush(k.partial, g.group_id)
            pipe.zrem(k.prompt_leases, g.group_id)
            pipe.hdel(k.prompts, g.group_id)
        await pipe.execute()
        return len(groups)

    async def drop_groups(self, run_id: str, group_ids, reason: str) -> int:
        if not group_ids:
            raise InvalidArgument("DropGroups needs at least one group id")
        await self._spec(run_id)
        k = self.keys(run_id)
        pipe = self.redis.pipeline(transaction=True)
        for gid in group_ids:
            pipe.zrem(k.prompt_leases, gid)
            pipe.hdel(k.prompts, gid)
        pipe.hincrby(k.stats, "dropped_groups", len(group_ids))
        pipe.hincrby(k.stats, f"dropped:{reason or 'unspecified'}", len(group_ids))
        await pipe.execute()
        return len(group_ids)

    # ---- training batches ---------------------------------------------------------------

    async def lease_batch(self, req: buffer_pb2.LeaseBatchRequest, default_lease: float, poll: float):
        if req.num_groups < 1:
            raise InvalidArgument("num_groups must be at least 1")
        if req.min_weight_version:
            raise Unimplemented("min_weight_version (staleness bound) is not implemented yet")
        await self._spec(req.run_id)
        k = self.keys(req.run_id)
        deadline = time.monotonic() + max(req.wait_seconds, 0.0)
        lease_id = uuid.uuid4().hex
        while True:
            await self._requeue(keys=[k.batch_leases, k.queue, k.stats], args=[time.time(), k.batch("")])
            expiry = time.time() + (req.lease_seconds or default_lease)
            ids = await self._lease(keys=[k.queue, k.batch_leases, k.batch(lease_id)],
                                    args=[req.num_groups, lease_id, expiry])
            if ids:
                raws = await self.redis.hmget(k.groups, ids)
                return lease_id, [sample_pb2.SampleGroup.FromString(r) for r in raws if r is not None]
            if time.monotonic() >= deadline:
                return "", []
            await asyncio.sleep(poll)

    async def ack_batch(self, run_id: str, lease_id: str) -> int:
        if not lease_id:
            raise InvalidArgument("lease_id is required")
        await self._spec(run_id)
        k = self.keys(run_id)
        n = await self._ack(keys=[k.batch_leases, k.batch(lease_id), k.groups, k.acked, k.stats], args=[lease_id])
        if n < 0:
            raise NotFound(f"lease {lease_id!r} of run {run_id!r} is unknown or has expired (its groups were redelivered)")
        return n

    async def stats(self, run_id: str) -> buffer_pb2.BufferStats:
        spec = await self._spec(run_id)
        k = self.keys(run_id)
        pipe = self.redis.pipeline(transaction=False)
        pipe.llen(k.queue)
        pipe.hlen(k.groups)
        pipe.llen(k.partial)
        pipe.hgetall(k.stats)
        pipe.hgetall(k.cursor)
        queued, stored, partial, counters, cursor = await pipe.execute()
        counters = {kk.decode(): int(v) for kk, v in counters.items()}
        first = next(d for d in spec["datasets"] if not d["eval"])
        drawn = int(cursor.get(first["name"].encode(), 0))
        epoch, offset = divmod(drawn, spec["sizes"][first["name"]])
        return buffer_pb2.BufferStats(
            queued_groups=queued,
            leased_groups=stored - queued,
            partial_groups=partial,
            acknowledged_groups=counters.get("acknowledged_groups", 0),
            dropped_groups=counters.get("dropped_groups", 0),
            prompts_handed_out=counters.get("prompts_handed_out", 0),
            epoch=epoch,
            offset=offset,
            next_sample_index=int(cursor.get(b"__groups__", 0)) * spec["n_samples_per_prompt"],
            groups_written=counters.get("groups_written", 0),
            redelivered_groups=counters.get("redelivered_groups", 0),
        )

