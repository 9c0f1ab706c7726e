"""Generation routes: POST /generate, answered whole or streamed as server-sent events."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from rlmesh.engine.http_common import EngineState, error_response, json_body, request_listener, set_once
from rlmesh.engine.protocol import GenerationRequest, parse_generate_body
from rlmesh.engine.runner import Engine

_DISCONNECT_POLL_S = 1.0


def generation_route(state: EngineState) -> Route:
    """POST /generate as a plain Starlette route, put first in the app's routes: every sample
    is one such request, and FastAPI's routing through included routers and its parameter
    handling cost twice what the handler does (a profile of a fully_async run). The app's
    middleware and exception handlers apply as to any route."""
    engine, tokenizer = state.engine, state.tokenizer

    async def generate(request: Request) -> Response:
        body = await json_body(request)
        reqs, is_batch = parse_generate_body(body, tokenizer, engine.vocab_size)
        await state.ready_to_generate()  # new requests wait while generation is paused or memory released
        state.refuse_unless_serving()
        if reqs[0].stream:
            return _stream(engine, tokenizer, reqs, is_batch)
        loop = asyncio.get_running_loop()
        futures = []
        for req in reqs:
            future = loop.create_future()
            req.listener = request_listener(loop, tokenizer, lambda r, _f, fut=future: set_once(fut, r), stream=False)
            futures.append(future)
        engine.submit(reqs)
        try:
            await _wait_or_abort_on_disconnect(engine, futures, request, reqs)
        finally:
            for req in reqs:
                if not req.finished:  # cancelled (server shutdown): stop the work
                    engine.abort(req.rid, message="The request was cancelled.", with_prefix=False)
        errors = [r.error for r in reqs if r.error]
        if errors:
            return error_response(500, f"generation failed: {errors[0]}")
        results = [f.result() for f in futures]
        return JSONResponse(results if is_batch else results[0])

    return Route("/generate", generate, methods=["POST"])


async def _wait_or_abort_on_disconnect(
    engine: Engine, futures: list[asyncio.Future], request: Request, reqs: list[GenerationRequest]
) -> None:
    pending = set(futures)
    while pending:
        _, pending = await asyncio.wait(pending, timeout=_DISCONNECT_POLL_S)
        if pending and await request.is_disconnected():
            for req in reqs:
                engine.abort(req.rid, message="The client disconnected.", with_prefix=False)
            await asyncio.wait(pending)
            return


def _stream(engine: Engine, tokenizer: Any, reqs: list[GenerationRequest], is_batch: bool) -> StreamingResponse:
    """SSE: `data: {...}` chunks with cumulative text and output ids, then [DONE]."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[int, dict[str, Any], bool]] = asyncio.Queue()
    for index, req in enumerate(reqs):
        req.listener = request_listener(loop, tokenizer, lambda r, f, i=index: queue.put_nowait((i, r, f)), stream=True)
    engine.submit(reqs)

    async def events() -> AsyncIterator[str]:
        remaining = len(reqs)
        try:
            while remaining:
                index, response, finished = await queue.get()
                if is_batch:
                    response["index"] = index
                yield f"data: {json.dumps(response, ensure_ascii=False)}\n\n"
                remaining -= finished
            yield "data: [DONE]\n\n"
        finally:
            for req in reqs:
                if not req.finished:  # the client went away
                    engine.abort(req.rid, message="The client disconnected.", with_prefix=False)

    return StreamingResponse(events(), media_type="text/event-stream")
