"""Nobody gets in without the stack's token: every gRPC service (one interceptor), the
coordinator's REST API, and the reference engine's HTTP API (SGLang's --api-key), with real
servers on loopback. Health stays open for probes."""

from __future__ import annotations

import shutil
import subprocess

import grpc
import httpx
import pytest
from fastapi.testclient import TestClient
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlmesh.buffer.config import Settings as BufferSettings
from rlmesh.buffer.server import start as start_buffer
from rlmesh.common import auth, tls
from rlmesh.common.grpc_server import sync_channel
from rlmesh.coordinator.app import start as start_coordinator
from rlmesh.coordinator.config import Settings as CoordinatorSettings
from rlmesh.engine.config import Settings as EngineSettings
from rlmesh.engine.server import create_app as create_engine_app
from rlmesh.v1 import buffer_pb2, buffer_pb2_grpc


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code(), e.value.details()


def test_a_grpc_service_refuses_calls_without_the_token(redis_url, start_in_loop):
    _, port = start_in_loop(lambda: start_buffer(BufferSettings(redis_url=redis_url, port=0)))
    address = f"127.0.0.1:{port}"
    request = buffer_pb2.GetStatsRequest(run_id="r1")
    with grpc.insecure_channel(address) as bare:
        code, details = _code(lambda: buffer_pb2_grpc.BufferStub(bare).GetStats(request))
        assert code == grpc.StatusCode.UNAUTHENTICATED and "no bearer token" in details
        code, details = _code(
            lambda: buffer_pb2_grpc.BufferStub(bare).GetStats(request, metadata=[("authorization", "Bearer wrong")])
        )
        assert code == grpc.StatusCode.UNAUTHENTICATED and "wrong bearer token" in details
        assert auth.stack_token() not in details  # never echoed
        # Probes need no credentials.
        health = health_pb2_grpc.HealthStub(bare).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    # rlmesh's own channels carry the token: the call reaches the service (unknown run).
    code, _ = _code(lambda: buffer_pb2_grpc.BufferStub(sync_channel(address)).GetStats(request))
    assert code == grpc.StatusCode.NOT_FOUND


def test_the_rest_api_refuses_requests_without_the_token(redis_url, start_in_loop):
    _, port = start_in_loop(lambda: start_coordinator(CoordinatorSettings(redis_url=redis_url, port=0)))
    url = f"http://127.0.0.1:{port}"
    r = httpx.get(f"{url}/runs")
    assert r.status_code == 401 and "no bearer token" in r.json()["detail"]
    assert r.headers["www-authenticate"] == "Bearer"
    r = httpx.post(f"{url}/runs", json={}, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and "wrong bearer token" in r.json()["detail"]
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/runs", headers=auth.client_headers()).json() == []
    # The scheme's name is case-insensitive (RFC 9110); the token is not.
    token = auth.client_headers()["authorization"].split(" ", 1)[1]
    assert httpx.get(f"{url}/runs", headers={"Authorization": f"bearer {token}"}).status_code == 200
    assert httpx.get(f"{url}/runs", headers={"Authorization": f"bearer {token.upper()}x"}).status_code == 401
    # The spec says so.
    assert "401" in httpx.get(f"{url}/openapi.json").json()["paths"]["/runs"]["get"]["responses"]


def test_the_engine_takes_an_api_key_as_sglang_does(tiny_model_dir):
    app = create_engine_app(EngineSettings(model_path=str(tiny_model_dir), api_key="engine-key"))
    with TestClient(app) as client:
        body = {"text": "hi", "sampling_params": {"max_new_tokens": 1}}
        r = client.post("/generate", json=body)
        assert r.status_code == 401 and "Unauthorized" in r.json()["error"]["message"]
        assert client.get("/get_model_info").status_code == 401
        assert client.get("/health").status_code == 200
        assert client.post("/generate", json=body, headers={"Authorization": "Bearer engine-key"}).status_code == 200


def test_no_token_means_no_start_unless_running_open_is_asked_for(monkeypatch, tmp_path, redis_url):
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    monkeypatch.delenv(auth.TOKEN_FILE_ENV, raising=False)
    monkeypatch.delenv(auth.ALLOW_NO_AUTH_ENV, raising=False)
    with pytest.raises(auth.AuthConfigError, match="RLMESH_TOKEN"):
        auth.required_token()
    monkeypatch.setenv(auth.ALLOW_NO_AUTH_ENV, "1")
    assert auth.required_token() is None
    # A token from a file (a mounted secret); an unreadable one is an error, not an open stack.
    secret = tmp_path / "token"
    secret.write_text("from-a-file\n")
    monkeypatch.setenv(auth.TOKEN_FILE_ENV, str(secret))
    assert auth.required_token() == "from-a-file"
    monkeypatch.setenv(auth.TOKEN_FILE_ENV, str(tmp_path / "missing"))
    with pytest.raises(auth.AuthConfigError, match="cannot be read"):
        auth.stack_token()


def _openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture
def certificates(tmp_path):
    """A CA, and a certificate for 127.0.0.1 that it signed (serves and calls)."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make test certificates")
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "1",
        "-subj",
        "/CN=rlmesh test CA",
        cwd=tmp_path,
    )
    _openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "svc.key",
        "-out",
        "svc.csr",
        "-subj",
        "/CN=svc",
        cwd=tmp_path,
    )
    (tmp_path / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl(
        "x509",
        "-req",
        "-in",
        "svc.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "svc.pem",
        "-days",
        "1",
        "-extfile",
        "san.cnf",
        cwd=tmp_path,
    )
    return tmp_path


def test_mutual_tls_between_services(certificates, monkeypatch, redis_url, start_in_loop):
    monkeypatch.setenv(tls.CERT_ENV, str(certificates / "svc.pem"))
    monkeypatch.setenv(tls.KEY_ENV, str(certificates / "svc.key"))
    monkeypatch.setenv(tls.CA_ENV, str(certificates / "ca.pem"))
    _, port = start_in_loop(lambda: start_buffer(BufferSettings(redis_url=redis_url, port=0)))
    address = f"127.0.0.1:{port}"
    request = buffer_pb2.GetStatsRequest(run_id="r1")
    # rlmesh's channels present their certificate: the call reaches the service.
    code, _ = _code(lambda: buffer_pb2_grpc.BufferStub(sync_channel(address)).GetStats(request, timeout=10))
    assert code == grpc.StatusCode.NOT_FOUND
    token = [("authorization", auth.bearer(auth.stack_token()))]
    with grpc.insecure_channel(address) as plaintext:  # not even a TLS handshake
        code, _ = _code(lambda: buffer_pb2_grpc.BufferStub(plaintext).GetStats(request, timeout=5, metadata=token))
        assert code == grpc.StatusCode.UNAVAILABLE
    anonymous = grpc.ssl_channel_credentials(root_certificates=(certificates / "ca.pem").read_bytes())
    with grpc.secure_channel(address, anonymous) as no_client_certificate:
        code, _ = _code(
            lambda: buffer_pb2_grpc.BufferStub(no_client_certificate).GetStats(request, timeout=5, metadata=token)
        )
        assert code == grpc.StatusCode.UNAVAILABLE
    # Half a configuration is an error, not plaintext.
    monkeypatch.delenv(tls.CA_ENV)
    with pytest.raises(tls.TlsConfigError, match="RLMESH_TLS_CA_FILE"):
        tls.tls_files()
