"""The coordinator's run records in Redis, so that a restarted coordinator carries on: one
hash per run, its metric history, its train steps, the environments registered with it, an
index by creation time, and the claim of the one run that may train."""

from __future__ import annotations

import functools
import json
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import WatchError

from rlmesh.common.errors import FailedPrecondition, NotFound
from rlmesh.common.run_config import RunConfig

ACTIVE = ("pending", "running", "paused", "stopping")
FINAL = ("completed", "stopped", "failed")
QUEUED = "queued"  # waits for the active run to end; holds no claim
MAX_QUEUED_DEFAULT = 20


# Lua shared by the scripts that create, end and promote runs. active_holder: the claim's
# holder if it is an active, indexed run, else nil (a claim held by a finished run, by a run
# whose record is gone, or by one never indexed is stale; an unindexed record is deleted:
# its creator died half way, when creation took three writes). promote: the queue's first
# run that is still queued becomes pending and takes the claim, in the same script that
# found the claim free, so no second run can win it meanwhile; '' when none is queued.
_QUEUE_LIB = """
local function active_holder(claim, index, prefix, statuses)
  local holder = redis.call('GET', claim)
  if not holder then return nil end
  local status = redis.call('HGET', prefix .. holder, 'status')
  local indexed = redis.call('ZSCORE', index, holder)
  if status and indexed then
    for _, s in ipairs(statuses) do if status == s then return holder end end
  end
  if status and not indexed then redis.call('DEL', prefix .. holder) end
  return nil
end
-- The claim's holder if it is a run promoted or created but never set up ('pending'): a
-- retried call whose first attempt promoted it (its reply lost) answers it again, and the
-- caller starts it unless it already runs. '' otherwise.
local function pending_holder(claim, index, prefix, statuses)
  local holder = active_holder(claim, index, prefix, statuses)
  if holder and redis.call('HGET', prefix .. holder, 'status') == 'pending' then return holder end
  return ''
end
local function promote(claim, queue, prefix, now)
  while true do
    local head = redis.call('LPOP', queue)
    if not head then return '' end
    if redis.call('HGET', prefix .. head, 'status') == 'queued' then
      redis.call('HSET', prefix .. head, 'status', 'pending', 'phase', 'setup', 'updated_at', now)
      redis.call('SET', claim, head)
      return head
    end
  end
end
"""

# Create a run. KEYS: its record, the claim, the index, the queue. ARGV: its id, its creation
# time, the prefix of run records, the queue's bound, the number n of active statuses, those
# statuses, then the record's fields and values. The run takes the claim when no active run
# holds it and none is queued; else it joins the queue's end (a queue that is not empty with
# the claim free, seen only after a coordinator restart, starts its first run here). Returns
# {status, queue position (0 when not queued), the run promoted from the queue ('' none),
# the active run's id}; status 'full' when the queue holds its bound. A retried call that
# had succeeded (the record exists) answers what the run is now.
_CREATE = (
    _QUEUE_LIB
    + """
local n = tonumber(ARGV[5])
local statuses = {}
for i = 6, 5 + n do statuses[#statuses + 1] = ARGV[i] end
local mine = redis.call('HGET', KEYS[1], 'status')
if mine then
  local pos = redis.call('LPOS', KEYS[4], ARGV[1])
  return {mine, pos and pos + 1 or 0, pending_holder(KEYS[2], KEYS[3], ARGV[3], statuses), ''}
end
local holder = active_holder(KEYS[2], KEYS[3], ARGV[3], statuses)
local waiting = redis.call('LLEN', KEYS[4])
if not holder and waiting == 0 then
  redis.call('HSET', KEYS[1], unpack(ARGV, 6 + n))
  redis.call('SET', KEYS[2], ARGV[1])
  redis.call('ZADD', KEYS[3], ARGV[2], ARGV[1])
  return {'pending', 0, '', ''}
end
if waiting >= tonumber(ARGV[4]) then return {'full', waiting, '', holder or ''} end
redis.call('HSET', KEYS[1], unpack(ARGV, 6 + n))
redis.call('HSET', KEYS[1], 'status', 'queued', 'phase', 'queued')
redis.call('ZADD', KEYS[3], ARGV[2], ARGV[1])
redis.call('RPUSH', KEYS[4], ARGV[1])
local promoted = ''
if not holder then promoted = promote(KEYS[2], KEYS[4], ARGV[3], ARGV[2]) end
local pos = redis.call('LPOS', KEYS[4], ARGV[1])
local status = redis.call('HGET', KEYS[1], 'status')
return {status, pos and pos + 1 or 0, promoted, holder or ''}
"""
)

