"""Shared by the route modules: EngineState, SGLang-shaped error answers, JSON bodies, request listeners."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from fastapi import Request
from fastapi.responses import JSONResponse

from rlmesh.common import safe_json, weight_file
from rlmesh.common.paths import resolve_roots
from rlmesh.engine.colocated import ModelMemory, WeightFiles
from rlmesh.engine.config import Settings
from rlmesh.engine.errors import RequestError
from rlmesh.engine.protocol import GenerationRequest, build_response
from rlmesh.engine.runner import Engine
from rlmesh.engine.weights import WeightGroups


class NotServing(Exception):
    """Answered with 503: the server is shutting down, or its weights hold nothing to sample from."""


class EngineState:
    """Everything the HTTP handlers share."""

    def __init__(self, settings: Settings, model: torch.nn.Module, tokenizer: Any) -> None:
        self.settings = settings
        self.model = model
        self.tokenizer = tokenizer
        self.model_path = settings.model_path
        self.tokenizer_path = settings.tokenizer_path or settings.model_path
        self.port = settings.port
        self.engine = Engine(
            model,
            tokenizer,
            max_batch_size=settings.max_batch_size,
            context_length=settings.context_length,
            weight_version=settings.weight_version,
            seed=settings.seed,
            prefix_cache_bytes=int(settings.prefix_cache_mb * 1024 * 1024),
        )
        self.groups = WeightGroups(self.engine.device, settings.weight_group_timeout_s)
        self.weight_lock = asyncio.Lock()
        self.unpaused = asyncio.Event()
        self.unpaused.set()
        # Colocated mode: cleared while memory is released (rlmesh.engine.colocated).
        self.awake = asyncio.Event()
        self.awake.set()
        self.memory = ModelMemory(model)
        # Where /update_weights_from_disk may read (resolved once: the paths it is given are checked against them).
        self.weight_roots = resolve_roots(
            settings.weight_roots or ([settings.model_path] if settings.model_path else [])
        )
        self.weight_files = WeightFiles(
            Path(settings.weight_file_dir) if settings.weight_file_dir else weight_file.default_dir()
        )
        self.closing = False

    async def ready_to_generate(self) -> None:
        """Until generation is neither paused nor released."""
        while not (self.unpaused.is_set() and self.awake.is_set()):
            await self.unpaused.wait()
            await self.awake.wait()

    def refuse_unless_serving(self) -> None:
        if self.closing:
            raise NotServing("the engine server is shutting down")
        if self.memory.needs_full_update:
            # (resumed memory is not restored: sampling from it would give noise, or fail)
            raise NotServing(
                "the weights were released (/release_memory_occupation) and no update has carried every "
                "parameter since: the engine generates again after a full weight update"
            )

    async def in_engine(self, fn: Callable[[], Any], changes_weights: bool = True) -> Any:
        """Run fn in the engine thread between decode steps and wait for its result."""
        return await asyncio.wrap_future(self.engine.run_between_steps(fn, changes_weights))

    def set_weight_version(self, version: Any) -> None:
        if version not in (None, ""):  # an update's earlier buckets leave the version as it is
            self.engine.weight_version = str(version)
            self.weight_files.prune()  # (weight files whose views an update replaced: let go)


def error_response(status: int, message: str) -> JSONResponse:
    """SGLang's error answer: {"error": {"message"}}."""
    return JSONResponse({"error": {"message": message}}, status_code=status)


def result_response(success: bool, message: str, **extra: Any) -> JSONResponse:
    """SGLang's answer to weight and session operations: {"success", "message"}, 200 or 400."""
    return JSONResponse({"success": success, "message": message, **extra}, status_code=200 if success else 400)


async def json_body(request: Request) -> dict[str, Any]:
    """The request's JSON object; an empty body counts as {}."""
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        body = safe_json.loads(raw)
    except ValueError:
        raise RequestError("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


def request_listener(
    loop: asyncio.AbstractEventLoop, tokenizer: Any, deliver: Callable[[dict[str, Any], bool], None], stream: bool
) -> Callable[[GenerationRequest, bool], None]:
    """A request listener (called in the engine thread) that builds the answer there and
    hands it to the event loop."""

    def listen(req: GenerationRequest, finished: bool) -> None:
        if not finished and not stream:
            return
        if req.error is not None:
            response = {"error": {"message": f"generation failed: {req.error}"}}
        else:
            response = build_response(req, tokenizer)
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is waiting
            loop.call_soon_threadsafe(deliver, response, finished)

    return listen


def set_once(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)
