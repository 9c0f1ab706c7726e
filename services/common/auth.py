"""The stack's bearer token: one secret shared by every rlmesh service and its clients.

It comes from the environment, `RLMESH_TOKEN`, or from a file named by `RLMESH_TOKEN_FILE`
(a mounted secret), and is never logged. gRPC calls carry it as `authorization: Bearer
<token>` metadata, REST and engine calls as the same HTTP header. With no token
configured a service refuses to start unless `RLMESH_ALLOW_NO_AUTH=1` says that running
open is intended (a single-user machine)."""

from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

TOKEN_ENV = "RLMESH_TOKEN"
TOKEN_FILE_ENV = "RLMESH_TOKEN_FILE"
ALLOW_NO_AUTH_ENV = "RLMESH_ALLOW_NO_AUTH"
HEADER = "authorization"
# Kubernetes and compose probe health without credentials; health reveals nothing else.
OPEN_GRPC_PREFIXES = ("/grpc.health.v1.Health/",)


class AuthConfigError(RuntimeError):
    pass


def stack_token() -> str | None:
    """The configured token, or None. A token file that cannot be read is an error, not
    an open stack."""
    token = os.environ.get(TOKEN_ENV, "").strip()
    if token:
        return token
    path = os.environ.get(TOKEN_FILE_ENV, "").strip()
    if path:
        try:
            token = Path(path).read_text().strip()
        except OSError as e:
            raise AuthConfigError(f"{TOKEN_FILE_ENV}={path} cannot be read: {e.strerror}") from None
        if not token:
            raise AuthConfigError(f"{TOKEN_FILE_ENV}={path} is empty")
        return token
    return None


def required_token() -> str | None:
    """For servers: the token to demand, or None when running open was asked for."""
    token = stack_token()
    if token is None and os.environ.get(ALLOW_NO_AUTH_ENV, "") != "1":
        raise AuthConfigError(
            f"no token configured: set {TOKEN_ENV} (or {TOKEN_FILE_ENV}) for every service and client, "
            f"or {ALLOW_NO_AUTH_ENV}=1 to run without authentication"
        )
    return token


def bearer(token: str | None) -> str | None:
    return f"Bearer {token}" if token else None


def token_matches(expected: str, header_value: str | None) -> bool:
    """Constant-time check of an `authorization` header against the expected token."""
    scheme, _, token = (header_value or "").partition(" ")
    if scheme.lower() != "bearer":  # (an auth scheme is case-insensitive, RFC 9110)
        return False
    return hmac.compare_digest(token.encode(), expected.encode())


def ensure_stack_token() -> str:
    """The configured token, or a fresh random one put in this process's environment (so the
    services it starts and the clients it makes share it): for `rlmesh up`, benchmarks, tests."""
    token = stack_token()
    if token is None:
        token = os.environ[TOKEN_ENV] = secrets.token_urlsafe(32)
    return token


def credential_headers(token: str | None) -> dict[str, str]:
    """`authorization: Bearer <token>` as HTTP headers or gRPC metadata (empty without a token)."""
    value = bearer(token)
    return {HEADER: value} if value else {}


def client_headers() -> dict[str, str]:
    """HTTP headers a client of the stack sends (empty when the stack runs open)."""
    return credential_headers(stack_token())


def add_http_token_check(app: Any, token: str, is_open: Callable[[str], bool], refusal: Callable[[str], dict]) -> None:
    """Make a FastAPI app answer 401 (with `refusal(why)` as the JSON body) to every request
    without `Authorization: Bearer <token>`, except paths for which `is_open(path)` holds."""
    app.add_middleware(_HttpTokenCheck, token=token, is_open=is_open, refusal=refusal)


class _HttpTokenCheck:
    """Plain ASGI middleware (Starlette's BaseHTTPMiddleware costs a task and a stream per
    request, which a busy API pays on every one)."""

    def __init__(self, app: Any, token: str, is_open: Callable[[str], bool], refusal: Callable[[str], dict]) -> None:
        self.app, self.token, self.is_open, self.refusal = app, token, is_open, refusal

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        header = next((v.decode("latin-1") for k, v in scope["headers"] if k == HEADER.encode()), None)
        if self.is_open(scope["path"]) or token_matches(self.token, header):
            return await self.app(scope, receive, send)
        from fastapi.responses import JSONResponse

        why = "no bearer token" if not header else "a wrong bearer token"
        refused = JSONResponse(status_code=401, content=self.refusal(why), headers={"WWW-Authenticate": "Bearer"})
        await refused(scope, receive, send)