# Release the claim if run ARGV[1] holds it, then, with no active run holding it, start the
# queue's next run (promote). KEYS: the claim, the index, the queue. ARGV: the run's id (''
# at a coordinator's start: only promote), the prefix of run records, the time, the active
# statuses. Returns the promoted run's id (or a pending holder's: pending_holder), or ''.
_RELEASE_AND_PROMOTE = (
    _QUEUE_LIB
    + """
if ARGV[1] ~= '' and redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
local statuses = {}
for i = 4, #ARGV do statuses[#statuses + 1] = ARGV[i] end
if active_holder(KEYS[1], KEYS[2], ARGV[2], statuses) then return pending_holder(KEYS[1], KEYS[2], ARGV[2], statuses) end
return promote(KEYS[1], KEYS[3], ARGV[2], ARGV[3])
"""
)

# Move queued run ARGV[1] to 1-based position ARGV[2] of the queue (past its end: the end).
# KEYS: its record, the queue. Returns {status, its position}; position 0 when it is not
# queued (the status says what it is; false: no such run).
_MOVE = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return false end
if status ~= 'queued' then return {status, 0} end
redis.call('LREM', KEYS[2], 0, ARGV[1])
local len = redis.call('LLEN', KEYS[2])
local pos = tonumber(ARGV[2])
if pos > len then
  redis.call('RPUSH', KEYS[2], ARGV[1])
  return {status, len + 1}
