"""Prometheus metrics of an rlmesh service, with `prometheus-client`.

Each service holds its own `ServiceMetrics` (a registry of its own, so that services run in
one process, as in the tests and `rlmesh up --in-process` setups, never mix their counts):

- every gRPC service gets, through the shared server helper (rlmesh.common.grpc_server), the
  standard gRPC server metrics that Grafana's gRPC dashboards know (the names of
  go-grpc-prometheus): `grpc_server_started_total`, `grpc_server_handled_total` (with the
  status code) and the latency histogram `grpc_server_handling_seconds`, labelled by service
  and method. Only methods the server implements become labels; any other name counts as
  `unknown`, so a caller cannot grow the label set;
- each service adds its own gauges and counters to `metrics.registry`, and may register
  `refresh` hooks (async) that run before every scrape, to read values that live elsewhere
  (the buffer's Redis, the coordinator's run records);
- `start_metrics_server` serves `GET /metrics` over HTTP for the gRPC services, on their
  `metrics_port` setting. The HTTP services (coordinator, reference engine) serve `/metrics`
  on their own port instead (`metrics_response`).

/metrics needs the stack's bearer token like every other rlmesh port (it names runs and
shows how busy each part is): Prometheus sends it from a file with `authorization:
{credentials_file: ...}` in its scrape config. With no token configured (RLMESH_ALLOW_NO_AUTH=1)
it is open, like everything else. The reference engine alone keeps SGLang's behaviour (its
/metrics is open, as SGLang's is)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import grpc
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from rlmesh.common import auth

log = logging.getLogger(__name__)

# Seconds, from a cache hit to a long generation or train step (calls here take up to minutes).
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1800.0,
)
UNKNOWN = "unknown"
# Largest request head the /metrics endpoint reads (a scraper sends a few hundred bytes).
MAX_REQUEST_HEAD_BYTES = 16 * 1024

Refresh = Callable[[], Awaitable[None]]


class ServiceMetrics:
    """One service's registry (with the process's CPU, memory and file descriptor metrics),
    and the hooks that refresh values before a scrape."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self._refreshers: list[Refresh] = []
        self._grpc: _GrpcMetrics | None = None

    def on_scrape(self, refresh: Refresh) -> None:
        """Run `refresh` before each scrape; a failing one is logged and the scrape goes on
        with the values it had."""
        self._refreshers.append(refresh)

    async def render(self) -> bytes:
        for refresh in self._refreshers:
            try:
                await refresh()
            except Exception:
                log.warning("refreshing metrics before a scrape failed", exc_info=True)
        return generate_latest(self.registry)

    def grpc(self) -> _GrpcMetrics:
        if self._grpc is None:
            self._grpc = _GrpcMetrics(self.registry)
        return self._grpc


