"""The API's own description: Swagger UI at /docs, served from this machine (the
swagger-ui-bundle-v2 package's files at /docs/assets/, not from a CDN, which fails offline
and which a Content-Security-Policy of 'self' refuses), and the OpenAPI spec's bearer
scheme, so that Swagger's "Authorize" sends the stack's token."""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Callable
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from swagger_ui_bundle import swagger_ui_path

DOCS_PATH = "/docs"
DOCS_ASSETS = "/docs/assets"
BEARER_SCHEME = "bearer"

_INLINE_SCRIPT = re.compile(r"<script>(.*?)</script>", re.DOTALL)


def docs_csp(html: str) -> str:
    """A policy under which the docs page runs only its own scripts: the asset files, and
    its one inline script (the Swagger UI set-up FastAPI writes), allowed by its hash."""
    hashes = " ".join(
        f"'sha256-{base64.b64encode(hashlib.sha256(s.encode()).digest()).decode()}'"
        for s in _INLINE_SCRIPT.findall(html)
    )
    return (
        f"default-src 'none'; script-src 'self' {hashes}; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )


class _Assets(StaticFiles):
    def file_response(self, *args, **kwargs):
        response = super().file_response(*args, **kwargs)
        response.headers["X-Content-Type-Options"] = "nosniff"
        return response


def is_docs_asset(path: str) -> bool:
    """Swagger UI's files: no token needed (they are the same for every deployment)."""
    return path.startswith(DOCS_ASSETS + "/")


def mount_api_docs(app: FastAPI) -> None:
    """Swagger UI at /docs (the app is made with docs_url=None), its files from this machine."""
    app.mount(DOCS_ASSETS, _Assets(directory=Path(str(swagger_ui_path))), name="docs-assets")

    @app.get(DOCS_PATH, include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "").rstrip("/")
        page = get_swagger_ui_html(
            openapi_url=root + app.openapi_url,
            title=f"{app.title} - API docs",
            swagger_js_url=f"{root}{DOCS_ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{DOCS_ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{root}{DOCS_ASSETS}/favicon-32x32.png",
            swagger_ui_parameters=app.swagger_ui_parameters,
        )
        page.headers["Content-Security-Policy"] = docs_csp(page.body.decode())
        page.headers["X-Content-Type-Options"] = "nosniff"
        page.headers["Referrer-Policy"] = "no-referrer"
        return page


UNPARSABLE = "The HTTP request cannot be parsed (say, a request line over the server's limit, about 64 KiB)."


def declare_bearer(app: FastAPI, is_open: Callable[[str], bool], description: str) -> None:
    """The spec says which routes need `Authorization: Bearer <token>`: every one for which
    is_open(path) does not hold (the token check itself is a middleware, which FastAPI
    does not see); and that any route can get the HTTP server's 400."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build()
            schema.setdefault("components", {})["securitySchemes"] = {
                BEARER_SCHEME: {"type": "http", "scheme": "bearer", "description": description}
            }
            for path, operations in schema["paths"].items():
                for operation in operations.values():
                    if not is_open(path):
                        operation["security"] = [{BEARER_SCHEME: []}]
                    # (the HTTP server answers it before any route sees the request)
                    operation["responses"].setdefault("400", {"description": UNPARSABLE})
        return app.openapi_schema

    app.openapi = openapi
