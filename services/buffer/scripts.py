"""The Lua scripts that move groups between states. Each runs atomically in Redis, so a
crash of any buffer replica at any point leaves every group in exactly one state.

Per-group summary kept beside the bytes (`meta` hash), so scripts never parse protobuf:
    "<number of samples> <oldest weight version, -1 if none> <JSON for buffer filters>"
"""

from __future__ import annotations

# ---------------------------------------------------------------- shared helpers

# A group leaving the buffer (trained, dropped, dead-lettered) keeps its bytes in `groups`
# while its id is among the newest written (recent_ids), for GetRecentGroups: its id goes
# to `retained`, and the write that pushes it out of recent_ids deletes the bytes
# (PUT_GROUPS). So the view costs no second copy of any group. (The two keys are the run's,
# named from its groups key: every caller already passes that.)
_LEAVE = r"""
local function leave_bytes(groups, id)
  local base = string.sub(groups, 1, -7)
  if redis.call('LPOS', base .. 'recent_ids', id) then
    redis.call('SADD', base .. 'retained', id)
  else
    redis.call('HDEL', groups, id)
  end
end
"""

# Now, on Redis's clock (seconds): every lease expiry is set and compared on this one
# clock, never on the clock of whichever buffer replica runs the script (one set ahead would
# expire every other replica's leases). TIME before writes is allowed under effects
# replication, the default since Redis 5 and the only mode since 7.
NOW = r"""
local function redis_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
"""

# A group's meta ("<samples> <oldest weight version> ..."): its sample count and oldest
# version (1, -1 when it has none). The one reader of that format; stats.py uses it too.
META_OF = r"""
local function meta_of(meta_key, id)
  local m = redis.call('HGET', meta_key, id)
  if not m then return 1, -1 end
  local n, v = string.match(m, '^(%d+) (%-?%d+)')
  return tonumber(n), tonumber(v)
end
"""

