"""Colocated-mode routes: /release_memory_occupation, /resume_memory_occupation and
/update_weights_from_tensor (rlmesh weight files only; see rlmesh.engine.colocated)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from rlmesh.common import weight_file
from rlmesh.engine.colocated import RELEASED_VERSION, parse_tags
from rlmesh.engine.http_common import EngineState, json_body, result_response
from rlmesh.engine.weights import WeightUpdateError, alias_into_model, check_against_model

MAX_SERIALIZED_ENTRIES = 64  # one per TP rank in SGLang's format


def colocated_router(state: EngineState) -> APIRouter:
    router = APIRouter()
    engine, memory = state.engine, state.memory

    @router.post("/release_memory_occupation")
    async def release_memory_occupation(request: Request) -> JSONResponse:
        tags = parse_tags((await json_body(request)).get("tags"))
        async with state.weight_lock:
            if engine.num_active():
                # As SGLang: memory goes only from an idle engine (its requests would lose their cache).
                raise WeightUpdateError(
                    f"{engine.num_active()} request(s) in flight: finish, pause or abort them before a release"
                )
            state.awake.clear()  # new /generate calls wait until everything is resumed

            def release() -> None:
                if "weights" in tags and not memory.weights_released:
                    memory.release_weights()
                    engine.weight_version = RELEASED_VERSION
                memory.released.update(tags)

            await state.in_engine(release)
            state.weight_files.prune()  # (released weights hold no file)
        return result_response(True, f"Released memory occupation of {sorted(tags)}.")

    @router.post("/resume_memory_occupation")
    async def resume_memory_occupation(request: Request) -> JSONResponse:
        tags = parse_tags((await json_body(request)).get("tags"))
        async with state.weight_lock:

            def resume() -> None:
                if "weights" in tags and memory.weights_released:
                    memory.resume_weights()  # (holding nothing until the next update: version stays "released")
                memory.released.difference_update(tags)

            await state.in_engine(resume)
            if not memory.released:
                state.awake.set()
        return result_response(True, f"Resumed memory occupation of {sorted(tags)}.")

    @router.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request) -> JSONResponse:
        await _update_from_weight_file(state, await json_body(request))
        return result_response(True, "Succeeded to update parameter online.")

    return router


def _weight_file_path(body: dict) -> object:
    """The weight file an /update_weights_from_tensor body names (rlmesh's format only)."""
    load_format = body.get("load_format")
    if load_format != weight_file.LOAD_FORMAT:
        raise WeightUpdateError(
            f"load_format {load_format!r} is not served: this engine takes colocated updates as rlmesh weight "
            f"files only (load_format {weight_file.LOAD_FORMAT!r}); SGLang's serialized (pickled) tensors "
            "are never loaded here"
        )
    entries = body.get("serialized_named_tensors")
    if not isinstance(entries, list) or not 1 <= len(entries) <= MAX_SERIALIZED_ENTRIES:
        raise WeightUpdateError(
            f"serialized_named_tensors must be a list of 1 to {MAX_SERIALIZED_ENTRIES} weight file paths "
            "(one per TP rank: this engine has one)"
        )
    return entries[0]


async def _update_from_weight_file(state: EngineState, body: dict) -> None:
    engine, memory = state.engine, state.memory
    path = _weight_file_path(body)
    async with state.weight_lock:
        if body.get("abort_all_requests"):
            engine.abort(abort_all=True, message="Aborted for a weight update.")
        loaded = await asyncio.to_thread(state.weight_files.open, path)
        try:
            check_against_model(state.model, loaded.named)
            memory.check_covers_unloaded(loaded.named)

            def apply() -> None:
                if memory.weights_released:  # an update to released weights takes their memory back first
                    memory.resume_weights()
                alias_into_model(state.model, loaded.named)
                memory.loaded(loaded.named)
                version = body.get("weight_version")
                state.set_weight_version(version)
                if version in (None, "") and engine.weight_version == RELEASED_VERSION:
                    engine.weight_version = "default"

            await state.in_engine(apply)
        finally:
            state.weight_files.done(loaded)
        if not memory.released:
            state.awake.set()
