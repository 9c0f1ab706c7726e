"""The reference engine's HTTP server: SGLang's native API (documented in docs/engine-api.md)
over `runner.Engine` and `weights`. Transport only: parse JSON, hop threads, map errors to
SGLang's answers — `{"error": {"message"}}` with 400 for bad /generate input, `{"success":
false, "message"}` with 400 for failed weight operations, never a stack trace. The routes
live in the routes_* modules; `create_app` assembles them.

`rlmesh serve engine` runs `serve(settings)`; tests and `rlmesh up` use `start(settings)`,
which returns the running uvicorn server and its port."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rlmesh.common import auth, errors
from rlmesh.common.heap import freeze_long_lived
from rlmesh.common.http_guard import BodyLimit
from rlmesh.common.model_building import build_hf_model
from rlmesh.common.prometheus import metrics_response
from rlmesh.engine.config import Settings
from rlmesh.engine.errors import RequestError
from rlmesh.engine.http_common import EngineState, NotServing, error_response, result_response
from rlmesh.engine.metrics import engine_metrics
from rlmesh.engine.routes_colocated import colocated_router
from rlmesh.engine.routes_control import control_router
from rlmesh.engine.routes_generation import generation_route
from rlmesh.engine.routes_info import info_router
from rlmesh.engine.routes_weights import weights_router
from rlmesh.engine.weights import WeightUpdateError, parse_dtype

log = logging.getLogger(__name__)


def load_model(settings: Settings) -> tuple[torch.nn.Module, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if not settings.model_path:
        raise ValueError("model_path is required: a local Hugging Face checkpoint directory (--model-path)")
    if settings.num_threads > 0:
        torch.set_num_threads(settings.num_threads)
    hf_logging.disable_progress_bar()
    dtype = "auto" if settings.dtype == "auto" else parse_dtype(settings.dtype)
    model = build_hf_model(
        AutoModelForCausalLM.from_pretrained,
        settings.model_path,
        dtype=dtype,
        attn_implementation=settings.attn_implementation,
        local_files_only=True,
    )
    model.to(settings.device).eval()
    log.info("model %s loaded on %s (%s)", settings.model_path, settings.device, next(model.parameters()).dtype)
    tokenizer = AutoTokenizer.from_pretrained(settings.tokenizer_path or settings.model_path, local_files_only=True)
    return model, tokenizer


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
    # As SGLang's --api-key (and its exemptions): every route but health and metrics needs
    # the key. Without one of its own, the engine demands the stack's token like every service.
    api_key = settings.api_key or auth.required_token()
    if api_key:
        auth.add_http_token_check(
            app,
            api_key,
            lambda path: path.startswith(("/health", "/metrics")),
            lambda why: {"error": {"message": f"Unauthorized: {why}"}},
        )

    @app.exception_handler(RequestError)
    async def on_request_error(_: Request, e: RequestError) -> JSONResponse:
        return error_response(400, str(e))

    @app.exception_handler(WeightUpdateError)
    async def on_weight_error(_: Request, e: WeightUpdateError) -> JSONResponse:
        return result_response(False, str(e))

    @app.exception_handler(NotServing)
    async def on_not_serving(_: Request, e: NotServing) -> JSONResponse:
        return error_response(503, str(e))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error in %s", request.url.path)
        return error_response(500, f"internal error in {request.url.path}: {errors.unexpected(e)}")

    app.router.routes.insert(0, generation_route(state))  # (first: the route of every sample)
    for router in (
        control_router(state),
        info_router(state),
        weights_router(state),
        colocated_router(state),
    ):
        app.include_router(router)
    if settings.enable_metrics:
        metrics = engine_metrics(state.engine, settings.served_model_name or settings.model_path)

        @app.get("/metrics", include_in_schema=False)
        async def prometheus_metrics():
            return metrics_response(await metrics.render())

    app.add_middleware(BodyLimit, max_bytes=settings.max_request_bytes)
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
        state.awake.set()
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
        proxy_headers=False,  # (nothing here reads the client's address)
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
    freeze_long_lived()
    log.info(
        "reference engine serving SGLang's HTTP API on http://%s:%d (model %s)",
        settings.host,
        port,
        settings.model_path,
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    assert server.serve_task is not None
    await server.serve_task