class _GrpcMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["grpc_type", "grpc_service", "grpc_method"]
        self.started = Counter("grpc_server_started", "RPCs started on the server.", labels, registry=registry)
        self.handled = Counter(
            "grpc_server_handled",
            "RPCs completed on the server, by status code.",
            [*labels, "grpc_code"],
            registry=registry,
        )
        self.seconds = Histogram(
            "grpc_server_handling_seconds",
            "Time from an RPC's start to its answer, in seconds.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )


def _rpc_type(handler: grpc.RpcMethodHandler) -> str:
    if handler.request_streaming and handler.response_streaming:
        return "bidi_stream"
    if handler.request_streaming:
        return "client_stream"
    return "server_stream" if handler.response_streaming else "unary"


def _code_name(context: grpc.aio.ServicerContext) -> str:
    code = context.code()
    if code is None:
        return grpc.StatusCode.OK.name
    if isinstance(code, grpc.StatusCode):
        return code.name
    # grpc.aio reports the code as set by the handler: an int when set through abort()
    for status in grpc.StatusCode:
        if status.value[0] == code:
            return status.name
    return grpc.StatusCode.UNKNOWN.name


class GrpcMetricsInterceptor(grpc.aio.ServerInterceptor):
    """Counts every call (started; handled, by status code) and times it, per service and
    method. It is the outermost interceptor, so refused calls (no token) count too."""

    def __init__(self, metrics: ServiceMetrics, methods: set[str]) -> None:
        self.m = metrics.grpc()
        self.methods = methods  # full method names the server implements ("/pkg.Service/Method")

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if method in self.methods:
            service, _, name = method[1:].partition("/")
        else:
            service = name = UNKNOWN
        if handler is None:  # not implemented: answered UNIMPLEMENTED by gRPC itself
            labels = ("unary", service, name)
            self.m.started.labels(*labels).inc()
            self.m.handled.labels(*labels, grpc.StatusCode.UNIMPLEMENTED.name).inc()
            return None
        labels = (_rpc_type(handler), service, name)
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def timed(request, context):
                return await self._observe(labels, context, inner(request, context))

            return grpc.unary_unary_rpc_method_handler(timed, handler.request_deserializer, handler.response_serializer)
        if handler.stream_unary is not None:
            inner_su = handler.stream_unary

            async def timed_su(request_iterator, context):
                return await self._observe(labels, context, inner_su(request_iterator, context))

            return grpc.stream_unary_rpc_method_handler(
                timed_su, handler.request_deserializer, handler.response_serializer
            )
        # Streaming answers (the health service's Watch): counted when started, not timed.
        self.m.started.labels(*labels).inc()
        return handler

    async def _observe(self, labels: tuple[str, str, str], context, call: Awaitable):
        self.m.started.labels(*labels).inc()
        started = time.perf_counter()
        code = None
        try:
            return await call
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED.name
            raise
        except grpc.aio.AbortError:
            raise
        except Exception:
            code = grpc.StatusCode.UNKNOWN.name
            raise
        finally:
            self.m.seconds.labels(*labels).observe(time.perf_counter() - started)
            self.m.handled.labels(*labels, code or _code_name(context)).inc()


def scrape_allowed(authorization: str | None) -> bool:
    """Whether a scrape with this `authorization` header may read /metrics: the stack's
    token when there is one; anyone when the stack runs open."""
    token = auth.stack_token()
    return token is None or auth.token_matches(token, authorization)


def refusal_text(authorization: str | None) -> str:
    why = "no bearer token" if not authorization else "a wrong bearer token"
    return (
        f"/metrics needs the stack's token and the request carried {why}: send 'Authorization: Bearer <token>' "
        f"(Prometheus: authorization.credentials_file in the scrape config)\n"
    )


async def start_metrics_server(metrics: ServiceMetrics, host: str, port: int) -> asyncio.Server:
    """Serve `GET /metrics` (Prometheus text format) on host:port; anything else is 404."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        status, content_type, body = "400 Bad Request", "text/plain; charset=utf-8", b"bad request\n"
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
            lines = head.decode("latin-1").split("\r\n")
            parts = lines[0].split()
            headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
            if len(parts) >= 2 and parts[0] in ("GET", "HEAD") and parts[1].split("?")[0] == "/metrics":
                authorization = headers.get(auth.HEADER)
                if scrape_allowed(authorization):
                    status, content_type, body = "200 OK", CONTENT_TYPE_LATEST, await metrics.render()
                else:
                    status, body = "401 Unauthorized", refusal_text(authorization).encode()
            else:
                status, body = "404 Not Found", b"only GET /metrics is served here\n"
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError, ConnectionError):
            pass  # a client that went away or sent no complete request: answered 400 if it still listens
        except Exception as e:
            log.exception("metrics scrape failed")
            status, body = "500 Internal Server Error", f"metrics failed: {type(e).__name__}\n".encode()
        out = (
            f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n\r\n"
        ).encode()
        try:
            writer.write(out + body)
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, host, port, limit=MAX_REQUEST_HEAD_BYTES)


def metrics_response(body: bytes):
    """A FastAPI/Starlette answer carrying a scrape."""
    from starlette.responses import Response

    return Response(body, media_type=CONTENT_TYPE_LATEST)


class HttpMetrics:
    """Requests of a FastAPI app by method, route template (never the raw path: bounded) and
    status, and their latency."""

    def __init__(self, metrics: ServiceMetrics, prefix: str) -> None:
        self.requests = Counter(
            f"{prefix}_http_requests",
            "HTTP requests answered, by method, route and status.",
            ["method", "route", "status"],
            registry=metrics.registry,
        )
        self.seconds = Histogram(
            f"{prefix}_http_request_seconds",
            "HTTP request latency in seconds, by route.",
            ["method", "route"],
            buckets=LATENCY_BUCKETS,
            registry=metrics.registry,
        )

    def install(self, app) -> None:
        app.add_middleware(_CountRequests, metrics=self)

    def count(self, scope: dict, status: int, seconds: float) -> None:
        template = getattr(scope.get("route"), "path", None) or "unmatched"
        method = scope["method"] if scope["method"] in _HTTP_METHODS else "other"
        self.requests.labels(method, template, str(status)).inc()
        self.seconds.labels(method, template).observe(seconds)


class _CountRequests:
    """Plain ASGI middleware (Starlette's BaseHTTPMiddleware costs a task and a stream per
    request, which a busy API pays on every one)."""

    def __init__(self, app, metrics: HttpMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        status = 500  # (what the server answers for an exception that gets past the app)

        async def send_and_note(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            # (the router set the matched route in the scope, which it shares with this one)
            self.metrics.count(scope, status, time.perf_counter() - started)


_HTTP_METHODS = frozenset({"GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"})
