"""Where the rollout service's engines are: a fixed list, a DNS name re-resolved (each
address is an engine: a Kubernetes headless Service), or a router's worker list. Plain
logic: `EngineDiscovery.lookup()` answers the engines' base URLs now; the engine pool
applies them (`EnginePool.set_members`), `watch` does both every `interval_seconds`."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

import httpx
from pydantic import BaseModel, ConfigDict, Field, model_validator

log = logging.getLogger(__name__)

# host, port -> the addresses the name has now (an injected one in tests).
Resolver = Callable[[str, int], Awaitable[list[str]]]
# The largest worker-list answer read (a list of URLs: thousands fit).
MAX_LIST_BYTES = 1024 * 1024


class DiscoveryConfig(BaseModel):
    """How the rollout service finds its engines."""

    model_config = ConfigDict(extra="forbid")

    source: Literal["static", "dns", "router"] = Field(
        "static",
        description="'static': engine_urls, fixed; 'dns': every A/AAAA record of dns_address is an engine (a "
        "Kubernetes headless Service); 'router': the engines an SGLang router lists at list_url.",
    )
    dns_address: str = Field(
        "", max_length=300, description="host:port of the engines' headless Service (source 'dns')."
    )
    scheme: Literal["http", "https"] = Field("http", description="Scheme of the engines found by DNS.")
    list_url: str = Field(
        "",
        max_length=2048,
        description="URL of a router's worker list (source 'router'): SGLang's router answers GET /list_workers "
        'with {"urls": [...]} and GET /workers with {"workers": [{"url": ...}]}; both are read.',
    )
    interval_seconds: float = Field(10.0, gt=0, le=3600, description="How often the engines are looked up again.")
    timeout_seconds: float = Field(5.0, gt=0, le=120, description="Deadline of one lookup.")
    max_engines: int = Field(
        64, ge=1, le=4096, description="Most engines the pool takes; a lookup that finds more is refused."
    )

    @model_validator(mode="after")
    def _complete(self) -> DiscoveryConfig:
        if self.source == "dns":
            split_host_port(self.dns_address)  # (raises ValueError with the reason)
        if self.source == "router" and urlsplit(self.list_url).scheme not in ("http", "https"):
            raise ValueError(f"source 'router' needs list_url, an http(s) URL; got {self.list_url!r}")
        return self


def split_host_port(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"source 'dns' needs dns_address as host:port; got {address!r}")
    return host, int(port)


class DiscoveryFailed(Exception):
    """A lookup failed or answered something unusable (the pool keeps the engines it has)."""


async def system_resolver(host: str, port: int) -> list[str]:
    """Every address the system resolver has for `host` now (a headless Service: one per ready pod)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [info[4][0] for info in infos]


def engine_url(scheme: str, address: str, port: int) -> str:
    ip = ipaddress.ip_address(address)
    return f"{scheme}://[{ip}]:{port}" if ip.version == 6 else f"{scheme}://{ip}:{port}"


def normalized(urls: list[str]) -> list[str]:
    """Base URLs without a trailing slash, each once, in the order given."""
    return list(dict.fromkeys(u.rstrip("/") for u in urls))


@dataclass
class DiscoveryStatus:
    """What the last lookup found, for ListEngines and the logs."""

    description: str  # where the engines come from, e.g. "dns engine:30000"
    error: str = ""  # why the last lookup failed ("" when it did not); the engines are those found before
    looked_up_at: float = 0.0  # time.time() of the last lookup that answered (0: none yet)


class EngineDiscovery:
    def __init__(
        self,
        config: DiscoveryConfig,
        static_urls: list[str],
        http: httpx.AsyncClient | None = None,
        resolver: Resolver = system_resolver,
    ) -> None:
        self.config = config
        self.static_urls = normalized(static_urls)
        self.http = http
        self.resolver = resolver
        target = {"static": ", ".join(self.static_urls), "dns": config.dns_address, "router": config.list_url}
        self.status = DiscoveryStatus(f"{config.source} {target[config.source]}")

    @property
    def dynamic(self) -> bool:
        return self.config.source != "static"

    async def lookup(self) -> list[str]:
        """The engines' base URLs now. DiscoveryFailed (and the status says why) when the
        lookup fails, times out or finds more than max_engines."""
        try:
            urls = await asyncio.wait_for(self._lookup(), self.config.timeout_seconds)
        except asyncio.TimeoutError:
            self.status.error = f"no answer within {self.config.timeout_seconds:g} s"
        except DiscoveryFailed as e:
            self.status.error = str(e)
        except (OSError, httpx.HTTPError) as e:
            self.status.error = f"{type(e).__name__}: {e}"
        else:
            if len(urls) > self.config.max_engines:
                self.status.error = f"found {len(urls)} engines, more than max_engines ({self.config.max_engines})"
            else:
                self.status.error, self.status.looked_up_at = "", time.time()
                return urls
        raise DiscoveryFailed(f"looking up the engines ({self.status.description}) failed: {self.status.error}")

    async def _lookup(self) -> list[str]:
        c = self.config
        if c.source == "static":
            return self.static_urls
        if c.source == "dns":
            host, port = split_host_port(c.dns_address)
            try:
                addresses = await self.resolver(host, port)
            except socket.gaierror as e:
                # A headless Service with no ready pod has no record: no engine, not a failure.
                if e.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
                    return []
                raise
            return normalized([engine_url(c.scheme, a, port) for a in addresses])
        return await self._router_list()

    async def _router_list(self) -> list[str]:
        if self.http is None:
            raise DiscoveryFailed("no HTTP client to ask the router with")
        async with self.http.stream("GET", self.config.list_url, timeout=self.config.timeout_seconds) as r:
            if r.status_code != 200:
                raise DiscoveryFailed(f"GET {self.config.list_url} answered {r.status_code}")
            body = b""
            async for chunk in r.aiter_bytes():
                body += chunk
                if len(body) > MAX_LIST_BYTES:
                    raise DiscoveryFailed(f"the worker list is larger than {MAX_LIST_BYTES} bytes")
        return normalized(worker_urls(body))


def worker_urls(body: bytes) -> list[str]:
    """The URLs of a router's worker list: SGLang's router answers /list_workers with
    {"urls": [...]} and /workers with {"workers": [{"url": ...}, ...]}."""
    try:
        data = json.loads(body)
    except ValueError:
        raise DiscoveryFailed("the worker list is not JSON") from None
    if isinstance(data, dict) and isinstance(data.get("urls"), list):
        urls = data["urls"]
    elif isinstance(data, dict) and isinstance(data.get("workers"), list):
        urls = [w.get("url") if isinstance(w, dict) else None for w in data["workers"]]
    else:
        raise DiscoveryFailed('the worker list has neither "urls" nor "workers"')
    for u in urls:
        if not isinstance(u, str) or urlsplit(u).scheme not in ("http", "https") or not urlsplit(u).netloc:
            raise DiscoveryFailed(f"the worker list names {u!r}, not an http(s) URL")
    return urls


async def watch(discovery: EngineDiscovery, apply: Callable[[list[str]], object]) -> None:
    """Look the engines up every interval and apply what is found; a failed lookup keeps the
    engines found before (and says so, once per failure spell)."""
    failing = False
    while True:
        await asyncio.sleep(discovery.config.interval_seconds)
        try:
            urls = await discovery.lookup()
        except DiscoveryFailed as e:
            if not failing:
                log.warning("%s; keeping the engines found before", e)
            failing = True
            continue
        if failing:
            log.info("looking up the engines (%s) answers again", discovery.status.description)
        failing = False
        apply(urls)
