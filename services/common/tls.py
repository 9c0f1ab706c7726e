"""Optional mutual TLS for every gRPC connection between rlmesh services. Like the token it
is configured once per process, by environment: RLMESH_TLS_CERT_FILE and RLMESH_TLS_KEY_FILE
(this service's certificate and key, used both to serve and to call) and RLMESH_TLS_CA_FILE
(the CA that signed every service's certificate). With all three set, servers accept only
clients with a certificate from that CA and clients verify the server's name against its
certificate (so certificates must name the host clients dial, e.g. `buffer` or 127.0.0.1).
With none set, connections are plaintext (the token still guards every call)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import grpc

CERT_ENV, KEY_ENV, CA_ENV = "RLMESH_TLS_CERT_FILE", "RLMESH_TLS_KEY_FILE", "RLMESH_TLS_CA_FILE"


class TlsConfigError(RuntimeError):
    pass


@dataclass(frozen=True)
class TlsFiles:
    cert: bytes
    key: bytes
    ca: bytes


def tls_files() -> TlsFiles | None:
    paths = {env: os.environ.get(env, "").strip() for env in (CERT_ENV, KEY_ENV, CA_ENV)}
    given = [env for env, path in paths.items() if path]
    if not given:
        return None
    if len(given) != len(paths):
        missing = ", ".join(env for env in paths if env not in given)
        raise TlsConfigError(f"mutual TLS needs {CERT_ENV}, {KEY_ENV} and {CA_ENV}; {missing} not set")
    contents = {}
    for env, path in paths.items():
        try:
            contents[env] = Path(path).read_bytes()
        except OSError as e:
            raise TlsConfigError(f"{env}={path} cannot be read: {e.strerror}") from None
    return TlsFiles(contents[CERT_ENV], contents[KEY_ENV], contents[CA_ENV])


def server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials([(files.key, files.cert)], root_certificates=files.ca, require_client_auth=True)


def channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(root_certificates=files.ca, private_key=files.key, certificate_chain=files.cert)
