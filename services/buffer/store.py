"""The buffer's plain logic over Redis. Every move of a group between states is one
atomic Lua script (rlmesh.buffer.scripts), so several buffer replicas can serve one
Redis and a crash at any point loses nothing and hands nothing out twice.

Where each thing lives in Redis: rlmesh.buffer.keys.

Groups stay serialized protobuf bytes from the writer to the trainer: the buffer checks
them but never re-encodes them (see rlmesh.buffer.wire).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from dataclasses import dataclass

import redis.asyncio as aioredis

from rlmesh.buffer import scripts
from rlmesh.buffer.cache import GroupCache
from rlmesh.buffer.filters import BufferFilter, check_minimums, decode_meta, encode_meta, with_minimums
from rlmesh.buffer.keys import CLOSED_RUN_DROPS, RunKeys, closed_run, read_spec, run_keys, unknown_run
from rlmesh.buffer.prompts import PromptSource, check_dataset_names
from rlmesh.buffer.sources import DataFiles
from rlmesh.buffer.stats import run_stats
from rlmesh.buffer.wakeups import Wakeups
from rlmesh.buffer.wire import repeated_messages
from rlmesh.common.dataset_spec import dataset_defaults
from rlmesh.common.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, RlmeshError
from rlmesh.common.faults import fault_point
from rlmesh.common.run_config import DatasetConfig
from rlmesh.common.sample import ConversionError, validate_groups_proto
from rlmesh.v1 import buffer_pb2, sample_pb2

_SPEC_ONLY_AT_CREATION = ("sizes", "skipped", "created_at", "token")


@dataclass
class LeasedBatch:
    groups: int
    response: bytes  # a serialized LeaseBatchResponse


@dataclass
class DeadLetter:
    group: bytes  # the SampleGroup as it was written
    reason: str


_MAX_REASON = 4096  # characters of a rejection's reason that are kept
# Acknowledged lease ids remembered per run so that a retried AckBatch (the buffer died
# before its reply) succeeds again; a trainer retries within minutes, not 1,000 steps.
_REMEMBERED_ACKED_LEASES = 1000
_LEASE_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
# The least time between two tries of a waiting lease that filters (each reads up to
# filter_window queued groups), however often writes wake it.
FILTERED_LEASE_GAP_SECONDS = 0.005


class BufferStore:
    def __init__(
        self,
        redis: aioredis.Redis,
        key_prefix: str = "rlmesh",
        buffer_filter: BufferFilter | None = None,
        filter_window: int = 4096,
        rate_window_seconds: float = 60.0,
        cache_bytes: int = 0,
        data_files: DataFiles | None = None,
        max_deliveries: int = 5,
        recent_groups: int = 512,
        max_rollbacks: int = 10,
    ) -> None:
        self.redis = redis
        self.key_prefix = key_prefix
        self.buffer_filter = buffer_filter
        self.filter_window = filter_window
        self.rate_window_seconds = rate_window_seconds
        self.cache = GroupCache(cache_bytes)
        data_files = data_files or DataFiles((), 1, 1)  # none: no dataset file can be read
        self.prompts = PromptSource(redis, key_prefix, data_files)  # GetPrompts, GetEvalPrompts
        self.max_deliveries = max_deliveries
        self.max_rollbacks = max_rollbacks
        self.recent_groups = recent_groups
        self._queued = Wakeups()  # groups queued through this replica, by run
        self._put = redis.register_script(scripts.PUT_GROUPS)
        self._close = redis.register_script(scripts.CLOSE_RUN)
        self._lease_fifo = redis.register_script(scripts.LEASE_FIFO)
        self._lease_chosen = redis.register_script(scripts.LEASE_CHOSEN)
        self._requeue = redis.register_script(scripts.REQUEUE_EXPIRED)
        self._ack = redis.register_script(scripts.ACK_BATCH)
        self._commit_acks = redis.register_script(scripts.COMMIT_ACKS)
        self._rollback = redis.register_script(scripts.ROLLBACK_TO_CHECKPOINT)
        self._reject = redis.register_script(scripts.REJECT_GROUPS)
        self._release = redis.register_script(scripts.RELEASE_BATCH)
        self._return_partial = redis.register_script(scripts.RETURN_PARTIAL)
        self._drop = redis.register_script(scripts.DROP_GROUPS)
        self._recent = redis.register_script(scripts.RECENT_GROUPS)

    def keys(self, run_id: str) -> RunKeys:
        return run_keys(self.key_prefix, run_id)

    async def _spec(self, run_id: str) -> dict:
        return await read_spec(self.redis, self.keys(run_id), run_id)

    async def list_runs(self) -> list[str]:
        head, tail = f"{self.key_prefix}:run:", ":spec"
        keys = self.redis.scan_iter(match=f"{head}*{tail}", count=1000)
        return sorted([key.decode()[len(head) : -len(tail)] async for key in keys])

    # ---- runs ---------------------------------------------------------------------------

    async def create_run(
        self,
        run_id: str,
        datasets: list[DatasetConfig],
        n_samples_per_prompt: int,
        max_queued_groups: int = 0,
        vocab_size: int = 0,
    ) -> bool:
        """Register a run and load its datasets into Redis. The same spec again is a no-op."""
        k = self.keys(run_id)
        if n_samples_per_prompt < 1:
            raise InvalidArgument("n_samples_per_prompt must be at least 1")
        if max_queued_groups < 0:
            raise InvalidArgument("max_queued_groups must not be negative (0 = unlimited)")
        if vocab_size < 0:
            raise InvalidArgument("vocab_size must not be negative (0 = unknown)")
        if not any(not d.eval for d in datasets):
            raise InvalidArgument("a run needs at least one training dataset (eval = false)")
        check_dataset_names(datasets)
        spec = {
            "datasets": [d.model_dump() for d in datasets],
            "n_samples_per_prompt": n_samples_per_prompt,
            "max_queued_groups": max_queued_groups,
            "vocab_size": vocab_size,
        }
        existing = await self.redis.get(k.spec)
        if existing is not None:
            old = json.loads(existing)
            # runs created before a dataset option existed have its default
            old["datasets"] = [{**dataset_defaults(), **d} for d in old["datasets"]]
            old.setdefault("vocab_size", 0)
            if {kk: v for kk, v in old.items() if kk not in _SPEC_ONLY_AT_CREATION} != spec:
                raise FailedPrecondition(f"run {run_id!r} exists with a different spec; delete it first")
            return False
        sizes, skipped = await self.prompts.load(k, datasets)
        # token: this incarnation of the run (keys the group cache; see rlmesh.buffer.cache)
        spec.update(sizes=sizes, skipped=skipped, created_at=time.time(), token=uuid.uuid4().hex)
        # SET NX: of two replicas racing to create the same run, one wins (and with the same
        # spec wrote the same data); the other reports what it found.
        if not await self.redis.set(k.spec, json.dumps(spec), nx=True):
            return await self.create_run(run_id, datasets, n_samples_per_prompt, max_queued_groups, vocab_size)
        return True

    async def close_run(self, run_id: str) -> int:
        """The run is over: it takes no more writes of prompts or groups, and what only a
        live run reads is deleted (UNLINK: a large dataset is freed in the background, and
        deletes pass even when Redis is at its maxmemory); returns how many keys went."""
        k = self.keys(run_id)
        spec = await self._spec(run_id)
        # (first: the prompts still handed out or partial when it ended are counted, as
        # `unfinished_at_close`, before they go; a repeated CloseRun counts nothing)
        await self._close(keys=[k.closed, k.prompts, k.partial_groups, k.stats], args=[time.time()])
        return await self.redis.unlink(
            *(k.data(d["name"]) for d in spec["datasets"]), *(getattr(k, n) for n in CLOSED_RUN_DROPS)
        )

    async def delete_run(self, run_id: str) -> int:
        base = self.keys(run_id).base
        deleted = 0
        pattern = "".join("\\" + c if c in "\\*?[]" else c for c in base) + "*"  # run ids are not globs
        async for key in self.redis.scan_iter(match=pattern, count=1000):
            deleted += await self.redis.delete(key)
        return deleted

    # ---- completed and partial groups ---------------------------------------------------

    async def put_groups(self, run_id: str, groups, raw_groups=None) -> tuple[int, int]:
        """Store completed groups (idempotent on group_id, all or nothing under the cap).
        `raw_groups`: the groups' bytes as received, stored as they are."""
        if not groups:
            raise InvalidArgument("PutGroups needs at least one group")
        k = self.keys(run_id)
        await self._validate(run_id, groups)
        args: list = [self.recent_groups]
        raw_groups = raw_groups or [g.SerializeToString() for g in groups]
        for g, raw in zip(groups, raw_groups):
            args += [g.group_id, raw, _meta(g)]
        keys = [
            k.spec,
            k.groups,
            k.queue,
            k.acked,
            k.discarded,
            k.prompt_leases,
            k.prompts,
            k.stats,
            k.meta,
            k.closed,
            k.recent_ids,
            k.retained,
        ]
        result = await self._put(keys=keys, args=args)
        if result[0] == -1:
            raise unknown_run(run_id)
        if result[0] == -3:
            raise closed_run(run_id)
        if result[0] == -2:
            spec = await self._spec(run_id)
            if len(groups) > spec["max_queued_groups"]:  # waiting would never help
                raise FailedPrecondition(
                    f"run {run_id!r}: a write of {len(groups)} groups can never fit under the queue cap of "
                    f"{spec['max_queued_groups']}; write fewer groups per call or raise max_queued_groups"
                )
            raise ResourceExhausted(
                f"run {run_id!r}: the buffer holds {result[1]} queued groups and its cap is "
                f"{spec['max_queued_groups']}; retry after the trainer has consumed some"
            )
        token = result[1].decode()
        for position in result[2:]:
            self.cache.put(token, groups[position].group_id, raw_groups[position])
        if result[0]:
            self._queued.notify(run_id)
        return result[0], len(groups) - result[0]

    async def recent(self, run_id: str, offset: int, limit: int) -> tuple[list[bytes], int]:
        """The newest stored groups' bytes (newest first), `limit` of them from `offset`,
        and how many are kept."""
        k = self.keys(run_id)
        await self._spec(run_id)  # NotFound for an unknown run
        total, *groups = await self._recent(
            keys=[k.recent_ids, k.groups], args=[offset, offset + limit - 1 if limit else -1]
        )
        return groups, total

    async def return_partial_groups(self, run_id: str, groups, raw_groups=None) -> int:
        if not groups:
            raise InvalidArgument("ReturnPartialGroups needs at least one group")
        k = self.keys(run_id)
        await self._validate(run_id, groups)
        args: list = []
        for g, raw in zip(groups, raw_groups or [g.SerializeToString() for g in groups]):
            args += [g.group_id, raw]
        keys = [
            k.spec,
            k.partial,
            k.partial_groups,
            k.prompt_leases,
            k.prompts,
            k.stats,
            k.groups,
            k.acked,
            k.discarded,
            k.closed,
        ]
        n = await self._return_partial(keys=keys, args=args)
        if n < 0:
            raise unknown_run(run_id) if n == -1 else closed_run(run_id)
        return n

    async def _validate(self, run_id: str, groups) -> None:
        """Refuse a whole write whose groups a trainer could never use (see
        rlmesh.common.sample.validate_group_proto): the writer gets the error, so nothing is
        lost silently."""
        vocab_size = (await self._spec(run_id)).get("vocab_size", 0)
        try:
            validate_groups_proto(groups, vocab_size)
        except ConversionError as e:
            raise InvalidArgument(
                f"run {run_id!r}: {e}; the write was refused whole: none of its groups was stored"
            ) from None

    async def drop_groups(self, run_id: str, group_ids, reason: str) -> int:
        if not group_ids:
            raise InvalidArgument("DropGroups needs at least one group id")
        k = self.keys(run_id)
        n = await self._drop(
            keys=[k.spec, k.prompt_leases, k.prompts, k.stats, k.discarded, k.closed],
            args=[reason or "unspecified", *group_ids],
        )
        if n < 0:
            raise unknown_run(run_id) if n == -1 else closed_run(run_id)
        return n

    async def stored_groups(self, run_id: str) -> list[bytes]:
        """Completed groups not finally acknowledged: queued (oldest first), leased, then
        acknowledged provisionally."""
        await self._spec(run_id)
        k = self.keys(run_id)
        ids = await self.redis.lrange(k.queue, 0, -1)
        for lease_id in await self.redis.zrange(k.batch_leases, 0, -1):
            ids += await self.redis.lrange(k.batch(lease_id.decode()), 0, -1)
        ids += await self.redis.lrange(k.provisional, 0, -1)
        raws = await self.redis.hmget(k.groups, ids) if ids else []
        return [r for r in raws if r is not None]

    async def dead_letters(self, run_id: str) -> list[DeadLetter]:
        """The run's dead-letter list, oldest first."""
        await self._spec(run_id)
        k = self.keys(run_id)
        ids = await self.redis.lrange(k.dead_letters, 0, -1)
        if not ids:
            return []
        pipe = self.redis.pipeline(transaction=True)
        pipe.hmget(k.dead_groups, ids)
        pipe.hmget(k.dead_reasons, ids)
        raws, reasons = await pipe.execute()
        return [DeadLetter(raw, (reason or b"").decode()) for raw, reason in zip(raws, reasons) if raw is not None]

    # ---- training batches ---------------------------------------------------------------

    async def lease_batch(
        self,
        run_id: str,
        *,
        num_groups: int = 0,
        num_samples: int = 0,
        lease_seconds: float,
        wait_seconds: float = 0.0,
        min_weight_version: int = 0,
        keep_stale: bool = False,
        poll_seconds: float = 0.02,
        lease_id: str = "",
        min_groups: dict[str, int] | None = None,
    ) -> LeasedBatch:
        """Lease whole groups: exactly num_groups, or the fewest holding num_samples;
        none if the queue has too few after wait_seconds. With the caller's `lease_id`, a
        retried call answers the lease that the first one took, while it lives. min_groups:
        the least groups of each named dataset the batch holds (filters.with_minimums)."""
        if (num_groups > 0) == (num_samples > 0) or num_groups < 0 or num_samples < 0:
            raise InvalidArgument("set exactly one of num_groups and num_samples (a positive number)")
        if min_weight_version < 0:
            raise InvalidArgument("min_weight_version must not be negative (0 = any)")
        if lease_seconds <= 0:
            raise InvalidArgument("lease_seconds must be positive (0 = the service default)")
        if lease_id and not _LEASE_ID.fullmatch(lease_id):
            raise InvalidArgument("lease_id must be 1-64 letters, digits, '_' or '-' (or empty: the buffer chooses)")
        minimums = check_minimums(min_groups or {}, num_groups)
        k = self.keys(run_id)
        deadline = time.monotonic() + max(wait_seconds, 0.0)
        lease_id = lease_id or uuid.uuid4().hex
        keys = self._lease_keys(k, lease_id)
        dropped = 0
        head = [k.batch(""), lease_id, lease_seconds, self.max_deliveries]  # (expiries on Redis's clock)
        filtered = self.buffer_filter is not None or bool(minimums)
        while True:
            tried_at = time.monotonic()
            with self._queued.watch(run_id) as queued:
                if not filtered:
                    result = await self._lease_fifo(
                        keys=keys, args=[*head, num_groups, num_samples, min_weight_version, int(keep_stale)]
                    )
                else:
                    result = await self._lease_filtered(
                        keys, head, num_groups, num_samples, min_weight_version, keep_stale, minimums
                    )
                if result[0] == -1:
                    raise unknown_run(run_id)
                dropped += result[1]
                if result[0] > 0:
                    await fault_point("buffer.after_lease")  # (the lease is taken; its reply is not sent yet)
                    groups = await self._group_bytes(k, result[3].decode(), [i.decode() for i in result[4:]])
                    return LeasedBatch(result[0], lease_response(lease_id, groups, result[2], dropped))
                left = deadline - time.monotonic()
                if left <= 0:
                    return LeasedBatch(0, lease_response("", [], 0, dropped))
                await asyncio.wait({queued}, timeout=min(poll_seconds, left))
            if filtered:  # (a try reads up to filter_window groups: a stream of writes waits a little between tries)
                gap = min(poll_seconds, FILTERED_LEASE_GAP_SECONDS)
                await asyncio.sleep(max(0.0, min(tried_at + gap, deadline) - time.monotonic()))

    @staticmethod
    def _lease_keys(k: RunKeys, lease_id: str) -> list[str]:
        """KEYS of the lease scripts and REJECT_GROUPS (see rlmesh.buffer.scripts)."""
        return [
            k.spec,
            k.queue,
            k.batch_leases,
            k.groups,
            k.meta,
            k.stats,
            k.discarded,
            k.batch(lease_id),
            k.deliveries,
            k.dead_letters,
            k.dead_groups,
            k.dead_reasons,
            k.rollbacks,
        ]

    async def _group_bytes(self, k: RunKeys, token: str, ids: list[str]) -> list:
        """The leased groups' bytes, in order: from this replica's cache, else Redis."""
        found = [self.cache.pop(token, gid) for gid in ids]
        missing = [gid for gid, data in zip(ids, found) if data is None]
        if missing:
            from_redis = dict(zip(missing, await self.redis.hmget(k.groups, missing)))
            found = [data if data is not None else from_redis[gid] for gid, data in zip(ids, found)]
        return [data for data in found if data is not None]  # None: the run was deleted meanwhile

    async def _lease_filtered(
        self,
        keys: list[str],
        head: list,
        num_groups: int,
        num_samples: int,
        min_version: int,
        keep_stale: bool,
        minimums: dict[str, int],
    ) -> list:
        """The buffer filter (and the lease's minimums) pick from a snapshot of the queue; the
        claim is atomic and fails if another replica took a chosen group meanwhile (then pick
        again)."""
        queue, meta = keys[1], keys[4]
        result: list = [0, 0]
        for _ in range(8):
            await self._requeue(keys=keys, args=head)
            ids = [i.decode() for i in await self.redis.lrange(queue, 0, self.filter_window - 1)]
            metas = await self.redis.hmget(meta, ids) if ids else []
            queued = [decode_meta(gid, raw, pos) for pos, (gid, raw) in enumerate(zip(ids, metas))]

            def stale(g):
                return min_version > 0 and 0 <= g.oldest_weight_version < min_version

            drop = [g.group_id for g in queued if stale(g)] if not keep_stale else []
            eligible = [g for g in queued if keep_stale or not stale(g)]
            ordered = self.buffer_filter(eligible) if self.buffer_filter is not None else eligible
            if minimums:
                ordered = with_minimums(ordered, minimums)
            known = {g.group_id for g in eligible}
            if any(g.group_id not in known for g in ordered):
                raise RlmeshError("the buffer filter returned a group that was not offered to it (a filter bug)")
            if len({g.group_id for g in ordered}) != len(ordered):
                raise RlmeshError("the buffer filter returned a group twice (a filter bug)")
            take, samples = [], 0
            for g in ordered:
                if (num_groups and len(take) >= num_groups) or (num_samples and samples >= num_samples):
                    break
                take.append(g)
                samples += g.num_samples
            if len(take) < num_groups or samples < num_samples:
                take = []
            stale_kept = sum(1 for g in take if stale(g))
            result = await self._lease_chosen(
                keys=keys, args=[*head, len(take), len(drop), stale_kept, *(g.group_id for g in take), *drop]
            )
            if result[0] != -2:
                return result
        return [0, 0]  # contended: try again at the next poll

    async def ack_batch(
        self, run_id: str, lease_id: str, step: int = 0, provisional: bool = False, load_id: str = ""
    ) -> int:
        """The lease's groups were trained (at `step`, by the trainer's load `load_id` of the
        model): final now, or, `provisional`, once a checkpoint holding the step is committed
        (commit_acks / rollback_to_checkpoint)."""
        if not lease_id:
            raise InvalidArgument("lease_id is required")
        _check_step(step, "step")
        _check_load_id(load_id)
        k = self.keys(run_id)
        n = await self._ack(
            keys=[
                k.spec,
                k.batch_leases,
                k.batch(lease_id),
                k.groups,
                k.acked,
                k.stats,
                k.meta,
                k.deliveries,
                k.provisional,
                k.provisional_steps,
                k.acked_leases,
                k.acked_lease_order,
                k.rollbacks,
            ],
            args=[lease_id, int(provisional), step, _REMEMBERED_ACKED_LEASES, load_id],
        )
        if n == -2:
            raise unknown_run(run_id)
        if n == -1:
            raise NotFound(
                f"lease {lease_id!r} of run {run_id!r} is unknown or has expired (its groups were redelivered)"
            )
        await fault_point("buffer.after_ack")  # (acknowledged in Redis; the reply is not sent yet)
        return n

    async def commit_acks(
        self, run_id: str, through_step: int, load_id: str = "", loaded_step: int = 0
    ) -> tuple[int, int]:
        """Provisional acknowledgments of steps <= through_step become final: (committed,
        requeued). Those of another load than `load_id` (a dead trainer's, which its successor's
        rollback_to_checkpoint, a write Redis may have lost, should have settled) are settled
        as that rollback would: final through `loaded_step`, queued again past it."""
        _check_step(through_step, "through_step")
        _check_step(loaded_step, "loaded_step")
        _check_load_id(load_id)
        k = self.keys(run_id)
        keys = [*self._lease_keys(k, ""), k.acked, k.provisional, k.provisional_steps]
        result = await self._commit_acks(keys=keys, args=[through_step, load_id, loaded_step])
        if result[0] == -2:
            raise unknown_run(run_id)
        if result[1]:
            self._queued.notify(run_id)
        return result[0], result[1]

    async def rollback_to_checkpoint(self, run_id: str, step: int) -> tuple[int, int, int]:
        """A trainer (re)started from its checkpoint at `step`: (committed, requeued, leases released)."""
        _check_step(step, "step")
        k = self.keys(run_id)
        keys = [*self._lease_keys(k, ""), k.acked, k.provisional, k.provisional_steps]
        result = await self._rollback(keys=keys, args=[k.batch(""), step, self.max_deliveries, self.max_rollbacks])
        if result[0] == -2:
            raise unknown_run(run_id)
        if result[1] or result[2]:
            self._queued.notify(run_id)
        return result[0], result[1], result[2]

    async def release_batch(self, run_id: str, lease_id: str) -> int:
        """Give up a live lease untrained: its groups are queued again at once (0: no such lease)."""
        if not _LEASE_ID.fullmatch(lease_id):
            raise InvalidArgument("lease_id must be 1-64 letters, digits, '_' or '-'")
        k = self.keys(run_id)
        n = await self._release(keys=self._lease_keys(k, lease_id), args=[lease_id])
        if n == -2:
            raise unknown_run(run_id)
        if n > 0:
            self._queued.notify(run_id)
        return n

    async def reject_groups(self, run_id: str, lease_id: str, reasons: dict[str, str]) -> int:
        """Move groups of a live lease to the dead-letter list ({group_id: reason}); all or nothing."""
        if not lease_id:
            raise InvalidArgument("lease_id is required")
        if not reasons:
            raise InvalidArgument("RejectGroups needs at least one group")
        k = self.keys(run_id)
        args: list = [lease_id]
        for group_id, reason in reasons.items():
            args += [group_id, (reason or "unspecified")[:_MAX_REASON]]
        result = await self._reject(keys=self._lease_keys(k, lease_id), args=args)
        if result[0] == -2:
            raise unknown_run(run_id)
        if result[0] == -1:
            raise NotFound(
                f"lease {lease_id!r} of run {run_id!r} is unknown or has expired (its groups were redelivered)"
            )
        if result[0] == -3:
            raise InvalidArgument(
                f"group {result[1].decode()!r} is not in lease {lease_id!r} of run {run_id!r}; nothing was rejected"
            )
        return result[0]

    # ---- stats --------------------------------------------------------------------------

    async def stats(self, run_id: str, min_weight_version: int = 0) -> dict:
        """The run's counters, by the field names of the BufferStats message (see rlmesh.buffer.stats)."""
        _check_step(min_weight_version, "min_weight_version")
        spec = await self._spec(run_id)
        return await run_stats(self.redis, self.keys(run_id), spec, self.rate_window_seconds, min_weight_version)


def _check_step(step: int, name: str) -> None:
    if step < 0:
        raise InvalidArgument(f"{name} must not be negative, got {step}")


def _check_load_id(load_id: str) -> None:
    if load_id and not _LEASE_ID.fullmatch(load_id):
        raise InvalidArgument("load_id must be empty or 1-64 letters, digits, '_' or '-'")


def _meta(g: sample_pb2.SampleGroup) -> str:
    """The group's summary for scripts and filters (one pass: this runs on every write)."""
    oldest, rewards = -1, []
    for s in g.samples:
        rewards.append(s.reward)
        versions = s.weight_versions
        if versions:
            v = versions[0] if len(versions) == 1 else min(versions)
            if oldest < 0 or v < oldest:
                oldest = v
    return encode_meta(len(rewards), oldest, g.group_index, g.dataset, rewards)


def lease_response(lease_id: str, groups: list[bytes], stale_kept: int, stale_dropped: int) -> bytes:
    """A LeaseBatchResponse in wire form, its groups the stored bytes as they are."""
    head = buffer_pb2.LeaseBatchResponse(
        lease_id=lease_id, stale_groups=stale_kept, stale_groups_dropped=stale_dropped
    ).SerializeToString()
    return repeated_messages(2, groups, head)
