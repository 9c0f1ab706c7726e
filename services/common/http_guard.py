"""What every rlmesh HTTP API does with bad input: bodies over a size limit get 413 before
they are read into memory, and validation errors (422) say where and what without echoing
the input back (it may be large, or not even encodable as JSON)."""

from __future__ import annotations

import json
from typing import Any

TOO_LARGE_STATUS = 413


class BodyLimit:
    """ASGI middleware: refuse request bodies over `max_bytes` with 413 and a JSON body.
    A declared Content-Length is checked first; a chunked body is counted as it arrives."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if not declared.isdigit() or int(declared) > self.max_bytes:
                return await self._refuse(send)
            return await self.app(scope, receive, send)
        # No length declared (chunked): read at most max_bytes, then hand the body on.
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._refuse(send)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, send) -> None:
        body = json.dumps(
            {
                "detail": f"the request body is larger than the limit of {self.max_bytes} bytes "
                "(max_request_bytes of this service)"
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": TOO_LARGE_STATUS,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def _text(value: Any, limit: int = 200) -> str | int:
    if isinstance(value, int):
        return value
    # A key of the input may be a lone surrogate, which JSON cannot carry.
    return str(value)[:limit].encode("utf-8", "replace").decode()


def validation_errors(errors: list[dict]) -> list[dict]:
    """Pydantic/FastAPI validation errors without the offending input: location, message, type."""
    return [
        {
            "loc": [_text(part) for part in e.get("loc", ())],
            "msg": _text(e.get("msg", ""), 1000),
            "type": _text(e.get("type", "")),
        }
        for e in errors[:50]
    ]


def guard(app: Any, max_request_bytes: int) -> None:
    """Install the body limit and the 422 handler on a FastAPI app."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request, exc: RequestValidationError):
        return JSONResponse(status_code=422, content={"detail": validation_errors(list(exc.errors()))})