_HELPERS = (
    _LEAVE
    + NOW
    + META_OF
    + r"""
-- The run's incarnation token (a new one each time the run is created).
local function run_token(spec_key)
  local spec = redis.call('GET', spec_key)
  return spec and string.match(spec, '"token": "(%w+)"') or ''
end

local function push_all(key, ids)
  for i = 1, #ids, 1000 do
    redis.call('RPUSH', key, unpack(ids, i, math.min(i + 999, #ids)))
  end
end

-- A group that can never be trained: its bytes and reason go to the dead-letter list,
-- and its id to `discarded`, so neither a lease nor a retried write brings it back.
local function dead_letter(k, id, reason)
  local raw = redis.call('HGET', k.groups, id)
  if raw then redis.call('HSET', k.dead_groups, id, raw) end
  redis.call('HSET', k.dead_reasons, id, reason)
  redis.call('RPUSH', k.dead_letters, id)
  leave_bytes(k.groups, id)
  redis.call('HDEL', k.meta, id)
  redis.call('HDEL', k.deliveries, id)
  redis.call('HDEL', k.rollbacks, id)
  redis.call('SADD', k.discarded, id)
end

-- Why a group whose lease ends unacknowledged goes to the dead-letter list (nil: it does
-- not). A lease that expired is a failed delivery: at max_deliveries of them the group goes
-- (a batch whose every lease expires must not come back forever). A lease released by a
-- rollback (`max_rollbacks` given: its trainer died and restarted from its checkpoint) is
-- not a failed delivery: a preempted trainer is not the group's fault. It is counted
-- apart, against its own, higher limit: a batch that kills every trainer that takes it
-- must not come back forever either.
local function poisoned(k, id, max_deliveries, max_rollbacks)
  if max_rollbacks then
    redis.call('HINCRBY', k.deliveries, id, -1)
    local held = redis.call('HINCRBY', k.rollbacks, id, 1)
    if held < max_rollbacks then return nil end
    return 'held by ' .. held .. ' trainers that died before acknowledging it (each lease released when the '
      .. 'trainer restarted from its checkpoint; the buffer setting max_rollbacks is ' .. max_rollbacks .. ')'
  end
  local delivered = tonumber(redis.call('HGET', k.deliveries, id) or '0')
  if delivered < max_deliveries then return nil end
  return 'delivered ' .. delivered .. ' times and never acknowledged (every lease expired; '
    .. 'the buffer setting max_deliveries is ' .. max_deliveries .. ')'
end

-- Expired batch leases (every lease, `now` '+inf') go back to the front of the queue, in
-- their original order, or to the dead-letter list (poisoned).
local function requeue_expired(k, now, batch_prefix, max_deliveries, max_rollbacks)
  local expired = redis.call('ZRANGEBYSCORE', k.leases, '-inf', now)
  for _, lease_id in ipairs(expired) do
    local list = batch_prefix .. lease_id
    local ids = redis.call('LRANGE', list, 0, -1)
    local samples, requeued = 0, 0
    for i = #ids, 1, -1 do
      local reason = poisoned(k, ids[i], max_deliveries, max_rollbacks)
      if reason then
        dead_letter(k, ids[i], reason)
      else
        redis.call('LPUSH', k.queue, ids[i])
        samples = samples + (meta_of(k.meta, ids[i]))
        requeued = requeued + 1
      end
    end
    redis.call('DEL', list)
    redis.call('ZREM', k.leases, lease_id)
    redis.call('HINCRBY', k.stats, 'redelivered_groups', requeued)
    redis.call('HINCRBY', k.stats, 'queued_samples', samples)
  end
end

-- Stale groups (policy DROP): removed for good and counted.
local function discard(k, ids)
  if #ids == 0 then return end
  local samples = 0
  for _, id in ipairs(ids) do
    samples = samples + (meta_of(k.meta, id))
    leave_bytes(k.groups, id)
    redis.call('HDEL', k.meta, id)
    redis.call('HDEL', k.deliveries, id)
    redis.call('HDEL', k.rollbacks, id)
    redis.call('SADD', k.discarded, id)
  end
  redis.call('HINCRBY', k.stats, 'stale_groups_dropped', #ids)
  redis.call('HINCRBY', k.stats, 'dropped_groups', #ids)
  redis.call('HINCRBY', k.stats, 'dropped:stale', #ids)
  redis.call('HINCRBY', k.stats, 'queued_samples', -samples)
end

-- Lease `ids` (already removed from the queue). The caller reads their bytes (from its
-- cache of groups it stored, else from the groups hash).
local function leased(k, ids, lease_id, expiry, stale_kept, stale_dropped)
  local samples = 0
  for _, id in ipairs(ids) do
    samples = samples + (meta_of(k.meta, id))
    redis.call('HINCRBY', k.deliveries, id, 1)
  end
  push_all(k.lease_list, ids)
  redis.call('ZADD', k.leases, expiry, lease_id)
  redis.call('HINCRBY', k.stats, 'queued_samples', -samples)
  if stale_kept > 0 then redis.call('HINCRBY', k.stats, 'stale_groups_kept', stale_kept) end
  local out = {#ids, stale_dropped, stale_kept, run_token(k.spec)}
  for _, id in ipairs(ids) do out[#out + 1] = id end
  return out
end

-- The lease KEYS[8] (batch:<ARGV[2]>), if it lives: what leasing it answered (a retried call).
local function live_lease(k)
  if not redis.call('ZSCORE', k.leases, ARGV[2]) then return nil end
  local ids = redis.call('LRANGE', k.lease_list, 0, -1)
  local out = {#ids, 0, 0, run_token(k.spec)}
  for _, id in ipairs(ids) do out[#out + 1] = id end
  return out
end

local function lease_keys()
  return {spec = KEYS[1], queue = KEYS[2], leases = KEYS[3], groups = KEYS[4], meta = KEYS[5],
          stats = KEYS[6], discarded = KEYS[7], lease_list = KEYS[8], deliveries = KEYS[9],
          dead_letters = KEYS[10], dead_groups = KEYS[11], dead_reasons = KEYS[12], rollbacks = KEYS[13]}
end
"""
)