end
redis.call('LINSERT', KEYS[2], 'BEFORE', redis.call('LINDEX', KEYS[2], pos - 1), ARGV[1])
return {status, pos}
"""

# Forget run ARGV[1] if it is still queued: off the queue, its record and index entry gone
# (a queued run has nothing anywhere else). KEYS: its record, its metrics, its train steps,
# the index, the queue. Returns 'deleted', or the status it has (false: no such run).
_DELETE_QUEUED = """
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'queued' then return status end
redis.call('LREM', KEYS[5], 0, ARGV[1])
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
redis.call('ZREM', KEYS[4], ARGV[1])
return 'deleted'
"""

# RPUSH to the list KEYS[1] of the run whose record is KEYS[2] (-1: no such record), unless the
# list already ends with this element (a retried call that had succeeded).
_APPEND_ONCE = """
if redis.call('EXISTS', KEYS[2]) == 0 then return -1 end
if redis.call('LINDEX', KEYS[1], -1) == ARGV[1] then return 0 end
return redis.call('RPUSH', KEYS[1], ARGV[1])
"""

# HSET (ARGV: field, value, ...) or HINCRBY (ARGV: field, increment) into the run's record
# KEYS[1] only while it exists: after a Redis that lost it (wiped, or a failover to a replica
# without it), a write would leave a record of a few fields, which the API cannot show.
# Returns 0 when there is no record.
_UPDATE = "if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end redis.call('HSET', KEYS[1], unpack(ARGV)) return 1"
_COUNT = (
    "if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end redis.call('HINCRBY', KEYS[1], ARGV[1], ARGV[2]) return 1"
)

# Record where the trainer stands after a train step (ARGV[2] = '1': it answered that it left
# the trainer at step ARGV[1]) or when asked (ARGV[2] = '0'), on the run's train steps list
# (KEYS[2]; KEYS[1] is its record): the list is nondecreasing, so keeping the steps at or
# before ARGV[1] is trimming its tail, O(steps undone) instead of O(run) (see
# runs.steps_after_train_step and steps_held, the same rule on a Python list). A record
# written before the list existed keeps its steps as JSON in its hash: moved to the list
# first. ARGV[3]: the time, the record's updated_at; ARGV[4]: the call's id (a repeat of the
# last call changes nothing and answers as it did). Returns {length before, length after}.
_REALIGN = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {0, 0} end
if redis.call('HGET', KEYS[1], 'realign_call') == ARGV[4] then  -- a retried call (its reply lost): done
  return {tonumber(redis.call('HGET', KEYS[1], 'realign_before')), redis.call('LLEN', KEYS[2])}
end
local legacy = redis.call('HGET', KEYS[1], 'train_steps')
if legacy then
  redis.call('DEL', KEYS[2])
  for _, s in ipairs(cjson.decode(legacy)) do redis.call('RPUSH', KEYS[2], s) end
  redis.call('HDEL', KEYS[1], 'train_steps')
end
local step = tonumber(ARGV[1])
local before = redis.call('LLEN', KEYS[2])
local last = 0
while true do
  local tail = redis.call('LINDEX', KEYS[2], -1)
  if not tail then break end
  if tonumber(tail) <= step then last = tonumber(tail) break end
  redis.call('RPOP', KEYS[2])
end
if ARGV[2] == '1' or step > last then redis.call('RPUSH', KEYS[2], ARGV[1]) end
redis.call('HSET', KEYS[1], 'updated_at', ARGV[3], 'realign_call', ARGV[4], 'realign_before', before)
return {before, redis.call('LLEN', KEYS[2])}
"""

# Set status 'stopping' unless the run has finished; returns the status it now has. KEYS: the
# run's record, the queue; ARGV: its id, the time, the final statuses. A queued run (it never
# started) is stopped at once and leaves the queue.
_MARK_STOPPING = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return false end
for i = 3, #ARGV do if status == ARGV[i] then return status end end
if status == 'queued' then
  redis.call('LREM', KEYS[2], 0, ARGV[1])
  redis.call('HSET', KEYS[1], 'status', 'stopped', 'error', 'stopped before it started (it was queued)',
    'updated_at', ARGV[2])
  return 'stopped'
end
redis.call('HSET', KEYS[1], 'status', 'stopping', 'updated_at', ARGV[2])
return 'stopping'
"""

# Set status ARGV[#ARGV - 1] if the status is one of ARGV[1 .. #ARGV - 2]; returns the status
# the run now has (false: no such run).
_TRANSITION = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return false end
for i = 1, #ARGV - 2 do
  if status == ARGV[i] then
    redis.call('HSET', KEYS[1], 'status', ARGV[#ARGV - 1], 'updated_at', ARGV[#ARGV])
    return ARGV[#ARGV - 1]
  end
end
return status
"""


@dataclass(frozen=True)
class Created:
    """What POST /runs made: the run's id and status ('pending', or 'queued' at
    `queue_position`, 1 = next), and a queued run that its call started (after a restart)."""

    id: str
    status: str
    queue_position: int | None = None
    promoted: str = ""


# A page of runs. KEYS: the index, the queue. ARGV: the prefix of run records, ZRANGE's start
# and stop. Returns how many runs are indexed, then for each run of the page that has a record:
# its record (HGETALL's), the length of its train steps list and its index in the queue (nil:
# not queued).
_READ_RUNS = """
local out = {redis.call('ZCARD', KEYS[1])}
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], ARGV[2], ARGV[3])) do
  local key = ARGV[1] .. id
  local fields = redis.call('HGETALL', key)
  if #fields > 0 then
    out[#out + 1] = {fields, redis.call('LLEN', key .. ':train_steps'), redis.call('LPOS', KEYS[2], id)}
  end
end
return out
"""


