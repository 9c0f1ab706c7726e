"""Network helpers shared by the services."""

from __future__ import annotations

import re
import socket
from urllib.parse import urlsplit, urlunsplit


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free on `host` right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def redacted(url: str) -> str:
    """`url` with its password (if any) replaced by ***, for messages and logs."""
    parts = urlsplit(url)
    if "password=" in parts.query:  # redis-py also takes ?password=...
        parts = parts._replace(query=re.sub(r"password=[^&]*", "password=***", parts.query))
    if not parts.password:
        return urlunsplit(parts)
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))
