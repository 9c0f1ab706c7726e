"""One way to run a gRPC service: asyncio server, the stack's bearer token checked on every
call (health excepted), health checking, reflection, message size caps, errors mapped to
status codes, graceful stop on SIGTERM/SIGINT; and channels to rlmesh services that carry
the token."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from rlmesh.common import auth, errors, tls
from rlmesh.common.errors import RlmeshError
from rlmesh.common.heap import freeze_long_lived
from rlmesh.common.prometheus import GrpcMetricsInterceptor, ServiceMetrics, start_metrics_server
from rlmesh.common.sample import ConversionError
from rlmesh.common.settings import ServiceSettings

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024


# HTTP/2 keepalive between rlmesh's services: while a call is open the client pings every
# KEEPALIVE_TIME_MS and drops the connection (the call fails UNAVAILABLE, and is retried)
# when a ping is not answered within KEEPALIVE_TIMEOUT_MS (gRPC core 1.85 times a ping out
# by ping_timeout_ms, 60 s by default, whatever keepalive_timeout_ms says: both are set).
# So a peer that vanished without closing its connections (its host gone, a partition, a
# frozen process) is noticed within about 40 s, not at the call's deadline (a TrainStep's
# is 20 minutes). Servers ping idle clients too, and accept pings as often as clients send
# them (a server refuses pings more frequent than its min_ping_interval with GOAWAY
# "too_many_pings").
KEEPALIVE_TIME_MS = 20_000
KEEPALIVE_TIMEOUT_MS = 20_000
# A channel to a peer that is down tries to reconnect at growing intervals (gRPC's default
# grows to 2 minutes), and calls fail at once in between: a peer back after a long outage
# would wait up to that long to be called again. Capped near the callers' own retry backoff
# (rlmesh.common.retry, at most 10 s); gRPC adds up to 20 % jitter.
MAX_RECONNECT_BACKOFF_MS = 5_000


def _caps_and_keepalive(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.http2.max_pings_without_data", 0),  # (else pings stop after 2 on a call that sends nothing)
    ]


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    """A channel's to an rlmesh service: message size caps, keepalive, and reconnects."""
    return [
        *_caps_and_keepalive(max_message_bytes),
        ("grpc.keepalive_permit_without_calls", 0),  # (an idle channel finds out at its next call)
        ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
    ]


def server_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    """A server's: message size caps, keepalive pings to its clients, and its clients' pings
    accepted (see KEEPALIVE_TIME_MS)."""
    return [
        *_caps_and_keepalive(max_message_bytes),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
        ("grpc.http2.max_ping_strikes", 0),  # (0: a client pinging too often is never sent away)
    ]


class _CallDetails(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: bool | None
    compression: Any


class _SyncCallDetails(_CallDetails, grpc.ClientCallDetails):
    pass


def _with_token(metadata, value: str) -> list[tuple[str, str]]:
    return [*(metadata or ()), (auth.HEADER, value)]


class _AioTokenInterceptor(
    grpc.aio.UnaryUnaryClientInterceptor,
    grpc.aio.UnaryStreamClientInterceptor,
    grpc.aio.StreamUnaryClientInterceptor,
    grpc.aio.StreamStreamClientInterceptor,
):
    def __init__(self, value: str) -> None:
        self.value = value

    def _details(self, d):
        return grpc.aio.ClientCallDetails(
            d.method, d.timeout, _with_token(d.metadata, self.value), d.credentials, d.wait_for_ready
        )

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)

    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)

    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)

    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


class _SyncTokenInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, value: str) -> None:
        self.value = value

    def _details(self, d):
        return _SyncCallDetails(
            d.method,
            d.timeout,
            _with_token(d.metadata, self.value),
            d.credentials,
            d.wait_for_ready,
            getattr(d, "compression", None),
        )

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


def aio_channel(address: str, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> grpc.aio.Channel:
    """A channel to an rlmesh service: every call carries the stack's token (when there is
    one), over mutual TLS when it is configured."""
    value = auth.bearer(auth.stack_token())
    interceptors = [_AioTokenInterceptor(value)] if value else None
    options, files = channel_options(max_message_bytes), tls.tls_files()
    if files is not None:
        return grpc.aio.secure_channel(
            address, tls.channel_credentials(files), options=options, interceptors=interceptors
        )
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)


