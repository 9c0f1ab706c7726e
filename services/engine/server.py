"""The reference engine's HTTP server: SGLang's native API (request and response shapes
as in /work/shared/reference/sglang-api.md) over `runner.Engine` and `weights`. Transport
only: parse JSON, hop threads, map errors to SGLang's answers —
`{"error": {"message"}}` with 400 for bad /generate input, `{"success": false,
"message"}` with 400 for failed weight operations, never a stack trace.

`rlmesh serve engine` runs `serve(settings)`; tests and `rlmesh up` use `start(settings)`,
which returns the running uvicorn server and its port."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from rlmesh.engine.config import Settings
from rlmesh.engine.runner import (
    Engine,
    GenerationRequest,
    RequestError,
    SamplingParams,
    build_response,
    parse_generate_body,
)
from rlmesh.engine.weights import (
    WeightGroups,
    WeightUpdateError,
    check_against_model,
    checkpoint_for_model,
    load_into_model,
    parse_dtype,
    parse_specs,
    read_checkpoint,
    receive,
    weights_by_name,
)

log = logging.getLogger(__name__)

_FLUSH_MESSAGE = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
_DISCONNECT_POLL_S = 1.0


class ServerClosing(Exception):
    """Answered with 503: the server is shutting down."""


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
        )
        self.groups = WeightGroups(self.engine.device, settings.weight_group_timeout_s)
        self.weight_lock = asyncio.Lock()
        self.unpaused = asyncio.Event()
        self.unpaused.set()
        self.closing = False

    def refuse_if_closing(self) -> None:
        if self.closing:
            raise ServerClosing("the engine server is shutting down")

    async def in_engine(self, fn: Callable[[], Any]) -> Any:
        """Run fn in the engine thread between decode steps and wait for its result."""
        return await asyncio.wrap_future(self.engine.run_between_steps(fn))

    def set_weight_version(self, version: Any) -> None:
        if version not in (None, ""):  # an update's earlier buckets leave the version as it is
            self.engine.weight_version = str(version)


def load_model(settings: Settings) -> tuple[torch.nn.Module, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if not settings.model_path:
        raise ValueError("model_path is required: a local Hugging Face checkpoint directory (--model-path)")
    if settings.num_threads > 0:
        torch.set_num_threads(settings.num_threads)
    hf_logging.disable_progress_bar()
    dtype = "auto" if settings.dtype == "auto" else parse_dtype(settings.dtype)
    model = AutoModelForCausalLM.from_pretrained(
        settings.model_path, dtype=dtype, attn_implementation=settings.attn_implementation
    )
    model.to(settings.device).eval()
    tokenizer = AutoTokenizer.from_pretrained(settings.tokenizer_path or settings.model_path)
    return model, tokenizer


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


def _result(success: bool, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"success": success, "message": message, **extra}, status_code=200 if success else 400)


async def _json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except ValueError:
        raise RequestError("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


def _listener(
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


def _set_once(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


# ---------------------------------------------------------------------------
# The app
# ---------------------------------------------------------------------------


def create_app(settings: Settings) -> FastAPI:
    """Load the model and build the app; the engine thread starts here and stops with the
    app's lifespan."""
    model, tokenizer = load_model(settings)
    state = EngineState(settings, model, tokenizer)
    state.engine.start()

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(state.engine.close)
        with contextlib.suppress(Exception):
            state.groups.destroy_all()

    app = FastAPI(title="rlmesh reference engine (SGLang HTTP API)", lifespan=lifespan)
    app.state.engine_state = state
    engine = state.engine

    @app.exception_handler(RequestError)
    async def on_request_error(_: Request, e: RequestError) -> JSONResponse:
        return _error(400, str(e))

    @app.exception_handler(WeightUpdateError)
    async def on_weight_error(_: Request, e: WeightUpdateError) -> JSONResponse:
        return _result(False, str(e))

    @app.exception_handler(ServerClosing)
    async def on_closing(_: Request, e: ServerClosing) -> JSONResponse:
        return _error(503, str(e))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error in %s", request.url.path)
        return _error(500, f"internal error in {request.url.path}: {type(e).__name__}: {e}")

    # -- generation --------------------------------------------------------

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = await _json_body(request)
        reqs, is_batch = parse_generate_body(body, tokenizer, engine.vocab_size)
        await state.unpaused.wait()  # new requests wait while generation is paused
        state.refuse_if_closing()
        if reqs[0].stream:
            return _stream(reqs, is_batch)
        loop = asyncio.get_running_loop()
        futures = []
        for req in reqs:
            future = loop.create_future()
            req.listener = _listener(loop, tokenizer, lambda r, _f, fut=future: _set_once(fut, r), stream=False)
            futures.append(future)
        engine.submit(reqs)
        try:
            await _wait_or_abort_on_disconnect(futures, request, reqs)
        finally:
            for req in reqs:
                if not req.finished:  # cancelled (server shutdown): stop the work
                    engine.abort(req.rid, message="The request was cancelled.", with_prefix=False)
        errors = [r.error for r in reqs if r.error]
        if errors:
            return _error(500, f"generation failed: {errors[0]}")
        results = [f.result() for f in futures]
        return JSONResponse(results if is_batch else results[0])

    async def _wait_or_abort_on_disconnect(
        futures: list[asyncio.Future], request: Request, reqs: list[GenerationRequest]
    ) -> None:
        pending = set(futures)
        while pending:
            _, pending = await asyncio.wait(pending, timeout=_DISCONNECT_POLL_S)
            if pending and await request.is_disconnected():
                for req in reqs:
                    engine.abort(req.rid, message="The client disconnected.", with_prefix=False)
                await asyncio.wait(pending)
                return

    def _stream(reqs: list[GenerationRequest], is_batch: bool) -> StreamingResponse:
        """SSE: `data: {...}` chunks with cumulative text and output ids, then [DONE]."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, dict[str, Any], bool]] = asyncio.Queue()
        for index, req in enumerate(reqs):
            req.listener = _listener(
                loop, tokenizer, lambda r, f, i=index: queue.put_nowait((i, r, f)), stream=True
            )
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

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await _json_body(request)
        rid = body.get("rid") or ""
        if not isinstance(rid, str):
            raise RequestError("rid must be a string")
        engine.abort(rid, abort_all=bool(body.get("abort_all")))
        return Response(status_code=200)

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> JSONResponse:
        mode = (await _json_body(request)).get("mode") or "abort"
        if mode not in ("abort", "retract", "in_place"):
            raise RequestError(f"mode must be 'abort', 'retract' or 'in_place', got {mode!r}")
        state.unpaused.clear()
        if mode == "abort":
            engine.abort(abort_all=True, message="Aborted by /pause_generation.")
        engine.pause(retract=mode == "retract")
        return JSONResponse({"message": "Generation paused successfully."})

    @app.post("/continue_generation")
    async def continue_generation(request: Request) -> JSONResponse:
        await _json_body(request)
        engine.resume()
        state.unpaused.set()
        return JSONResponse({"message": "Generation continued successfully."})

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> PlainTextResponse:
        # No prefix cache to flush; like SGLang, refuse while requests are in flight.
        return PlainTextResponse(_FLUSH_MESSAGE, status_code=200 if engine.num_active() == 0 else 400)

    # -- health and info ---------------------------------------------------

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.alive else 503)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        timeout = settings.health_generate_timeout_s
        if not engine.alive:
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
        probe.listener = _listener(loop, tokenizer, lambda r, _f: _set_once(future, r), stream=False)

        async def run_probe() -> None:
            await state.unpaused.wait()
            engine.submit([probe])
            await future

        try:
            await asyncio.wait_for(run_probe(), timeout)
        except (asyncio.TimeoutError, RequestError):
            engine.abort(probe.rid, message="health check timed out", with_prefix=False)
            return Response(status_code=503)
        return Response(status_code=200 if probe.error is None else 503)

    def model_info() -> dict[str, Any]:
        config = model.config
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
            **settings.model_dump(),
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
            "weight_version": engine.weight_version,
            "internal_states": [{"max_total_num_tokens": max_tokens, "last_gen_throughput": 0.0}],
        }

    for path in ("/get_model_info", "/model_info"):
        app.add_api_route(path, model_info, methods=["GET"])
    for path in ("/get_server_info", "/server_info"):
        app.add_api_route(path, server_info, methods=["GET"])

    # -- weights -----------------------------------------------------------

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request) -> JSONResponse:
        body = await _json_body(request)
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
        return _result(True, "Succeeded to initialize custom process group.")

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request) -> JSONResponse:
        body = await _json_body(request)
        async with state.weight_lock:
            state.groups.destroy(str(body.get("group_name") or "weight_update_group"))
        return _result(True, "Succeeded to destroy custom process group.")

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request) -> JSONResponse:
        body = await _json_body(request)
        specs = parse_specs(body.get("names"), body.get("dtypes"), body.get("shapes"))
        load_format = body.get("load_format")
        async with state.weight_lock:
            group = state.groups.get(str(body.get("group_name") or "weight_update_group"))
            if body.get("abort_all_requests"):
                engine.abort(abort_all=True, message="Aborted for a weight update.")
            # Receive everything before judging it, so rank 0's broadcasts never hang.
            named = await asyncio.to_thread(receive, specs, group, load_format, engine.device)
            check_against_model(model, named)

            def apply() -> None:
                load_into_model(model, named)
                state.set_weight_version(body.get("weight_version"))

            await state.in_engine(apply)
        return _result(True, "Succeeded to update parameter online.")

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        body = await _json_body(request)
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise WeightUpdateError("model_path is required: a checkpoint directory on the engine's machine")
        async with state.weight_lock:
            if body.get("abort_all_requests"):
                engine.abort(abort_all=True, message="Aborted for a weight update.")
            tensors = await asyncio.to_thread(read_checkpoint, path)
            named = checkpoint_for_model(model, tensors)

            def apply() -> None:
                load_into_model(model, named)
                state.set_weight_version(body.get("weight_version"))

            await state.in_engine(apply)
            state.model_path = path
        return _result(True, "Succeeded to update model weights.", num_paused_requests=0)

    @app.post("/begin_weight_update")
    async def begin_weight_update(request: Request) -> JSONResponse:
        await _json_body(request)  # sessions need no bookkeeping here: updates apply between steps
        return _result(True, "Weight update session started.")

    @app.post("/end_weight_update")
    async def end_weight_update(request: Request) -> JSONResponse:
        await _json_body(request)
        return _result(True, "Weight update session ended.")

    @app.post("/get_weights_by_name")
    async def get_weights_by_name(request: Request) -> JSONResponse:
        body = await _json_body(request)
        name, truncate = body.get("name"), body.get("truncate_size", 100)
        if not isinstance(name, str) or not isinstance(truncate, int) or truncate < 0:
            raise RequestError("name (string) is required; truncate_size must be a non-negative integer")
        try:
            values = await state.in_engine(lambda: weights_by_name(model, name, truncate))
        except WeightUpdateError as e:
            return _error(400, str(e))
        return JSONResponse(values)

    return app


# ---------------------------------------------------------------------------
# Running it
# ---------------------------------------------------------------------------


class EngineServer(uvicorn.Server):
    """A uvicorn server that, when it shuts down, first aborts in-flight generations so
    their HTTP answers carry the partial output (work handed back, not lost). Signals are
    left to `serve`, so it can return normally."""

    serve_task: asyncio.Task | None = None

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[override]
        yield

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        state: EngineState = self.config.app.state.engine_state
        state.closing = True
        state.engine.abort(abort_all=True, message="The server is shutting down.")
        state.unpaused.set()  # let waiting /generate calls reach the engine's refusal
        await super().shutdown(sockets)

    async def stop(self) -> None:
        self.should_exit = True
        if self.serve_task is not None:
            await self.serve_task


def _bind(host: str, port: int) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    sock.set_inheritable(True)
    return sock


async def start(settings: Settings) -> tuple[EngineServer, int]:
    """Load the model, start serving on settings.host:settings.port (0 picks a free port)
    in the running loop; returns once the server accepts connections."""
    app = await asyncio.to_thread(create_app, settings)
    sock = _bind(settings.host, settings.port)
    port = sock.getsockname()[1]
    app.state.engine_state.port = port
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=port,
        log_level=settings.log_level.lower(),
        access_log=False,
        # Longer than clients keep idle pooled connections, so a request never meets a
        # connection the server is just closing.
        timeout_keep_alive=30,
        timeout_graceful_shutdown=int(settings.shutdown_grace_s),
        lifespan="on",
    )
    server = EngineServer(config)
    server.serve_task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if server.serve_task.done():
            await server.serve_task  # raises what stopped it
            raise RuntimeError(f"the engine server on {settings.host}:{port} stopped while starting")
        await asyncio.sleep(0.02)
    return server, port


async def serve(settings: Settings) -> None:
    """Serve until SIGTERM/SIGINT; then abort in-flight requests (they answer with their
    partial output), let the answers go out, and stop."""
    import signal

    server, port = await start(settings)
    log.info("reference engine serving SGLang's HTTP API on http://%s:%d (model %s)", settings.host, port, settings.model_path)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    assert server.serve_task is not None
    await server.serve_task
