"""Health and info routes: /health, /health_generate, /get_model_info, /get_server_info and aliases."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response

from rlmesh.common import weight_file
from rlmesh.common.weight_group import GPU_KEY, WEIGHT_DELTA_FORMAT, gpu_uuid
from rlmesh.engine.errors import RequestError
from rlmesh.engine.http_common import EngineState, request_listener, set_once
from rlmesh.engine.protocol import GenerationRequest
from rlmesh.engine.sampling_params import SamplingParams


def info_router(state: EngineState) -> APIRouter:
    router = APIRouter()
    engine, settings, tokenizer = state.engine, state.settings, state.tokenizer
    gpu = gpu_uuid(settings.device)

    @router.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.alive else 503)

    @router.get("/health_generate")
    async def health_generate() -> Response:
        timeout = settings.health_generate_timeout_s
        if not engine.alive or state.memory.needs_full_update:  # (released weights: nothing to sample from)
            return Response(status_code=503)
        if engine.num_active() and not engine.paused and time.monotonic() - engine.last_step_time < timeout:
            return Response(status_code=200)  # busy and making progress
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        probe = GenerationRequest(
            rid=f"HEALTH_CHECK_{uuid.uuid4().hex}",
            prompt_ids=[engine.pad_id],
            params=SamplingParams(max_new_tokens=1, temperature=0.0),
        )
        probe.listener = request_listener(loop, tokenizer, lambda r, _f: set_once(future, r), stream=False)

        async def run_probe() -> None:
            await state.ready_to_generate()
            engine.submit([probe])
            await future

        try:
            await asyncio.wait_for(run_probe(), timeout)
        except (asyncio.TimeoutError, RequestError):
            engine.abort(probe.rid, message="health check timed out", with_prefix=False)
            return Response(status_code=503)
        return Response(status_code=200 if probe.error is None else 503)

    def model_info() -> dict[str, Any]:
        config = state.model.config
        return {
            "model_path": state.model_path,
            "tokenizer_path": state.tokenizer_path,
            "served_model_name": settings.served_model_name or state.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": engine.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(config, "model_type", None),
            "architectures": getattr(config, "architectures", None),
        }

    def server_info() -> dict[str, Any]:
        max_tokens = settings.max_batch_size * engine.context_length
        return {
            **settings.model_dump(exclude={"api_key"}),  # SGLang lists its args; never the key
            "model_path": state.model_path,
            "tokenizer_path": state.tokenizer_path,
            "served_model_name": settings.served_model_name or state.model_path,
            "port": state.port,
            "tp_size": 1,
            "dp_size": 1,
            "pp_size": 1,
            "context_length": engine.context_length,
            "max_running_requests": settings.max_batch_size,
            "max_total_num_tokens": max_tokens,
            "random_seed": settings.seed,
            "version": settings.reported_version,
            "engine": "rlmesh-reference",
            "rlmesh_weight_delta": WEIGHT_DELTA_FORMAT if settings.weight_delta else None,
            "rlmesh_weight_file": weight_file.FORMAT,
            GPU_KEY: gpu or None,
            "weight_version": engine.weight_version,
            "internal_states": [{"max_total_num_tokens": max_tokens, "last_gen_throughput": 0.0}],
        }

    def weight_version() -> dict[str, Any]:
        # SGLang before 0.5.21 served this; RL clients (AReaL's among them) still ask it
        # first. Newer SGLang moved it into /model_info, which this engine serves too.
        return {"weight_version": engine.weight_version}

    for path in ("/get_weight_version", "/weight_version"):
        router.add_api_route(path, weight_version, methods=["GET"])
    for path in ("/get_model_info", "/model_info"):
        router.add_api_route(path, model_info, methods=["GET"])
    for path in ("/get_server_info", "/server_info"):
        router.add_api_route(path, server_info, methods=["GET"])

    return router