# KEYS and ARGV of the lease scripts and REJECT_GROUPS (see BufferStore.lease_batch):
#   KEYS: spec queue batch_leases groups meta stats discarded batch:<lease_id> deliveries
#         dead_letters dead_groups dead_reasons rollbacks
#   ARGV: batch_prefix lease_id lease_seconds max_deliveries ...
# Lease scripts return {-1} for an unknown run, {0, stale_dropped} when no batch, else
# {n, stale_dropped, stale_kept, run token, group ids...}.

# First in, first out: the default. Fast path (no staleness bound, counted in groups):
# one LPOP. Otherwise scan the queue from the front.
LEASE_FIFO = (
    _HELPERS
    + r"""
local k = lease_keys()
if redis.call('EXISTS', k.spec) == 0 then return {-1} end
local now = redis_now()
requeue_expired(k, now, ARGV[1], tonumber(ARGV[4]))
local again = live_lease(k)
if again then return again end
local want_groups, want_samples = tonumber(ARGV[5]), tonumber(ARGV[6])
local min_v, keep = tonumber(ARGV[7]), ARGV[8] == '1'
local take, drop, stale_kept = {}, {}, 0
if min_v <= 0 and want_samples <= 0 then
  if redis.call('LLEN', k.queue) < want_groups then return {0, 0} end
  take = redis.call('LPOP', k.queue, want_groups)
else
  local len = redis.call('LLEN', k.queue)
  local scanned, samples, done = 0, 0, false
  while scanned < len and not done do
    local chunk = redis.call('LRANGE', k.queue, scanned, scanned + 255)
    if #chunk == 0 then break end
    for _, id in ipairs(chunk) do
      scanned = scanned + 1
      local n, v = meta_of(k.meta, id)
      local stale = min_v > 0 and v >= 0 and v < min_v
      if stale and not keep then
        drop[#drop + 1] = id
      else
        take[#take + 1] = id
        if stale then stale_kept = stale_kept + 1 end
        samples = samples + n
        if (want_samples > 0 and samples >= want_samples) or (want_samples <= 0 and #take >= want_groups) then
          done = true
          break
        end
      end
    end
  end
  if done then
    redis.call('LTRIM', k.queue, scanned, -1)  -- everything scanned was taken or dropped
  else
    for _, id in ipairs(drop) do redis.call('LREM', k.queue, 1, id) end
    take, stale_kept = {}, 0
  end
  discard(k, drop)
end
if #take == 0 then return {0, #drop} end
return leased(k, take, ARGV[2], now + tonumber(ARGV[3]), stale_kept, #drop)
"""
)

# A buffer filter chose the groups (from a snapshot of the queue): claim exactly those,
# or nothing if another replica took one meanwhile ({-2}: choose again).
#   ARGV: batch_prefix lease_id lease_seconds max_deliveries n_take n_drop stale_kept take_ids... drop_ids...
LEASE_CHOSEN = (
    _HELPERS
    + r"""
local k = lease_keys()
if redis.call('EXISTS', k.spec) == 0 then return {-1} end
local again = live_lease(k)
if again then return again end
local n_take, n_drop, stale_kept = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local take, drop = {}, {}
for i = 1, n_take do
  take[i] = ARGV[7 + i]
  if not redis.call('LPOS', k.queue, take[i]) then return {-2} end
end
for i = 1, n_drop do
  local id = ARGV[7 + n_take + i]
  if redis.call('LREM', k.queue, 1, id) == 1 then drop[#drop + 1] = id end
end
discard(k, drop)
if n_take == 0 then return {0, #drop} end
for _, id in ipairs(take) do redis.call('LREM', k.queue, 1, id) end
return leased(k, take, ARGV[2], redis_now() + tonumber(ARGV[3]), stale_kept, #drop)
"""
)

