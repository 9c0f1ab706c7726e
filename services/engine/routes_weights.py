"""Weight routes: update groups, updates from a broadcast or from disk, update sessions, weight reads."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future

import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from rlmesh.common.errors import InvalidArgument
from rlmesh.common.paths import resolve_under
from rlmesh.engine.errors import RequestError
from rlmesh.engine.http_common import EngineState, error_response, json_body, result_response
from rlmesh.engine.weights import (
    BroadcastFailed,
    ReceiveBuffers,
    TensorPool,
    TensorSpec,
    WeightDelta,
    WeightUpdateError,
    apply_delta,
    check_against_model,
    check_delta_targets,
    checkpoint_for_model,
    install_into_model,
    load_into_model,
    parse_delta,
    parse_specs,
    read_checkpoint,
    receive,
    receive_bytes,
    receive_delta,
    weights_by_name,
)


def weights_router(state: EngineState) -> APIRouter:
    router = APIRouter()
    engine, model = state.engine, state.model
    buffers = ReceiveBuffers()  # for flattened buckets
    pool = TensorPool()  # for tensors received one by one

    @router.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request) -> JSONResponse:
        body = await json_body(request)
        try:
            address, port = str(body["master_address"]), int(body["master_port"])
            rank_offset, world_size = int(body["rank_offset"]), int(body["world_size"])
        except (KeyError, TypeError, ValueError) as e:
            raise WeightUpdateError(
                f"master_address, master_port, rank_offset and world_size are required ({type(e).__name__}: {e})"
            ) from None
        group_name = str(body.get("group_name") or "weight_update_group")
        backend = str(body.get("backend") or "nccl")
        async with state.weight_lock:
            await asyncio.to_thread(state.groups.init, address, port, rank_offset, world_size, group_name, backend)
        return result_response(True, "Succeeded to initialize custom process group.")

    @router.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request) -> JSONResponse:
        body = await json_body(request)
        async with state.weight_lock:
            state.groups.destroy(str(body.get("group_name") or "weight_update_group"))
            buffers.clear()
            pool.clear()
        return result_response(True, "Succeeded to destroy custom process group.")

    @router.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request) -> JSONResponse:
        body = await json_body(request)
        specs = parse_specs(body.get("names"), body.get("dtypes"), body.get("shapes"))
        delta = _requested_delta(state, body, specs)
        group_name = str(body.get("group_name") or "weight_update_group")
        async with state.weight_lock:
            group = state.groups.get(group_name)
            if body.get("abort_all_requests"):
                engine.abort(abort_all=True, message="Aborted for a weight update.")
            try:
                applied = await _receive_and_queue(state, body, specs, delta, group, buffers, pool)
            except BroadcastFailed:
                # Freed now rather than at exit, where each push cut short would leave one
                # behind. Rank 0 opens a new group for its next push.
                state.groups.destroy(group_name)
                raise
        await asyncio.wrap_future(applied)
        return result_response(True, "Succeeded to update parameter online.")

    @router.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        body = await json_body(request)
        path = _checkpoint_dir(state, body)
        async with state.weight_lock:
            if body.get("abort_all_requests"):
                engine.abort(abort_all=True, message="Aborted for a weight update.")
            tensors = await asyncio.to_thread(read_checkpoint, path)
            named = checkpoint_for_model(model, tensors)

            def apply() -> None:
                state.memory.check_resident()
                load_into_model(model, named)
                state.memory.loaded(named)
                state.set_weight_version(body.get("weight_version"))

            await state.in_engine(apply)
            state.model_path = path
        return result_response(True, "Succeeded to update model weights.", num_paused_requests=0)

    @router.post("/begin_weight_update")
    async def begin_weight_update(request: Request) -> JSONResponse:
        await json_body(request)  # sessions need no bookkeeping here: updates apply between steps
        return result_response(True, "Weight update session started.")

    @router.post("/end_weight_update")
    async def end_weight_update(request: Request) -> JSONResponse:
        await json_body(request)
        return result_response(True, "Weight update session ended.")

    @router.post("/get_weights_by_name")
    async def get_weights_by_name(request: Request) -> JSONResponse:
        body = await json_body(request)
        name, truncate = body.get("name"), body.get("truncate_size", 100)
        if not isinstance(name, str) or not isinstance(truncate, int) or truncate < 0:
            raise RequestError("name (string) is required; truncate_size must be a non-negative integer")
        try:
            values = await state.in_engine(lambda: weights_by_name(model, name, truncate), changes_weights=False)
        except WeightUpdateError as e:
            return error_response(400, str(e))
        return JSONResponse(values)

    return router


def _checkpoint_dir(state: EngineState, body: dict) -> str:
    """The checkpoint directory an /update_weights_from_disk body names, if under the weight roots."""
    path = body.get("model_path")
    if not isinstance(path, str) or not path:
        raise WeightUpdateError("model_path is required: a checkpoint directory on the engine's machine")
    try:
        return str(resolve_under(path, state.weight_roots, "model_path", "the engine's weight_roots"))
    except InvalidArgument as e:
        raise WeightUpdateError(str(e)) from None


def _requested_delta(state: EngineState, body: dict, specs: list[TensorSpec]) -> WeightDelta | None:
    """The delta an update asks for (None: a full update); refused unless weight_delta is on."""
    if body.get("rlmesh_delta") is None:
        return None
    if not state.settings.weight_delta:
        raise WeightUpdateError("this engine does not accept delta updates (weight_delta is off); push in full")
    return parse_delta(body["rlmesh_delta"], specs)


async def _receive_and_queue(
    state: EngineState,
    body: dict,
    specs: list[TensorSpec],
    delta: WeightDelta | None,
    group: torch.distributed.ProcessGroup,
    buffers: ReceiveBuffers,
    pool: TensorPool,
) -> Future:
    """Receive an update (full, or `delta`) and queue it to apply between engine steps; the
    caller holds the weight lock. A flattened bucket's buffer goes back to `buffers` once
    the model has it (or at once, on an error)."""
    engine = state.engine
    load_format = body.get("load_format")
    # Receive everything before judging it, so rank 0's broadcasts never hang.
    buffer = None
    try:
        if delta is None:
            if load_format == "flattened_bucket":
                try:
                    buffer = buffers.take(receive_bytes(specs, load_format), engine.device)
                except RuntimeError as e:  # (out of memory: rank 0's broadcast goes unreceived)
                    raise BroadcastFailed(f"receiving the broadcast failed: no memory for the bucket: {e}") from e
            apply = await _receive_full(state, body, specs, group, buffer, pool)
        else:
            apply = await _receive_delta(state, body, specs, delta, group)
        # Queued while the lock is held, so buckets apply in the order they arrived;
        # the next bucket's broadcast is received while this one is copied in.
        applied = engine.run_between_steps(apply)
    except BaseException:
        if buffer is not None:
            buffers.give(buffer)
        raise
    if buffer is not None:
        applied.add_done_callback(lambda _: buffers.give(buffer))  # free once the model has it
    return applied


async def _receive_full(
    state: EngineState,
    body: dict,
    specs: list[TensorSpec],
    group: torch.distributed.ProcessGroup,
    buffer: torch.Tensor | None,
    pool: TensorPool,
) -> Callable[[], None]:
    """Receive a full update (into `buffer` when it comes as a flattened bucket) and check it
    against the model; what installs it, to run between engine steps."""
    engine, model = state.engine, state.model
    load_format = body.get("load_format")
    # Room for the memory of two buckets in flight (one applied, one received).
    pool.limit_bytes = max(pool.limit_bytes, 2 * receive_bytes(specs, load_format))
    named = await asyncio.to_thread(receive, specs, group, load_format, engine.device, buffer, pool)
    check_against_model(model, named)

    def apply() -> None:
        state.memory.check_resident()
        if load_format is None:
            install_into_model(model, named, pool)
        else:
            load_into_model(model, named)
        state.memory.loaded(named)
        state.set_weight_version(body.get("weight_version"))

    return apply


async def _receive_delta(
    state: EngineState, body: dict, specs: list[TensorSpec], delta: WeightDelta, group: torch.distributed.ProcessGroup
) -> Callable[[], None]:
    """Receive a delta update and check its targets; what applies it, to run between engine steps."""
    engine, model = state.engine, state.model
    received = await asyncio.to_thread(receive_delta, specs, delta, group, engine.device)
    check_against_model(model, [(s.name, torch.empty(s.shape, device="meta")) for s in specs])
    check_delta_targets(model, specs)

    def apply() -> None:
        state.memory.check_resident()
        apply_delta(model, received, engine.weight_version)
        state.set_weight_version(body.get("weight_version"))

    return apply
