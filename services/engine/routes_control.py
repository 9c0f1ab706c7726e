"""Flow-control routes: /abort_request, /pause_generation, /continue_generation and /flush_cache."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from rlmesh.engine.errors import RequestError
from rlmesh.engine.http_common import EngineState, json_body

_FLUSH_MESSAGE = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)


def control_router(state: EngineState) -> APIRouter:
    router = APIRouter()
    engine = state.engine

    @router.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await json_body(request)
        rid = body.get("rid") or ""
        if not isinstance(rid, str):
            raise RequestError("rid must be a string")
        engine.abort(rid, abort_all=bool(body.get("abort_all")))
        return Response(status_code=200)

    @router.post("/pause_generation")
    async def pause_generation(request: Request) -> JSONResponse:
        mode = (await json_body(request)).get("mode") or "abort"
        if mode not in ("abort", "retract", "in_place"):
            raise RequestError(f"mode must be 'abort', 'retract' or 'in_place', got {mode!r}")
        state.unpaused.clear()
        if mode == "abort":
            engine.abort(abort_all=True, message="Aborted by /pause_generation.")
        engine.pause(retract=mode == "retract")
        return JSONResponse({"message": "Generation paused successfully."})

    @router.post("/continue_generation")
    async def continue_generation(request: Request) -> JSONResponse:
        await json_body(request)
        engine.resume()
        state.unpaused.set()
        return JSONResponse({"message": "Generation continued successfully."})

    @router.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> PlainTextResponse:
        # Like SGLang, refuse while requests are in flight (their KV would go into the cache).
        if engine.num_active():
            return PlainTextResponse(_FLUSH_MESSAGE, status_code=400)
        await state.in_engine(lambda: None)  # (a task that may change weights empties the cache)
        return PlainTextResponse(_FLUSH_MESSAGE, status_code=200)

    return router