REQUEUE_EXPIRED = (
    _HELPERS
    + r"""
local k = lease_keys()
requeue_expired(k, redis_now(), ARGV[1], tonumber(ARGV[4]))
return 0
"""
)

# Groups of a live lease that can never be trained go to the dead-letter list with their
# reasons; all or nothing. The lease keeps its other groups. A group already dead-lettered
# counts as rejected: a retried call (the buffer died before replying) answers as the first.
#   KEYS: as the lease scripts (batch:<lease_id> of this lease);  ARGV: lease_id (id, reason)...
# Returns {-2} unknown run, {-1} unknown or expired lease, {-3, id} a group not in the
# lease, else {groups rejected}.
REJECT_GROUPS = (
    _HELPERS
    + r"""
local k = lease_keys()
if redis.call('EXISTS', k.spec) == 0 then return {-2} end
if not redis.call('ZSCORE', k.leases, ARGV[1]) then return {-1} end
for i = 2, #ARGV, 2 do
  if not redis.call('LPOS', k.lease_list, ARGV[i]) and redis.call('HEXISTS', k.dead_reasons, ARGV[i]) == 0 then
    return {-3, ARGV[i]}
  end
end
for i = 2, #ARGV, 2 do
  if redis.call('LREM', k.lease_list, 1, ARGV[i]) == 1 then dead_letter(k, ARGV[i], ARGV[i + 1]) end
end
return {(#ARGV - 1) / 2}
"""
)

# A live lease given up by its holder: its groups go back to the front of the queue in
# their order, their delivery undone (the step never used them). Idempotent.
#   KEYS: as the lease scripts (batch:<lease_id> of this lease);  ARGV: lease_id
# Returns -2 unknown run, else groups queued again (0: no such live lease).
RELEASE_BATCH = (
    _HELPERS
    + r"""
local k = lease_keys()
if redis.call('EXISTS', k.spec) == 0 then return -2 end
if not redis.call('ZSCORE', k.leases, ARGV[1]) then return 0 end
local ids = redis.call('LRANGE', k.lease_list, 0, -1)
local samples = 0
for i = #ids, 1, -1 do
  redis.call('LPUSH', k.queue, ids[i])
  redis.call('HINCRBY', k.deliveries, ids[i], -1)
  samples = samples + (meta_of(k.meta, ids[i]))
end
redis.call('DEL', k.lease_list)
redis.call('ZREM', k.leases, ARGV[1])
redis.call('HINCRBY', k.stats, 'queued_samples', samples)
return #ids
"""
)

