"""A run's prompt source: its datasets loaded into Redis when the run is created, prompt
groups leased from the cursor (GetPrompts), and rows read as they are for evaluation
(GetEvalPrompts). The keys are described in rlmesh.buffer.store."""

from __future__ import annotations

import asyncio
import json
import re

import redis.asyncio as aioredis

from rlmesh.buffer import prompt_scripts
from rlmesh.buffer.datasets import epoch_order, load_dataset, record_to_samples
from rlmesh.buffer.keys import RunKeys, closed_run, read_spec, run_keys, unknown_run
from rlmesh.buffer.sources import DataFiles
from rlmesh.common.errors import InvalidArgument, NotFound
from rlmesh.common.run_config import DatasetConfig
from rlmesh.common.sample import SampleGroup, group_to_proto

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")


def check_dataset_names(datasets: list[DatasetConfig]) -> None:
    names = set()
    for d in datasets:
        if not _NAME.fullmatch(d.name) or d.name == "__groups__":
            raise InvalidArgument(
                f"dataset name must be 1-128 letters, digits, '_', '.' or '-' (not '__groups__'), got {d.name!r}"
            )
        if d.name in names:
            raise InvalidArgument(f"dataset names must be unique; {d.name!r} appears twice")
        names.add(d.name)


class PromptSource:
    def __init__(self, redis: aioredis.Redis, key_prefix: str, data_files: DataFiles) -> None:
        self.redis = redis
        self.key_prefix = key_prefix
        self.data_files = data_files
        self._get_prompts = redis.register_script(prompt_scripts.GET_PROMPTS)
        self._materialize = redis.register_script(prompt_scripts.MATERIALIZE)

    async def load(self, k: RunKeys, datasets: list[DatasetConfig]) -> tuple[dict[str, int], dict[str, int]]:
        """Write each dataset's prompt records to Redis: (records, prompts skipped) by dataset name."""
        sizes, skipped = {}, {}
        for dataset in datasets:
            # Reading, templating and measuring prompts is CPU work: keep the event loop free.
            loaded = await asyncio.to_thread(load_dataset, dataset, self.data_files)
            pipe = self.redis.pipeline(transaction=True)
            pipe.delete(k.data(dataset.name))
            for start in range(0, len(loaded.records), 1000):
                pipe.rpush(k.data(dataset.name), *[json.dumps(r) for r in loaded.records[start : start + 1000]])
            await pipe.execute()
            sizes[dataset.name], skipped[dataset.name] = len(loaded.records), loaded.skipped
        return sizes, skipped

    async def get_prompts(
        self,
        run_id: str,
        num_groups: int,
        lease_seconds: float,
        within_queue_cap: bool = False,
        max_groups_ahead: int = 0,
        reclaim_leases: bool = False,
    ) -> list[bytes]:
        """Serialized prompt groups, leased: expired leases first, then partial groups,
        then fresh prompts from the cursor (see prompt_scripts.GET_PROMPTS); with
        `within_queue_cap`, no more than keep queued + being generated within the run's cap
        (or within `max_groups_ahead`, when set and tighter); `reclaim_leases`: every live
        prompt lease of the run expires first (its generator is gone)."""
        if num_groups < 1:
            raise InvalidArgument("num_groups must be at least 1")
        if lease_seconds <= 0:
            raise InvalidArgument("lease_seconds must be positive (0 = the service default)")
        if max_groups_ahead < 0:
            raise InvalidArgument("max_groups_ahead must be 0 (the queue cap alone) or positive")
        k = run_keys(self.key_prefix, run_id)
        out = await self._get_prompts(
            keys=[
                k.spec,
                k.cursor,
                k.prompt_leases,
                k.prompts,
                k.partial,
                k.partial_groups,
                k.stats,
                k.closed,
                k.queue,
            ],
            # (the lease's expiry is set on Redis's clock)
            args=[lease_seconds, num_groups, int(within_queue_cap), max_groups_ahead, int(reclaim_leases)],
        )
        if out[0] == -1:
            raise unknown_run(run_id)
        if out[0] == -3:
            raise closed_run(run_id)
        ids, values = out[1::2], out[2::2]
        refs = [(i, v) for i, v in enumerate(values) if v.startswith(b"ref:")]
        if refs:
            built = await self._build_prompt_groups(run_id, [v for _, v in refs])
            args = []
            for (i, ref), raw in zip(refs, built):
                values[i] = raw
                args += [ids[i], ref, raw]
            await self._materialize(keys=[k.prompts], args=args)
        return values

    async def _build_prompt_groups(self, run_id: str, refs: list[bytes]) -> list[bytes]:
        k = run_keys(self.key_prefix, run_id)
        spec = await read_spec(self.redis, k, run_id)
        by_name = {d["name"]: d for d in spec["datasets"]}
        wanted = []
        pipe = self.redis.pipeline(transaction=False)
        for ref in refs:
            r = json.loads(ref[4:])
            d = by_name[r["d"]]
            epoch, offset = divmod(int(r["p"]), spec["sizes"][d["name"]])
            row = int(epoch_order(spec["sizes"][d["name"]], d["seed"], epoch, d["shuffle"])[offset])
            pipe.lindex(k.data(d["name"]), row)
            wanted.append((int(r["i"]), d["name"]))
        records = await pipe.execute()
        n = spec["n_samples_per_prompt"]
        groups = [
            SampleGroup(f"g{gi}", gi, record_to_samples(json.loads(rec), gi, n, name), name)
            for (gi, name), rec in zip(wanted, records)
        ]
        return [group_to_proto(g).SerializeToString() for g in groups]

    async def get_eval_prompts(
        self,
        run_id: str,
        dataset: str,
        offset: int = 0,
        limit: int = 0,
        n_samples_per_prompt: int = 1,
        wrap: bool = False,
    ) -> list[bytes]:
        """Serialized groups of a dataset's prompts, rows offset.. (limit 0 = all); no lease.
        `wrap`: row offset + j is row (offset + j) mod the dataset's length, so `limit` rows
        always come back (a warm start cycling its own dataset); group ids count on past the end."""
        k = run_keys(self.key_prefix, run_id)
        spec = await read_spec(self.redis, k, run_id)
        if await self.redis.exists(k.closed):
            raise closed_run(run_id)
        by_name = {d["name"]: d for d in spec["datasets"]}
        if dataset not in by_name:
            raise NotFound(f"run {run_id!r} has no dataset {dataset!r}; it has {sorted(by_name)}")
        if offset < 0 or limit < 0 or n_samples_per_prompt < 1:
            raise InvalidArgument("offset and limit must not be negative, n_samples_per_prompt must be positive")
        key = k.data(dataset)
        if wrap:
            if not limit:
                raise InvalidArgument("a wrapping read needs a limit (it would never end)")
            size = await self.redis.llen(key)
            rows_at = [(offset + j) % size for j in range(limit)] if size else []
            async with self.redis.pipeline(transaction=False) as pipe:
                for i in rows_at:
                    pipe.lindex(key, i)
                rows = await pipe.execute()
            picked = [(offset + j, i, raw) for j, (i, raw) in enumerate(zip(rows_at, rows))]
        else:
            stop = -1 if limit <= 0 else offset + limit - 1
            rows = await self.redis.lrange(key, offset, stop)
            picked = [(i, i, raw) for i, raw in enumerate(rows, start=offset)]
        groups = []
        for at, i, raw in picked:
            samples = record_to_samples(json.loads(raw), i, n_samples_per_prompt, dataset)
            groups.append(group_to_proto(SampleGroup(f"eval:{dataset}:{at}", i, samples, dataset)).SerializeToString())
        return groups