class RunStore:
    """Run records: hash <prefix>:coord:run:<id>, metric history list ...:metrics, the
    trainer's step after each of the run's train steps, list ...:train_steps, an index zset
    <prefix>:coord:runs (by creation time), <prefix>:coord:active, the id of the one run that
    may train (claimed atomically, so concurrent submissions cannot both win), and
    <prefix>:coord:queue, the ids of the runs waiting for it, in order (at most max_queued)."""

    def __init__(self, redis: aioredis.Redis, prefix: str, max_queued: int = MAX_QUEUED_DEFAULT) -> None:
        self.redis = redis
        self.prefix = f"{prefix}:coord:"
        self.active_key = self.prefix + "active"
        self.index_key = self.prefix + "runs"
        self.queue_key = self.prefix + "queue"
        self.max_queued = max_queued

    def _key(self, run_id: str) -> str:
        return f"{self.prefix}run:{run_id}"

    async def create(self, config: RunConfig) -> Created:
        """A new run: pending when no other run is active and none waits, else queued (its
        record, the claim or its place in the queue, and the index are one script, so no
        crash leaves a claim without its run). FailedPrecondition (409) when the queue holds
        max_queued runs."""
        run_id = uuid.uuid4().hex[:12]
        now = time.time()
        record = {
            "id": run_id,
            "name": config.name,
            "config": config.model_dump_json(),
            "status": "pending",
            "phase": "setup",
            "weight_version": 0,
            "created_at": now,
            "updated_at": now,
            "error": "",
            "waiting_for": "",
            "eval_before": "{}",
            "eval_after": "{}",
            "held": 0,
            # The trajectory API's per-run capability: whoever holds its URL may post groups.
            "capability": secrets.token_urlsafe(24) if config.source == "environments" else "",
        }
        fields = [item for pair in record.items() for item in pair]
        keys = (self._key(run_id), self.active_key, self.index_key, self.queue_key)
        status, position, promoted, holder = await self.redis.eval(
            _CREATE, 4, *keys, run_id, now, self._key(""), self.max_queued, len(ACTIVE), *ACTIVE, *fields
        )
        status, holder = status.decode(), holder.decode()
        if status == "full":
            if not self.max_queued:
                raise FailedPrecondition(
                    f"run {holder} is still active; stop it first (one run trains at a time, and this "
                    "coordinator queues none: max_queued_runs is 0)"
                )
            raise FailedPrecondition(
                f"the run queue is full ({position} runs wait, max_queued_runs={self.max_queued}): delete a "
                "queued run (DELETE /runs/{id}) or wait until one starts"
            )
        return Created(run_id, status, position or None, promoted.decode())

    async def mark_stopping(self, run_id: str) -> str:
        """Ask a run to stop ('stopping'); a queued run is 'stopped' at once, off the queue; a
        finished run keeps its status. Returns the status it has now."""
        status = await self.redis.eval(
            _MARK_STOPPING, 2, self._key(run_id), self.queue_key, run_id, time.time(), *FINAL
        )
        if not status:
            raise NotFound(f"unknown run {run_id!r}")
        return status.decode()

    async def release_and_promote(self, run_id: str = "") -> str:
        """Release the claim if `run_id` holds it and, with no active run, make the queue's
        next run pending with the claim (one script: the one-active-run claim stays atomic).
        The id of the run to start, or ''."""
        promoted = await self.redis.eval(
            _RELEASE_AND_PROMOTE, 3, self.active_key, self.index_key, self.queue_key, run_id, self._key(""),
            time.time(), *ACTIVE,
        )  # fmt: skip
        return promoted.decode()

    async def move(self, run_id: str, position: int) -> int:
        """Put a queued run at `position` (1 = next; past the end = last); its position now.
        FailedPrecondition (409) for a run that is not queued."""
        answer = await self.redis.eval(_MOVE, 2, self._key(run_id), self.queue_key, run_id, position)
        if not answer:
            raise NotFound(f"unknown run {run_id!r}")
        status, now_at = answer[0].decode(), int(answer[1])
        if status != "queued":
            raise FailedPrecondition(f"run {run_id} is {status}; only a queued run can be moved in the queue")
        return now_at

    async def delete_queued(self, run_id: str) -> str:
        """Forget a run if it is still queued: 'deleted', else the status it has."""
        key = self._key(run_id)
        keys = (key, key + ":metrics", key + ":train_steps", self.index_key, self.queue_key)
        status = await self.redis.eval(_DELETE_QUEUED, 5, *keys, run_id)
        if not status:
            raise NotFound(f"unknown run {run_id!r}")
        return status.decode()

    async def queue(self) -> list[str]:
        """The queued runs' ids, next first."""
        return [r.decode() for r in await self.redis.lrange(self.queue_key, 0, -1)]

    async def transition(self, run_id: str, from_statuses: tuple[str, ...], to: str) -> str:
        """Atomically set status `to` if the run's status is one of `from_statuses`; returns
        the status it has now (NotFound for an unknown run)."""
        status = await self.redis.eval(_TRANSITION, 1, self._key(run_id), *from_statuses, to, time.time())
        if not status:
            raise NotFound(f"unknown run {run_id!r}")
        return status.decode()

    async def reclaim(self, run_id: str) -> None:
        """An active run found after a restart holds the claim (state written before claims existed)."""
        await self.redis.set(self.active_key, run_id, nx=True)

    async def active(self) -> tuple[str, RunConfig] | None:
        """The active run (the claim's holder, if still active) and its configuration."""
        holder = (await self.redis.get(self.active_key) or b"").decode()
        if not holder:
            return None
        try:
            rec = await self.get(holder)
        except NotFound:
            return None
        return (holder, RunConfig.model_validate(rec["config"])) if rec["status"] in ACTIVE else None

    async def queued_configs(self) -> list[tuple[str, RunConfig]]:
        """The queued runs (next first) and their configurations."""
        ids = await self.queue()
        if not ids:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for run_id in ids:
                pipe.hget(self._key(run_id), "config")
            stored = await pipe.execute()
        return [(i, RunConfig.model_validate_json(raw)) for i, raw in zip(ids, stored) if raw]

    async def active_record(self) -> dict | None:
        """The record of the run holding the claim (None: no run does)."""
        holder = (await self.redis.get(self.active_key) or b"").decode()
        try:
            return await self.get(holder) if holder else None
        except NotFound:
            return None

    async def count(self, run_id: str, name: str, n: int = 1) -> None:
        """Add n to the run record's counter `name` (NotFound: no such record)."""
        if not await self.redis.eval(_COUNT, 1, self._key(run_id), name, n):
            raise NotFound(f"unknown run {run_id!r}")

    async def delete(self, run_id: str) -> None:
        key = self._key(run_id)
        await self.redis.delete(
            key, key + ":metrics", key + ":train_steps", key + ":environments", key + ":environments_seen"
        )
        await self.redis.zrem(self.index_key, run_id)

    async def get(self, run_id: str) -> dict:
        """The run's record (NotFound for an unknown run): one round trip, whatever the
        length of the run."""
        return (await self.detail(run_id, 0))[0]

    async def detail(self, run_id: str, metrics_last: int) -> tuple[dict, list[bytes]]:
        """The run's record and its newest `metrics_last` metric records as they are stored
        (raw_metrics_since's), oldest first: one round trip."""
        async with self.redis.pipeline(transaction=True) as pipe:
            self._read(pipe, run_id)
            if metrics_last:
                pipe.lrange(self._key(run_id) + ":metrics", -metrics_last, -1)
            raw, steps, position, *metrics = await pipe.execute()
        if not raw:
            raise NotFound(f"unknown run {run_id!r}")
        return _record(raw, steps, position), metrics[0] if metrics else []

    def _read(self, pipe, run_id: str) -> None:
        pipe.hgetall(self._key(run_id))
        pipe.llen(self._key(run_id) + ":train_steps")
        pipe.lpos(self.queue_key, run_id)

    async def realign(self, run_id: str, step: int, answered: bool) -> tuple[int, int]:
        """Record that the trainer stands at `step`: the answer of the run's latest train step
        (`answered`, see runs.steps_after_train_step) or what it said when asked
        (runs.steps_held). Returns how many train steps the run had before and has now."""
        key = self._key(run_id)
        # (a call id: the client retries a call whose reply was lost, and this one must not append twice)
        before, after = await self.redis.eval(
            _REALIGN, 2, key, key + ":train_steps", step, "1" if answered else "0", time.time(), uuid.uuid4().hex
        )
        return before, after

    async def train_steps(self, run_id: str) -> list[int]:
        """The trainer's step after each of the run's train steps, oldest first."""
        key = self._key(run_id)
        legacy = await self.redis.hget(key, "train_steps")
        if legacy is not None:
            return json.loads(legacy)
        return [int(s) for s in await self.redis.lrange(key + ":train_steps", 0, -1)]

    async def update(self, run_id: str, **fields) -> None:
        """Set fields of the run's record (NotFound: no such record, none is made)."""
        fields = {k: json.dumps(v) if isinstance(v, (dict, list)) else v for k, v in fields.items()}
        pairs = [x for item in {**fields, "updated_at": time.time()}.items() for x in item]
        if not await self.redis.eval(_UPDATE, 1, self._key(run_id), *pairs):
            raise NotFound(f"unknown run {run_id!r}")

    async def is_active(self, run_id: str) -> bool:
        """Whether the run exists and has not ended."""
        try:
            return await self.status(run_id) in ACTIVE
        except NotFound:
            return False

    async def status(self, run_id: str) -> str:
        s = await self.redis.hget(self._key(run_id), "status")
        if s is None:
            raise NotFound(f"unknown run {run_id!r}")
        return s.decode()

    # ---- the environments registered with a run (source: environments), list ...:environments

    async def environments(self, run_id: str) -> list[bytes]:
        """The run's registrations (each as its `add_environment` stored it), by env_id."""
        return await self.redis.lrange(self._key(run_id) + ":environments", 0, -1)

    async def add_environment(self, run_id: str, make: Callable[[list[bytes]], tuple[str, object]]) -> object:
        """Register one more: `make(the registrations so far)` gives the new one's stored form
        and what to return (it may raise to refuse). Optimistic: a registration that another
        coordinator made meanwhile has this one made again on the longer list, so ids (their
        order) are never given twice."""
        key = self._key(run_id) + ":environments"
        async with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(key)
                    stored, made = make(await pipe.lrange(key, 0, -1))
                    pipe.multi()
                    pipe.rpush(key, stored)
                    await pipe.execute()
                    return made
                except WatchError:
                    continue

    async def set_environment(self, run_id: str, env_id: int, stored: str) -> None:
        await self.redis.lset(self._key(run_id) + ":environments", env_id, stored)

    async def environments_heard(self, run_id: str, env_ids: set[int]) -> None:
        """These environments were heard from now (hash ...:environments_seen, env_id -> time)."""
        if env_ids:
            now = time.time()
            await self.redis.hset(self._key(run_id) + ":environments_seen", mapping={i: now for i in env_ids})

    async def environments_seen(self, run_id: str) -> dict[int, float]:
        raw = await self.redis.hgetall(self._key(run_id) + ":environments_seen")
        return {int(k): float(v) for k, v in raw.items()}

    async def append_metrics(self, run_id: str, record: dict) -> None:
        """Appended once, even when the client sends it again after a lost reply (the record
        carries its time, so the same bytes at the end of the list are this very record)."""
        key = self._key(run_id)
        if await self.redis.eval(_APPEND_ONCE, 2, key + ":metrics", key, json.dumps(record)) == -1:
            raise NotFound(f"unknown run {run_id!r}")

    async def raw_metrics_since(self, run_id: str, since: int, limit: int) -> tuple[list[bytes], int]:
        """Up to `limit` metric records from position `since` (0 = the first ever written) as
        they are stored, each a JSON object (json.dumps's), and how many records the run has:
        the next call's `since` is since + len(records). NotFound for an unknown run."""
        key = self._key(run_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.exists(key)
            pipe.lrange(key + ":metrics", since, since + limit - 1)
            pipe.llen(key + ":metrics")
            known, raw, total = await pipe.execute()
        if not known:
            raise NotFound(f"unknown run {run_id!r}")
        return raw, total

    async def metrics(self, run_id: str, last: int | None = None) -> list[dict]:
        """The run's metric records, oldest first; only the newest `last` when given."""
        start = -last if last else 0
        if last == 0:
            return []
        return [json.loads(r) for r in await self.redis.lrange(self._key(run_id) + ":metrics", start, -1)]

    async def list(self, offset: int = 0, limit: int | None = None) -> list[dict]:
        """The kept runs' summaries (records without their config, evals and warnings), oldest first;
        `limit` of them from the `offset`-th when given."""
        return (await self.page(offset, limit))[0]

    async def page(self, offset: int = 0, limit: int | None = None) -> tuple[list[dict], int]:
        """Summaries as list() gives them, and how many runs are kept: one script (a pipeline
        of three reads per run cost GET /runs more than all else, in redis-py's parsing)."""
        stop = -1 if limit is None else offset + limit - 1
        total, *runs = await self.redis.eval(_READ_RUNS, 2, self.index_key, self.queue_key, self._key(""), offset, stop)
        return [
            _record(dict(zip(fields[::2], fields[1::2], strict=True)), steps, position, summary=True)
            for fields, steps, position in runs
        ], total


_BOOKKEEPING = (b"realign_call", b"realign_before")  # (the store's own fields: no part of a record)


def _record(raw: dict[bytes, bytes], train_steps: int, queue_index: int | None = None, summary: bool = False) -> dict:
    """A run's record from its hash, the length of its train steps list and its index in the
    queue (None: not queued). A summary leaves out the stored JSON that only GET /runs/{id}
    shows (config, eval_before, eval_after, warnings)."""
    rec = {k.decode(): v.decode() for k, v in raw.items() if k not in _BOOKKEEPING}
    rec["queue_position"] = None if queue_index is None else queue_index + 1
    rec["weight_version"] = int(rec["weight_version"])
    rec["held"] = rec.get("held", "0") == "1"  # (records written before pausing existed lack it)
    for k in ("created_at", "updated_at"):
        rec[k] = float(rec[k])
    rec["num_rollouts"], sft_steps = _config_counts(rec["config"])
    for k in ("config", "eval_before", "eval_after", "warnings"):
        if summary:
            rec.pop(k, None)
        else:
            rec[k] = json.loads(rec.get(k, "[]"))  # (records written before warnings existed lack them)
    legacy = rec.pop("train_steps", None)  # (written before the list existed: JSON in the hash)
    if legacy is not None:
        train_steps = len(json.loads(legacy))
    # RL iterations the trainer's model holds (the train steps past the warm start's)
    rec["rollout_id"] = max(train_steps - sft_steps, 0)
    return rec


@functools.lru_cache(maxsize=1024)
def _config_counts(stored_config: str) -> tuple[int, int]:
    """A stored run config's num_rollouts and warm-start steps. A run's config never changes
    once stored, and parsing every listed run's config was most of what GET /runs cost."""
    config = json.loads(stored_config)
    return config["num_rollouts"], config["sft_warmup"]["steps"]
