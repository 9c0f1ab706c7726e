"""The engine's request-input error, shared by parsing, the worker and the HTTP layer."""

from __future__ import annotations


class RequestError(ValueError):
    """Bad request input; the HTTP layer answers 400 with this message."""
