"""The OpenAI-compatible HTTP server agents call: each sample's session under its own
token (`/samples/<token>/v1/...`), the routes that turn a request into one engine call,
and the one endpoint per event loop the 'openai_agent' generate function shares."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from rlmesh.common import safe_json
from rlmesh.common.errors import FailedPrecondition, validation_problems
from rlmesh.common.http_guard import BodyLimit
from rlmesh.rollout.agents.openai_models import (
    MODEL_NAME,
    ChatRequest,
    CompletionRequest,
    RequestError,
    error_response,
)
from rlmesh.rollout.agents.openai_session import AgentSession
from rlmesh.rollout.agents.openai_templates import (
    chat_answer,
    chat_prompt_ids,
    check_tools,
    completion_answer,
    completion_prompt_ids,
    refuse_unsupported,
    request_sampling,
    template_messages,
)

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 8 * 1024 * 1024


def _parse(model: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        # Where and what, without echoing the input back.
        problems = validation_problems(e, "body", most=10)
        raise RequestError(400, f"invalid request: {problems}") from None


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        return safe_json.loads(raw)
    except (ValueError, RecursionError):
        raise RequestError(400, "the request body is not valid JSON") from None


class _OpenAIBodyLimit(BodyLimit):
    """The body limit, answering in OpenAI's error shape."""

    async def _refuse(self, send) -> None:
        response = error_response(413, f"the request body is larger than the limit of {self.max_bytes} bytes")
        headers = [*response.raw_headers, (b"connection", b"close")]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": response.body})


# ---- the server --------------------------------------------------------------------------------


class _Server(uvicorn.Server):
    def capture_signals(self):  # type: ignore[override]
        # The rollout service handles its process's signals; uvicorn would take them over.
        return contextlib.nullcontext()


class OpenAIEndpoint:
    """The HTTP server agents call, and the samples registered with it by token."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.port = port
        self.sessions: dict[str, AgentSession] = {}
        self.app = self._build_app()
        self._server: _Server | None = None
        self._task: asyncio.Task | None = None

    @property
    def base_url(self) -> str:
        host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    def url_for(self, token: str) -> str:
        return f"{self.base_url}/samples/{token}/v1"

    def register(self, session: AgentSession) -> str:
        token = secrets.token_urlsafe(32)
        self.sessions[token] = session
        return token

    def unregister(self, token: str) -> None:
        session = self.sessions.pop(token, None)
        if session is not None:
            session.close()

    async def start(self) -> None:
        """Serve in the running loop; returns once connections are accepted."""
        # Bound here, not by uvicorn, which exits the process when it cannot bind.
        try:
            family, kind, proto, _, address = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)[0]
            sock = socket.socket(family, kind, proto)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
        except OSError as e:
            raise FailedPrecondition(
                f"the OpenAI-compatible endpoint for agents cannot listen on "
                f"{self.host}:{self.port} (settings openai_host / openai_port): {e}"
            ) from None
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            host=self.host,
            port=self.port,
            log_config=None,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=5,
            # longer than clients keep idle connections (httpx: 5 s)
            timeout_keep_alive=30,
        )
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                sock.close()
                await self._task  # raises what stopped it
                raise RuntimeError(f"the OpenAI-compatible endpoint on {self.host}:{self.port} stopped while starting")
            await asyncio.sleep(0.01)
        log.info("OpenAI-compatible endpoint for agents on %s", self.base_url)

    async def close(self) -> None:
        for token in list(self.sessions):
            self.unregister(token)
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task

    def _session(self, token: str) -> AgentSession:
        session = self.sessions.get(token)
        if session is None:
            raise RequestError(
                404,
                "no sample is generating under this URL: its agent has returned, or the URL is wrong",
                kind="not_found_error",
            )
        return session

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="rlmesh OpenAI-compatible endpoint", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_middleware(_OpenAIBodyLimit, max_bytes=MAX_REQUEST_BYTES)

        @app.exception_handler(RequestError)
        async def request_error(request: Request, e: RequestError):
            return error_response(e.status, e.message, e.kind, e.param)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request: Request, e: StarletteHTTPException):
            return error_response(e.status_code, str(e.detail))

        @app.exception_handler(Exception)
        async def unexpected(request: Request, e: Exception):  # (uvicorn logs the traceback)
            return error_response(500, f"internal error: {type(e).__name__}: {e}", kind="server_error")

        @app.get("/samples/{token}/v1/models")
        async def models(token: str):
            self._session(token)
            return {"object": "list", "data": [_model_card()]}

        @app.get("/samples/{token}/v1/models/{model:path}")
        async def model(token: str, model: str):
            self._session(token)
            return _model_card(model)

        @app.post("/samples/{token}/v1/chat/completions")
        async def chat_completions(token: str, request: Request):
            session = self._session(token)
            req: ChatRequest = _parse(ChatRequest, await _json_body(request))
            refuse_unsupported(req)
            if req.top_logprobs:
                raise RequestError(
                    400, "top_logprobs is not supported (logprobs of the chosen tokens are)", param="top_logprobs"
                )
            if (req.response_format or {}).get("type", "text") != "text":
                raise RequestError(
                    400, "response_format: only text is supported (no constrained decoding)", param="response_format"
                )
            messages = template_messages(req.messages, session.options.tool_arguments_as_dict)
            use_tools = bool(req.tools) and req.tool_choice != "none"
            if use_tools:
                check_tools(req.tools or [])
            prompt_ids = chat_prompt_ids(session.tokenizer, messages, req.tools if use_tools else None)
            out = await session.generate(
                prompt_ids, req.max_completion_tokens or req.max_tokens, request_sampling(req, session)
            )
            return chat_answer(session, req, prompt_ids, out, parse_tools=use_tools)

        @app.post("/samples/{token}/v1/completions")
        async def completions(token: str, request: Request):
            session = self._session(token)
            req: CompletionRequest = _parse(CompletionRequest, await _json_body(request))
            refuse_unsupported(req)
            if req.echo:
                raise RequestError(400, "echo is not supported", param="echo")
            prompt_ids = completion_prompt_ids(session.tokenizer, req.prompt)
            out = await session.generate(prompt_ids, req.max_tokens, request_sampling(req, session))
            return completion_answer(session, req, prompt_ids, out)

        return app


def _model_card(name: str = MODEL_NAME) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "rlmesh"}


# One endpoint per event loop (a rollout process has one loop; tests start several).
_endpoints: dict[asyncio.AbstractEventLoop, asyncio.Task] = {}


async def shared_endpoint(settings: Any) -> OpenAIEndpoint:
    """This process's endpoint, started on first use on settings.openai_host/openai_port."""
    for closed in [loop for loop in _endpoints if loop.is_closed()]:
        del _endpoints[closed]
    loop = asyncio.get_running_loop()
    starting = _endpoints.get(loop)
    if starting is None or (starting.done() and (starting.cancelled() or starting.exception() is not None)):

        async def start() -> OpenAIEndpoint:
            endpoint = OpenAIEndpoint(settings.openai_host, settings.openai_port)
            await endpoint.start()
            return endpoint

        starting = _endpoints[loop] = loop.create_task(start())
    return await asyncio.shield(starting)


async def close_shared_endpoint() -> None:
    """Stop this loop's endpoint, if one was started (at the rollout service's shutdown)."""
    starting = _endpoints.pop(asyncio.get_running_loop(), None)
    if starting is not None and starting.done() and not starting.cancelled() and starting.exception() is None:
        await starting.result().close()