# Store completed groups all-or-nothing: skip duplicates (already stored, leased,
# acknowledged or discarded), refuse the whole write when it would pass the queue cap. The
# newest `keep` stored ids go to the front of recent_ids (capped at `keep`); the bytes of
# ids it drops that were kept only for it (retained: see _LEAVE) are deleted.
#   KEYS: spec groups queue acked discarded prompt_leases prompts stats meta closed recent_ids retained
#   ARGV: keep, then (group_id, bytes, meta) per group
# Returns {-1} unknown run, {-2, queued} over the cap, {-3} closed run, else {stored, run
# token, positions (0-based) of the groups stored...}.
PUT_GROUPS = r"""
local spec = redis.call('GET', KEYS[1])
if not spec then return {-1} end
if redis.call('EXISTS', KEYS[10]) == 1 then return {-3} end
local cap = tonumber(cjson.decode(spec).max_queued_groups) or 0
local fresh, seen = {}, {}
for i = 2, #ARGV, 3 do
  local id = ARGV[i]
  if not seen[id] and redis.call('HEXISTS', KEYS[2], id) == 0 and redis.call('SISMEMBER', KEYS[4], id) == 0
      and redis.call('SISMEMBER', KEYS[5], id) == 0 then
    fresh[#fresh + 1] = i
  end
  seen[id] = true
end
local queued = redis.call('LLEN', KEYS[3])
if cap > 0 and #fresh > 0 and queued + #fresh > cap then return {-2, queued} end
local samples = 0
for _, i in ipairs(fresh) do
  redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
  redis.call('HSET', KEYS[9], ARGV[i], ARGV[i + 2])
  redis.call('RPUSH', KEYS[3], ARGV[i])
  samples = samples + tonumber(string.match(ARGV[i + 2], '^(%d+)'))
end
for i = 2, #ARGV, 3 do
  redis.call('ZREM', KEYS[6], ARGV[i])
  redis.call('HDEL', KEYS[7], ARGV[i])
end
redis.call('HINCRBY', KEYS[8], 'groups_written', #fresh)
redis.call('HINCRBY', KEYS[8], 'queued_samples', samples)
local keep = tonumber(ARGV[1])
for j = math.max(1, #fresh - keep + 1), #fresh do redis.call('LPUSH', KEYS[11], ARGV[fresh[j]]) end
for _, id in ipairs(redis.call('LRANGE', KEYS[11], keep, -1)) do
  if redis.call('SREM', KEYS[12], id) == 1 then redis.call('HDEL', KEYS[2], id) end
end
if keep > 0 then redis.call('LTRIM', KEYS[11], 0, keep - 1) else redis.call('DEL', KEYS[11]) end
local out = {#fresh, string.match(spec, '"token": "(%w+)"') or ''}
for _, i in ipairs(fresh) do out[#out + 1] = (i - 2) / 3 end
return out
"""

# The newest stored groups (newest first) from `start` to `stop` (LRANGE's), and how many
# are kept. An id is in recent_ids only while its bytes are in `groups` (see _LEAVE).
#   KEYS: recent_ids groups;  ARGV: start stop.  Returns {total, bytes...}.
RECENT_GROUPS = r"""
local out = {redis.call('LLEN', KEYS[1])}
local ids = redis.call('LRANGE', KEYS[1], ARGV[1], ARGV[2])
if #ids > 0 then
  for _, raw in ipairs(redis.call('HMGET', KEYS[2], unpack(ids))) do
    if raw then out[#out + 1] = raw end
  end
end
return out
"""

# A trained group leaves the buffer for good: only its id stays (in `acked`, and its bytes
# while it is among the newest written: _LEAVE), so a retried
# write of it is a duplicate.
_FINAL = (
    _LEAVE
    + r"""
local function finalize(groups, meta, deliveries, rollbacks, acked, id)
  leave_bytes(groups, id)
  redis.call('HDEL', meta, id)
  redis.call('HDEL', deliveries, id)
  redis.call('HDEL', rollbacks, id)
  redis.call('SADD', acked, id)
end

-- A provisional acknowledgment's record in provisional_steps: "<step>/<load_id>" (a bare
-- "<step>": an unnamed load, as written before loads were named).
local function trained_at(steps, id)
  local v = redis.call('HGET', steps, id) or '0'
  local slash = string.find(v, '/', 1, true)
  if not slash then return tonumber(v), '' end
  return tonumber(string.sub(v, 1, slash - 1)), string.sub(v, slash + 1)
end

-- Provisional acknowledgments of steps <= `step` become final; returns how many, the later
-- ones (in the order they were acknowledged), which stay provisional unless the caller
-- requeues them, and those of another load than `load` (named, both) past `loaded_step`:
-- a dead trainer's, trained after the checkpoint its successor loaded (for the caller to
-- requeue; ones through `loaded_step` are in that checkpoint, and final).
local function commit_through(groups, meta, deliveries, rollbacks, acked, stats, provisional, steps, step,
                              load, loaded_step)
  local ids = redis.call('LRANGE', provisional, 0, -1)
  local later, undone, n = {}, {}, 0
  for _, id in ipairs(ids) do
    local at, by = trained_at(steps, id)
    local dead = load ~= '' and by ~= '' and by ~= load
    if at <= (dead and loaded_step or step) then
      finalize(groups, meta, deliveries, rollbacks, acked, id)
      redis.call('HDEL', steps, id)
      n = n + 1
    elseif dead then
      undone[#undone + 1] = id
    else
      later[#later + 1] = id
    end
  end
  if n > 0 or #undone > 0 then
    redis.call('DEL', provisional)
    for i = 1, #later, 1000 do
      redis.call('RPUSH', provisional, unpack(later, i, math.min(i + 999, #later)))
    end
  end
  if n > 0 then redis.call('HINCRBY', stats, 'acknowledged_groups', n) end
  return n, later, undone
end
"""
)

