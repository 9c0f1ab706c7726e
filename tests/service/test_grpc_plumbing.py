"""The shared plumbing every service relies on: Sample conversion, typed settings,
health checking and reflection, graceful stop on SIGTERM, keepalive on every channel."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from rlmesh.buffer.config import Settings as BufferSettings
from rlmesh.buffer.server import start as start_buffer
from rlmesh.common import grpc_server, tls
from rlmesh.common.grpc_server import aio_channel, sync_channel
from rlmesh.common.net import free_port
from tests.helpers.buffer import code_of, start_buffer_process


def test_services_serve_health_and_reflection(redis_url, start_in_loop):
    _, port = start_in_loop(lambda: start_buffer(BufferSettings(redis_url=redis_url, port=0)))
    channel = sync_channel(f"127.0.0.1:{port}")
    health = health_pb2_grpc.HealthStub(channel)
    for name in ("", "rlmesh.v1.Buffer"):
        assert (
            health.Check(health_pb2.HealthCheckRequest(service=name)).status == health_pb2.HealthCheckResponse.SERVING
        )
    listed = health.List(health_pb2.HealthListRequest(), timeout=10).statuses  # (INTERNAL before)
    assert {name: s.status for name, s in listed.items()} == {
        "": health_pb2.HealthCheckResponse.SERVING,
        "rlmesh.v1.Buffer": health_pb2.HealthCheckResponse.SERVING,
    }
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    (reply,) = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for s in reply.list_services_response.service}
    assert {"rlmesh.v1.Buffer", "grpc.health.v1.Health"} <= names


def test_undecodable_requests_get_invalid_argument(redis_url, start_in_loop):
    _, port = start_in_loop(lambda: start_buffer(BufferSettings(redis_url=redis_url, port=0)))
    channel = sync_channel(f"127.0.0.1:{port}")
    for method in ("GetStats", "PutGroups"):  # a generated parser and the buffer's own wire parser
        call = channel.unary_unary(f"/rlmesh.v1.Buffer/{method}")  # bytes in, bytes out
        try:
            call(b"\xff\xff\xff not protobuf", timeout=10)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, e.code(), e.details())
            assert f"not a valid {method} message" in e.details()
        else:
            raise AssertionError(f"{method} accepted garbage")


def test_a_service_stops_gracefully_on_sigterm(redis_url):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlmesh.cli", "serve", "buffer", "--redis-url", redis_url, "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        channel = sync_channel(f"127.0.0.1:{port}")
        grpc.channel_ready_future(channel).result(timeout=60)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert b"shutting down" in proc.stdout.read()
    finally:
        proc.kill()


KEEPALIVE = {
    "grpc.keepalive_time_ms": grpc_server.KEEPALIVE_TIME_MS,
    "grpc.keepalive_timeout_ms": grpc_server.KEEPALIVE_TIMEOUT_MS,
    "grpc.http2.ping_timeout_ms": grpc_server.KEEPALIVE_TIMEOUT_MS,
    "grpc.http2.max_pings_without_data": 0,
}


def test_every_channel_and_server_keeps_its_connections_alive(redis_url, start_in_loop, monkeypatch):
    built = []

    def recording(name, make):
        def build(*args, **kwargs):
            built.append((name, dict(kwargs["options"])))
            return make(*args, **kwargs)

        return build

    for module, name in ((grpc, "insecure_channel"), (grpc, "secure_channel"), (grpc.aio, "insecure_channel"),
                         (grpc.aio, "secure_channel"), (grpc.aio, "server")):  # fmt: skip
        monkeypatch.setattr(module, name, recording(f"{module.__name__}.{name}", getattr(module, name)))

    async def aio_channel_closed() -> None:  # (an aio channel needs a running loop)
        await aio_channel("127.0.0.1:1").close()

    sync_channel("127.0.0.1:1").close()
    asyncio.run(aio_channel_closed())
    monkeypatch.setattr(tls, "tls_files", lambda: object())  # (mutual TLS configured)
    monkeypatch.setattr(tls, "channel_credentials", lambda files: grpc.ssl_channel_credentials())
    sync_channel("127.0.0.1:1").close()
    asyncio.run(aio_channel_closed())
    monkeypatch.undo()  # (the server below is plain)
    monkeypatch.setattr(grpc.aio, "server", recording("grpc.aio.server", grpc.aio.server))
    start_in_loop(lambda: start_buffer(BufferSettings(redis_url=redis_url, port=0)))

    assert [name for name, _ in built] == [
        "grpc.insecure_channel",
        "grpc.aio.insecure_channel",
        "grpc.secure_channel",
        "grpc.aio.secure_channel",
        "grpc.aio.server",
    ]
    for name, options in built:
        assert KEEPALIVE.items() <= options.items(), name
    server = built[-1][1]
    # (it accepts the clients' pings: more often than they send them, and never sends one away)
    assert server["grpc.http2.min_ping_interval_without_data_ms"] < grpc_server.KEEPALIVE_TIME_MS
    assert (server["grpc.keepalive_permit_without_calls"], server["grpc.http2.max_ping_strikes"]) == (1, 0)


def test_a_call_to_a_frozen_service_fails_unavailable_before_its_deadline(redis_url, tmp_path, monkeypatch):
    # A service SIGSTOPped (as a vanished host: its connections stay open, nothing answers)
    # mid-call: the caller's keepalive pings go unanswered and the call fails UNAVAILABLE
    # (retried elsewhere or later), not DEADLINE_EXCEEDED at its deadline. The pings here
    # come every second, so the test does not wait the real 40 s.
    monkeypatch.setattr(grpc_server, "KEEPALIVE_TIME_MS", 1000)
    monkeypatch.setattr(grpc_server, "KEEPALIVE_TIMEOUT_MS", 1000)
    port = free_port()
    proc = start_buffer_process(redis_url, port, tmp_path / "buffer.log")
    try:
        health = health_pb2_grpc.HealthStub(sync_channel(f"127.0.0.1:{port}"))
        health.Check(health_pb2.HealthCheckRequest(), timeout=10)  # (connected)
        os.kill(proc.pid, signal.SIGSTOP)
        code, details = code_of(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=30))
        assert code == grpc.StatusCode.UNAVAILABLE, details
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        proc.wait(timeout=30)
