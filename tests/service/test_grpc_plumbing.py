"""The shared plumbing every service relies on: Sample conversion, typed settings,
health checking and reflection, graceful stop on SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from rlmesh.buffer.config import Settings as BufferSettings
from rlmesh.buffer.server import start as start_buffer
from rlmesh.common.grpc_server import sync_channel
from rlmesh.common.net import free_port


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