# A repeated acknowledgment of a lease already acknowledged answers as the first did: a
# buffer killed after the script ran but before its reply makes the trainer ask again.
# The newest ARGV[4] acknowledged lease ids are remembered (acked_leases hash, oldest first
# in acked_lease_order).
#   KEYS: spec batch_leases batch:<lease_id> groups acked stats meta deliveries provisional provisional_steps
#         acked_leases acked_lease_order rollbacks
#   ARGV: lease_id provisional(0|1) step remembered_leases load_id
# Returns -2 unknown run, -1 unknown or redelivered lease, else groups acknowledged.
ACK_BATCH = (
    _FINAL
    + r"""
if redis.call('EXISTS', KEYS[1]) == 0 then return -2 end
if not redis.call('ZSCORE', KEYS[2], ARGV[1]) then
  local before = redis.call('HGET', KEYS[11], ARGV[1])
  if before then return tonumber(before) end
  return -1
end
local ids = redis.call('LRANGE', KEYS[3], 0, -1)
for _, id in ipairs(ids) do
  if ARGV[2] == '1' then
    redis.call('RPUSH', KEYS[9], id)
    redis.call('HSET', KEYS[10], id, (ARGV[5] or '') == '' and ARGV[3] or (ARGV[3] .. '/' .. ARGV[5]))
  else
    finalize(KEYS[4], KEYS[7], KEYS[8], KEYS[13], KEYS[5], id)
  end
end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('DEL', KEYS[3])
if ARGV[2] ~= '1' then redis.call('HINCRBY', KEYS[6], 'acknowledged_groups', #ids) end
redis.call('HSET', KEYS[11], ARGV[1], #ids)
if redis.call('RPUSH', KEYS[12], ARGV[1]) > tonumber(ARGV[4]) then
  redis.call('HDEL', KEYS[11], redis.call('LPOP', KEYS[12]))
end
return #ids
"""
)

# Provisional groups a dead trainer trained after the checkpoint its successor loaded go
# back to the very front of the queue in the order they were trained (their delivery did not
# fail: it is taken back, and not counted as a rollback either). KEYS: as the lease scripts,
# then acked provisional provisional_steps.
_REQUEUE_TRAINED = r"""
local function requeue_trained(k, ids)
  local samples = 0
  for i = #ids, 1, -1 do
    redis.call('LPUSH', k.queue, ids[i])
    redis.call('HDEL', KEYS[16], ids[i])
    redis.call('HINCRBY', k.deliveries, ids[i], -1)
    samples = samples + (meta_of(k.meta, ids[i]))
  end
  if #ids > 0 then
    redis.call('HINCRBY', k.stats, 'rolled_back_groups', #ids)
    redis.call('HINCRBY', k.stats, 'queued_samples', samples)
  end
end
"""

#   KEYS: as _REQUEUE_TRAINED;  ARGV: through_step load_id loaded_step (CommitAcksRequest)
# Returns {-2} unknown run, else {committed, requeued}.
COMMIT_ACKS = (
    _HELPERS
    + _FINAL
    + _REQUEUE_TRAINED
    + r"""
local k = lease_keys()
if redis.call('EXISTS', k.spec) == 0 then return {-2} end
local n, _, undone = commit_through(k.groups, k.meta, k.deliveries, k.rollbacks, KEYS[14], k.stats, KEYS[15],
                                    KEYS[16], tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3]))
requeue_trained(k, undone)
return {n, #undone}
"""
)