def sync_channel(address: str, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> grpc.Channel:
    options, files = channel_options(max_message_bytes), tls.tls_files()
    channel = (
        grpc.secure_channel(address, tls.channel_credentials(files), options=options)
        if files is not None
        else grpc.insecure_channel(address, options=options)
    )
    value = auth.bearer(auth.stack_token())
    return grpc.intercept_channel(channel, _SyncTokenInterceptor(value)) if value else channel


class _HealthServicer(health.aio.HealthServicer):
    """grpcio's health servicer, which answers List too (its own answers INTERNAL): the
    status of the server ("") and of each of its services."""

    def __init__(self, services: list[str]) -> None:
        super().__init__()
        self.services = ["", *services]

    async def List(self, request, context):
        statuses = {
            name: await self.Check(health_pb2.HealthCheckRequest(service=name), context) for name in self.services
        }
        return health_pb2.HealthListResponse(statuses=statuses)


class _AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call without the stack's token (UNAUTHENTICATED), health checks excepted:
    orchestrators probe health without credentials, and health reveals nothing else."""

    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(auth.OPEN_GRPC_PREFIXES):
            return await continuation(handler_call_details)
        header = dict(handler_call_details.invocation_metadata or ()).get(auth.HEADER)
        if auth.token_matches(self.token, header):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        why = "no bearer token" if not header else "a wrong bearer token"
        message = (
            f"{method} needs the stack's token and the call carried {why}: send 'authorization: Bearer "
            f"<token>' metadata (rlmesh clients read {auth.TOKEN_ENV} or {auth.TOKEN_FILE_ENV})"
        )

        async def refuse(request_or_iterator, context: grpc.aio.ServicerContext):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                refuse, handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                refuse, handler.request_deserializer, handler.response_serializer
            )
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                refuse, handler.request_deserializer, handler.response_serializer
            )
        return grpc.stream_stream_rpc_method_handler(refuse, handler.request_deserializer, handler.response_serializer)


# A status message travels in a header, which gRPC caps at 16 KiB (a longer one turns the
# answer into RESOURCE_EXHAUSTED): a message quoting a caller's long value is cut.
_MAX_DETAILS_CHARS = 4000


def status_details(message: str) -> str:
    if len(message) <= _MAX_DETAILS_CHARS:
        return message
    return message[:_MAX_DETAILS_CHARS] + f"... ({len(message)} characters in all)"


# Trailing metadata on every status an rlmesh handler answers with, so a client can tell "the
# service answered UNAVAILABLE" (a peer of it is down) from "the service could not be reached".
ANSWERED = (("rlmesh-answered", "1"),)


def answered_by_service(e: grpc.aio.AioRpcError) -> bool:
    """Whether the status came from an rlmesh handler, not from the way to it."""
    return any(key == ANSWERED[0][0] for key, _ in (e.trailing_metadata() or ()))


class _StatusInterceptor(grpc.aio.ServerInterceptor):
    """Turns exceptions from plain logic into gRPC statuses with readable messages (marked
    ANSWERED)."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        inner = handler.unary_unary
        method = handler_call_details.method

        async def guarded(request, context: grpc.aio.ServicerContext):
            if isinstance(request, _Undecodable):
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"the request is not a valid {method.rsplit('/', 1)[-1]} message: {request.reason}",
                    ANSWERED,
                )
            try:
                return await inner(request, context)
            except RlmeshError as e:
                await context.abort(e.code, status_details(str(e)), ANSWERED)
            except ConversionError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, status_details(str(e)), ANSWERED)
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except grpc.aio.AioRpcError as e:
                # A call to another service failed: pass its status on, saying where it came from.
                await context.abort(
                    e.code(), status_details(f"{e.details()} (reported by an upstream rlmesh service)"), ANSWERED
                )
            except Exception as e:
                log.exception("unhandled error in %s", method)
                await context.abort(
                    grpc.StatusCode.INTERNAL,
                    status_details(f"internal error in {method}: {errors.unexpected(e)}"),
                    ANSWERED,
                )

        return grpc.unary_unary_rpc_method_handler(
            guarded,
            request_deserializer=_decoding(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )


@dataclass
class _Undecodable:
    reason: str


def _decoding(deserializer):
    """A deserializer that hands a request it cannot decode to the handler as _Undecodable,
    which answers INVALID_ARGUMENT (gRPC itself would answer UNKNOWN/INTERNAL)."""
    if deserializer is None:
        return None

    def decode(data: bytes):
        try:
            return deserializer(data)
        except Exception as e:  # DecodeError, or whatever a custom wire parser raises
            return _Undecodable(f"{type(e).__name__}: {str(e)[:200]}")

    return decode


@dataclass
class ServiceBinding:
    """A servicer, the generated function that adds it, and its full service name."""

    servicer: Any
    add_to_server: Callable[[Any, grpc.aio.Server], None]
    full_name: str


@dataclass
class Service:
    """What a service's `build(settings)` returns: its servicers, what to start once the
    server runs (given its health servicer, to report the service's own state), what to
    close after the server stops (clients, channels, side servers), and its Prometheus
    metrics (the server adds the gRPC ones; served on the metrics_port setting)."""

    bindings: list[ServiceBinding]
    on_shutdown: Callable[[], Awaitable[None]] | None = None
    on_start: Callable[[health.aio.HealthServicer], Awaitable[None]] | None = None
    metrics: ServiceMetrics = field(default_factory=ServiceMetrics)


Builder = Callable[[Any], Awaitable[Service]]


async def start_server(
    bindings: Iterable[ServiceBinding],
    address: str,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    metrics: ServiceMetrics | None = None,
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Start a server on `address` ("host:port", port 0 picks a free one); returns it,
    the bound port and its health servicer (all services marked SERVING). With `metrics`,
    every call is counted and timed there."""
    token = auth.required_token()
    bindings = list(bindings)
    interceptors: list[grpc.aio.ServerInterceptor] = []
    if metrics is not None:  # outermost: it sees the calls the others refuse
        interceptors.append(GrpcMetricsInterceptor(metrics, _method_names([b.full_name for b in bindings])))
    if token:
        interceptors.append(_AuthInterceptor(token))
    server = grpc.aio.server(
        interceptors=[*interceptors, _StatusInterceptor()], options=server_options(max_message_bytes)
    )
    names = [b.full_name for b in bindings]
    health_servicer = _HealthServicer(names)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for b in bindings:
        b.add_to_server(b.servicer, server)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    files = tls.tls_files()
    port = (
        server.add_secure_port(address, tls.server_credentials(files))
        if files is not None
        else server.add_insecure_port(address)
    )
    if port == 0:
        raise RuntimeError(f"could not bind gRPC server to {address}")
    await server.start()
    for name in ["", *names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, port, health_servicer


def _method_names(services: list[str]) -> set[str]:
    """Every method of these services and of health checking, as gRPC names them ("/pkg.Service/Method")."""
    from google.protobuf import descriptor_pool

    names = set()
    for full_name in [*services, health.SERVICE_NAME]:
        try:
            service = descriptor_pool.Default().FindServiceByName(full_name)
        except KeyError:
            continue
        names.update(f"/{full_name}/{m.name}" for m in service.methods)
    return names


async def _start(build: Builder, settings: ServiceSettings):
    service = await build(settings)
    server, port, health_servicer = await start_server(
        service.bindings, f"{settings.host}:{settings.port}", settings.max_message_bytes, service.metrics
    )
    metrics_port = getattr(settings, "metrics_port", 0)
    metrics_server = None
    if metrics_port:
        metrics_server = await start_metrics_server(service.metrics, settings.metrics_host, metrics_port)
        log.info("serving Prometheus metrics on http://%s:%d/metrics", settings.metrics_host, metrics_port)
    if service.on_start is not None:
        await service.on_start(health_servicer)
    return service, server, port, health_servicer, metrics_server


async def start_service(build: Builder, settings: ServiceSettings) -> tuple[grpc.aio.Server, int]:
    """Build a service from its settings and start it in the running loop (tests and
    embedding); returns the server and its bound port. Its /metrics endpoint (metrics_port)
    stops when the server does."""
    service, server, port, _, metrics_server = await _start(build, settings)
    # What the service opened (engine connections, channels) is closed by whoever stops it
    # for good, after server.stop: a stop alone is what a crash leaves behind.
    server.close_service = service.on_shutdown
    if metrics_server is not None:  # callers stop what they started with server.stop(grace)
        stop = server.stop

        async def stop_both(grace):
            metrics_server.close()
            return await stop(grace)

        server.stop = stop_both
    return server, port


async def serve_service(build: Builder, settings: ServiceSettings, grace_seconds: float = 30.0) -> None:
    """Serve until SIGTERM/SIGINT, then report NOT_SERVING, let in-flight calls finish
    (up to grace_seconds) and close what the service opened."""
    service, server, port, health_servicer, metrics_server = await _start(build, settings)
    freeze_long_lived()
    log.info("serving gRPC on port %d", port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down: finishing in-flight calls (up to %.0f s)", grace_seconds)
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace_seconds)
    if metrics_server is not None:
        metrics_server.close()
    if service.on_shutdown is not None:
        await service.on_shutdown()
