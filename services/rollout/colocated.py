"""Colocated mode in the engine pool: memory released and resumed on every engine, and
in-place weight updates from the trainer's memory relayed to every engine (SGLang's
/release_memory_occupation, /resume_memory_occupation, /update_weights_from_tensor)."""

from __future__ import annotations

import asyncio

from rlmesh.common.errors import InvalidArgument, Unavailable
from rlmesh.rollout.engine_client import EngineError, EnginePool

# SGLang's memory tags (sglang.srt.constants GPU_MEMORY_TYPE_*).
TAGS = ("weights", "kv_cache", "cuda_graph")
MAX_SERIALIZED_ENTRIES = 64  # one per TP rank of an engine
MAX_SERIALIZED_BYTES = 16 * 1024 * 1024  # all entries: paths, or SGLang's IPC handles (a few hundred bytes a tensor)


def _tags(tags: list[str]) -> list[str] | None:
    unknown = sorted(set(tags) - set(TAGS))
    if unknown:
        raise InvalidArgument(f"unknown memory tag(s) {unknown}: known tags are {list(TAGS)}")
    return list(dict.fromkeys(tags)) or None  # none: every tag (SGLang's null)


async def release_memory(pool: EnginePool, tags: list[str]) -> list[str]:
    """Every engine that answers gives back the tagged memory (an engine that is down
    holds none); returns the tags, or ['all']."""
    body = {"tags": _tags(tags)}
    await pool.each_answering(lambda e: e.weight_call("/release_memory_occupation", body))
    return body["tags"] or ["all"]


async def resume_memory(pool: EnginePool, tags: list[str]) -> list[str]:
    body = {"tags": _tags(tags)}
    await pool.each_answering(lambda e: e.weight_call("/resume_memory_occupation", body))
    return body["tags"] or ["all"]


async def update_weights_from_tensor(
    pool: EnginePool, serialized: list[str], load_format: str, weight_version: str, flush_cache: bool
) -> None:
    """Every engine that answers loads the trainer's tensors in place (the same body to
    each: they share the trainer's machine). An engine that is down is left out and
    gets the next update."""
    if not 1 <= len(serialized) <= MAX_SERIALIZED_ENTRIES:
        raise InvalidArgument(f"serialized_named_tensors needs 1 to {MAX_SERIALIZED_ENTRIES} entries (one per TP rank)")
    size = sum(len(s) for s in serialized)
    if size > MAX_SERIALIZED_BYTES:
        raise InvalidArgument(f"serialized_named_tensors holds {size} bytes, more than {MAX_SERIALIZED_BYTES}")
    members = [e for e, s in await pool.probe() if s.healthy]
    if not members:
        raise Unavailable("engines not answering: weights not updated")
    body = {
        "serialized_named_tensors": serialized,
        "load_format": load_format or None,
        "flush_cache": flush_cache,
        "abort_all_requests": False,
        "weight_version": weight_version or None,
    }

    async def one(engine) -> None:
        try:
            await engine.begin_weight_update()
            try:
                await engine.weight_call("/update_weights_from_tensor", body)
            finally:
                if weight_version or flush_cache:  # the push's last call ends its session
                    await engine.end_weight_update()
        except EngineError:
            pool.mark_down(engine)
            raise

    await asyncio.gather(*(one(e) for e in members))
    if weight_version:
        pool.mark_updated(members, weight_version)