# A trainer restarted from its checkpoint at `step`: provisional acknowledgments up to it
# become final; later ones are requeued (_REQUEUE_TRAINED); every batch lease (live or
# expired: the dead trainer's) is released, counted as a rollback, not as a failed delivery
# (see poisoned).
#   KEYS: as _REQUEUE_TRAINED;  ARGV: batch_prefix step max_deliveries max_rollbacks
# Returns {-2} unknown run, else {committed, requeued, leases released}.
ROLLBACK_TO_CHECKPOINT = (
    _HELPERS
    + _FINAL
    + _REQUEUE_TRAINED
    + r"""
local k = lease_keys()
if redis.call('EXISTS', k.spec) == 0 then return {-2} end
local released = redis.call('ZCARD', k.leases)
requeue_expired(k, '+inf', ARGV[1], tonumber(ARGV[3]), tonumber(ARGV[4]))
local committed, later = commit_through(k.groups, k.meta, k.deliveries, k.rollbacks, KEYS[14], k.stats, KEYS[15],
                                        KEYS[16], tonumber(ARGV[2]), '', 0)
requeue_trained(k, later)
redis.call('DEL', KEYS[15])
return {committed, #later, released}
"""
)

# Aborted groups come back with what they generated so far, to be handed out first.
#   KEYS: spec partial partial_groups prompt_leases prompts stats groups acked discarded closed
#   ARGV: (id, bytes) per group.  Returns -1 unknown run, -3 closed run, else groups taken back.
RETURN_PARTIAL = r"""
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if redis.call('EXISTS', KEYS[10]) == 1 then return -3 end
local n = 0
for i = 1, #ARGV, 2 do
  local id = ARGV[i]
  if redis.call('HEXISTS', KEYS[7], id) == 0 and redis.call('SISMEMBER', KEYS[8], id) == 0
      and redis.call('SISMEMBER', KEYS[9], id) == 0 then
    if redis.call('HEXISTS', KEYS[3], id) == 0 then redis.call('RPUSH', KEYS[2], id) end
    redis.call('HSET', KEYS[3], id, ARGV[i + 1])
    n = n + 1
  end
  redis.call('ZREM', KEYS[4], id)
  redis.call('HDEL', KEYS[5], id)
end
redis.call('HINCRBY', KEYS[6], 'partial_groups_returned', n)
return n
"""

# Prompts generated but filtered out: consumed and dropped, never handed out again.
#   KEYS: spec prompt_leases prompts stats discarded closed;  ARGV: reason ids...
# Returns -1 unknown run, -3 closed run, else groups dropped.
DROP_GROUPS = r"""
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if redis.call('EXISTS', KEYS[6]) == 1 then return -3 end
for i = 2, #ARGV do
  redis.call('ZREM', KEYS[2], ARGV[i])
  redis.call('HDEL', KEYS[3], ARGV[i])
  redis.call('SADD', KEYS[5], ARGV[i])
end
redis.call('HINCRBY', KEYS[4], 'dropped_groups', #ARGV - 1)
redis.call('HINCRBY', KEYS[4], 'dropped:' .. ARGV[1], #ARGV - 1)
return #ARGV - 1
"""

# A run ends: mark it closed, counting the prompt groups it left unfinished (handed out, or
# partial) as stats 'unfinished_at_close' (they are deleted next). Once: a repeated call
# changes nothing. KEYS: closed prompts partial_groups stats. ARGV: now.
CLOSE_RUN = r"""
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local n = redis.call('HLEN', KEYS[2]) + redis.call('HLEN', KEYS[3])
redis.call('HINCRBY', KEYS[4], 'unfinished_at_close', n)
redis.call('SET', KEYS[1], ARGV[1])
return n
"""
