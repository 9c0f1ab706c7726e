"""The Lua scripts of prompt leases: prompts handed out to rollout workers (GET_PROMPTS)
and a leased reference replaced by the group it names (MATERIALIZE). The scripts that move
completed groups are in rlmesh.buffer.scripts."""

from __future__ import annotations

from rlmesh.buffer.scripts import NOW

# Hand out up to n prompt groups, each leased until `expiry`, in this order: prompts whose
# lease expired (their worker died), partial groups to resume, fresh prompts. A fresh
# prompt is leased as a reference "ref:{dataset, position, group index}" that the
# caller turns into the group's bytes (MATERIALIZE); a crash in between leaves the
# reference leased, and whoever gets it after the lease expires builds the same group.
# Several training datasets are mixed by weight with stride scheduling: the next prompt
# comes from the dataset with the smallest (drawn + 1) / weight (exact proportions at
# every point, deterministic, no randomness to replay).
# With within_cap = 1 and the run's max_queued_groups set, n shrinks so that queued groups
# plus live prompt leases (groups being generated) stay within that cap, or within `ahead`
# when that is set and tighter. With reclaim = 1 every live lease of the run expires first
# (GetPromptsRequest.reclaim_leases: the generator that held them is gone).
#   KEYS: spec cursor prompt_leases prompts partial partial_groups stats closed queue
#   ARGV: lease_seconds n within_cap ahead reclaim
# Returns {-1} unknown run, {-3} closed run (its datasets are gone), else {1, id, value, id, value, ...}.
GET_PROMPTS = (
    NOW
    + r"""
local raw_spec = redis.call('GET', KEYS[1])
if not raw_spec then return {-1} end
local spec = cjson.decode(raw_spec)
if redis.call('EXISTS', KEYS[8]) == 1 then return {-3} end
local cursor, leases, prompts, partial, partial_groups, stats = KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local now = redis_now()
local expiry, n = now + tonumber(ARGV[1]), tonumber(ARGV[2])
local out, count, reissued = {1}, 0, 0
if ARGV[5] == '1' then
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', leases, '(' .. now, '+inf')) do redis.call('ZADD', leases, now, id) end
end
local expired = redis.call('ZRANGEBYSCORE', leases, '-inf', now, 'LIMIT', 0, n)
local cap, ahead = tonumber(spec.max_queued_groups) or 0, tonumber(ARGV[4]) or 0
if ahead > 0 and (cap == 0 or ahead < cap) then cap = ahead end
if ARGV[3] == '1' and cap > 0 then
  local room = cap - redis.call('LLEN', KEYS[9]) - redis.call('ZCOUNT', leases, '(' .. now, '+inf')
  n = math.max(math.min(n, room), #expired)
end
for _, id in ipairs(expired) do
  local value = redis.call('HGET', prompts, id)
  if value then
    redis.call('ZADD', leases, expiry, id)
    out[#out + 1] = id
    out[#out + 1] = value
    count, reissued = count + 1, reissued + 1
  else
    redis.call('ZREM', leases, id)
  end
end
while count < n do
  local id = redis.call('LPOP', partial)
  if not id then break end
  local value = redis.call('HGET', partial_groups, id)
  redis.call('HDEL', partial_groups, id)
  if value then
    redis.call('HSET', prompts, id, value)
    redis.call('ZADD', leases, expiry, id)
    out[#out + 1] = id
    out[#out + 1] = value
    count = count + 1
  end
end
if count < n then
  local train = {}
  for _, d in ipairs(spec.datasets) do
    if not d.eval then train[#train + 1] = d end
  end
  while count < n do
    local best, best_t
    for _, d in ipairs(train) do
      local t = (tonumber(redis.call('HGET', cursor, d.name) or '0') + 1) / d.weight
      if best == nil or t < best_t then best, best_t = d, t end
    end
    local pos = redis.call('HINCRBY', cursor, best.name, 1) - 1
    local gi = redis.call('HINCRBY', cursor, '__groups__', 1) - 1
    local id = 'g' .. gi
    local ref = 'ref:' .. cjson.encode({d = best.name, p = pos, i = gi})
    redis.call('HSET', prompts, id, ref)
    redis.call('ZADD', leases, expiry, id)
    out[#out + 1] = id
    out[#out + 1] = ref
    count = count + 1
  end
end
redis.call('HINCRBY', stats, 'prompts_handed_out', count)
if reissued > 0 then redis.call('HINCRBY', stats, 'prompts_reissued', reissued) end
return out
"""
)

# Replace a leased reference by the group's bytes (only if still leased as that reference).
#   KEYS: prompts;  ARGV: (id, ref, bytes) per group
MATERIALIZE = r"""
for i = 1, #ARGV, 3 do
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[i + 1] then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 2])
  end
end
return 0
"""
