"""A run's statistics as GetStats reports them: its counters (the `stats` hash), the sizes of
its lists, where its cursor stands, and per-second rates from counter snapshots kept in Redis."""

from __future__ import annotations

import json
import time

import redis.asyncio as aioredis
from redis.exceptions import OutOfMemoryError, ReadOnlyError

from rlmesh.buffer.keys import RunKeys
from rlmesh.buffer.scripts import META_OF, NOW

_RATE_COUNTERS = ("groups_written", "acknowledged_groups", "prompts_handed_out")

# Groups of batch leases past their expiry (a trainer that died or gave up), which the next
# lease queues again first.  KEYS: batch_leases;  ARGV: batch_prefix.
_EXPIRED_LEASE_GROUPS = (
    NOW
    + r"""
local n = 0
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', redis_now())) do
  n = n + redis.call('LLEN', ARGV[1] .. id)
end
return n
"""
)

# The queued groups a lease with min_weight_version ARGV[1] would not drop as stale: those
# whose oldest weight version (the second field of their meta) is at least it, or unknown.
#   KEYS: queue meta
_QUEUED_FROM = (
    META_OF
    + r"""
local min_v, n, scanned = tonumber(ARGV[1]), 0, 0
while true do
  local chunk = redis.call('LRANGE', KEYS[1], scanned, scanned + 255)
  if #chunk == 0 then return n end
  for _, id in ipairs(chunk) do
    local _, v = meta_of(KEYS[2], id)
    if v < 0 or v >= min_v then n = n + 1 end
  end
  scanned = scanned + #chunk
end
"""
)


async def run_stats(
    redis: aioredis.Redis, k: RunKeys, spec: dict, rate_window_seconds: float, min_weight_version: int = 0
) -> dict:
    """The run's counters, by the field names of the BufferStats message; the counts are read
    in one transaction (leased_groups is derived from four of them). With min_weight_version
    (> 0), queued_groups_from scans the queue (bounded by its cap)."""
    pipe = redis.pipeline(transaction=True)
    pipe.llen(k.queue)
    pipe.hlen(k.groups)
    pipe.llen(k.partial)
    pipe.hgetall(k.stats)
    pipe.hgetall(k.cursor)
    pipe.llen(k.dead_letters)
    pipe.llen(k.provisional)
    pipe.scard(k.retained)  # (bytes kept in `groups` only for GetRecentGroups)
    pipe.eval(_EXPIRED_LEASE_GROUPS, 1, k.batch_leases, k.batch(""))
    if min_weight_version > 0:
        pipe.eval(_QUEUED_FROM, 2, k.queue, k.meta, min_weight_version)
    queued, stored, partial, raw_counters, cursor, dead, provisional, retained, expired, *fresh = await pipe.execute()
    stored -= retained
    counters = {kk.decode(): int(v) for kk, v in raw_counters.items()}
    first = next(d for d in spec["datasets"] if not d["eval"])
    drawn = int(cursor.get(first["name"].encode(), 0))
    epoch, offset = divmod(drawn, spec["sizes"][first["name"]])
    skipped = spec.get("skipped", {})
    rates, window = await _rates(redis, k, counters, rate_window_seconds)
    return dict(
        queued_groups=queued,
        queued_groups_from=fresh[0] if fresh else queued,
        leased_groups=max(stored - queued - provisional - expired, 0),
        expired_lease_groups=expired,
        partial_groups=partial,
        acknowledged_groups=counters.get("acknowledged_groups", 0),
        dropped_groups=counters.get("dropped_groups", 0),
        prompts_handed_out=counters.get("prompts_handed_out", 0),
        epoch=epoch,
        offset=offset,
        next_sample_index=int(cursor.get(b"__groups__", 0)) * spec["n_samples_per_prompt"],
        groups_written=counters.get("groups_written", 0),
        redelivered_groups=counters.get("redelivered_groups", 0),
        stale_groups_dropped=counters.get("stale_groups_dropped", 0),
        stale_groups_kept=counters.get("stale_groups_kept", 0),
        prompts_skipped=sum(skipped.values()),
        prompts_skipped_by_dataset=skipped,
        prompts_reissued=counters.get("prompts_reissued", 0),
        partial_groups_returned=counters.get("partial_groups_returned", 0),
        dropped_by_reason={kk[len("dropped:") :]: v for kk, v in counters.items() if kk.startswith("dropped:")},
        groups_written_per_second=rates["groups_written"],
        groups_acknowledged_per_second=rates["acknowledged_groups"],
        prompts_handed_out_per_second=rates["prompts_handed_out"],
        rate_window_seconds=window,
        queued_samples=counters.get("queued_samples", 0),
        dead_letter_groups=dead,
        provisional_groups=provisional,
        rolled_back_groups=counters.get("rolled_back_groups", 0),
        dataset_rows=spec["sizes"],
    )


async def _rates(
    redis: aioredis.Redis, k: RunKeys, counters: dict[str, int], window: float
) -> tuple[dict[str, float], float]:
    """Per-second rates against a snapshot of the counters taken about
    rate_window_seconds ago (snapshots live in Redis, so every replica agrees)."""
    now = time.time()
    base = await redis.zrangebyscore(k.rate_snapshots, now - window, "+inf", start=0, num=1, withscores=True)
    if not base:
        base = await redis.zrevrange(k.rate_snapshots, 0, 0, withscores=True)
    newest = await redis.zrevrange(k.rate_snapshots, 0, 0, withscores=True)
    if not newest or now - newest[0][1] >= 1.0:
        snapshot = json.dumps({"t": now, **{c: counters.get(c, 0) for c in _RATE_COUNTERS}})
        pipe = redis.pipeline(transaction=False)
        pipe.zadd(k.rate_snapshots, {snapshot: now})
        pipe.zremrangebyscore(k.rate_snapshots, "-inf", now - 2 * window)
        try:
            await pipe.execute()
        except (OutOfMemoryError, ReadOnlyError):  # (a full Redis, or a replica: the read still answers)
            pass
    rates = dict.fromkeys(_RATE_COUNTERS, 0.0)
    if base and now - base[0][1] > 0:
        then = json.loads(base[0][0])
        span = now - base[0][1]
        rates = {c: max(counters.get(c, 0) - then.get(c, 0), 0) / span for c in _RATE_COUNTERS}
        return rates, span
    return rates, 0.0
