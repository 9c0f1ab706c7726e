"""A run's statistics as GetStats reports them: its counters (the `stats` hash), the sizes of
its lists, where its cursor stands, and per-second rates from counter snapshots kept in Redis."""

from __future__ import annotations

import json
import time

import redis.asyncio as aioredis

from rlmesh.buffer.keys import RunKeys

_RATE_COUNTERS = ("groups_written", "acknowledged_groups", "prompts_handed_out")


async def run_stats(redis: aioredis.Redis, k: RunKeys, spec: dict, rate_window_seconds: float) -> dict:
    """The run's counters, by the field names of the BufferStats message; the counts are read
    in one transaction (leased_groups is derived from three of them)."""
    pipe = redis.pipeline(transaction=True)
    pipe.llen(k.queue)
    pipe.hlen(k.groups)
    pipe.llen(k.partial)
    pipe.hgetall(k.stats)
    pipe.hgetall(k.cursor)
    pipe.llen(k.dead_letters)
    pipe.llen(k.provisional)
    pipe.scard(k.retained)  # (bytes kept in `groups` only for GetRecentGroups)
    queued, stored, partial, raw_counters, cursor, dead, provisional, retained = await pipe.execute()
    stored -= retained
    counters = {kk.decode(): int(v) for kk, v in raw_counters.items()}
    first = next(d for d in spec["datasets"] if not d["eval"])
    drawn = int(cursor.get(first["name"].encode(), 0))
    epoch, offset = divmod(drawn, spec["sizes"][first["name"]])
    skipped = spec.get("skipped", {})
    rates, window = await _rates(redis, k, counters, rate_window_seconds)
    return dict(
        queued_groups=queued,
        leased_groups=stored - queued - provisional,
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
        await pipe.execute()
    rates = dict.fromkeys(_RATE_COUNTERS, 0.0)
    if base and now - base[0][1] > 0:
        then = json.loads(base[0][0])
        span = now - base[0][1]
        rates = {c: max(counters.get(c, 0) - then.get(c, 0), 0) / span for c in _RATE_COUNTERS}
        return rates, span
    return rates, 0.0
