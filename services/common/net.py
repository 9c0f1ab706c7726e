"""Network helpers shared by the services."""

from __future__ import annotations

import os
import random
import re
import socket
from collections.abc import MutableMapping
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

# Ports free_port picks from, below the kernel's ephemeral range: a port the OS hands out
# from that range can be taken by an outgoing connection (a stack's services hold hundreds)
# before the service that was given it binds it, which failed the service's start.
PICKED_PORTS_LOW = 20_000
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
_PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")
_picked: set[int] = set()  # (never handed out twice by this process)


# Cloud metadata services by name: no rlmesh service ever connects to them (the reward
# service's URL policy, the engine's weight groups).
METADATA_HOSTS = frozenset(
    {"metadata", "metadata.google.internal", "metadata.goog", "instance-data", "instance-data.ec2.internal"}
)


def is_host_name(host: str) -> bool:
    """A name DNS can carry: labels of 1-63 bytes (IDNA-encoded), 253 in all."""
    try:
        encoded = host.encode("idna")
    except UnicodeError:
        return False
    labels = encoded.rstrip(b".").split(b".")
    return 0 < len(encoded) <= 253 and all(0 < len(label) <= 63 for label in labels)


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free on `host` right now, below the ephemeral range where it can be
    (else the OS picks one)."""
    low = _ephemeral_low()
    for port in random.sample(range(PICKED_PORTS_LOW, low), min(64, max(low - PICKED_PORTS_LOW, 0))):
        if port not in _picked and _bindable(host, port):
            _picked.add(port)
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; elsewhere none is known)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return PICKED_PORTS_LOW


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


def loopback_bypasses_proxy(environ: MutableMapping[str, str] = os.environ) -> None:
    """With a proxy in the environment (HTTP_PROXY and the like, usual in a corporate shell),
    httpx and aiohttp would send the calls between a stack's own processes on 127.0.0.1 to
    that proxy, which cannot reach them. The loopback hosts are added to NO_PROXY (both
    spellings, the same list), which the services a launcher starts inherit; other hosts
    keep going through the proxy as configured."""
    if not any(environ.get(v) or environ.get(v.lower()) for v in _PROXY_VARIABLES):
        return
    listed = [h.strip() for key in ("NO_PROXY", "no_proxy") for h in environ.get(key, "").split(",")]
    hosts = list(dict.fromkeys(h for h in listed if h))  # (in order, once each)
    if "*" not in hosts:
        hosts += [h for h in LOOPBACK_HOSTS if h not in hosts]
    environ["NO_PROXY"] = environ["no_proxy"] = ",".join(hosts)
