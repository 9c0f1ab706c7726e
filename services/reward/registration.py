"""Checking a remote reward service's registration (rlmesh.common.reward_service declares it
and its bounds) against what only this service knows: its defaults for the fields left at
0, the names its verifiers and reward functions already take, and which URLs it accepts.
Which hosts may be called at all is rlmesh.reward.url_policy's (checked at registration
and again before every call)."""

from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from rlmesh.common import errors
from rlmesh.common.net import is_host_name
from rlmesh.common.reward_service import SERVICE_NAME_PATTERN, RemoteServiceSpec, remote_service

PROTOCOLS = {"http": "http-json", "https": "http-json", "grpc": "grpc"}
_NAME = re.compile(SERVICE_NAME_PATTERN)
_TOKEN_CHARS = re.compile(r"^[A-Za-z0-9\-._~+/]*=*$")


@dataclass(frozen=True)
class RemoteDefaults:
    """What a registration leaves at 0 gets these (the reward service's settings)."""

    timeout_seconds: float = 30.0
    max_concurrency: int = 8
    max_batch_size: int = 32


def resolve_registration(spec: RemoteServiceSpec, defaults: RemoteDefaults, reserved: set[str]) -> RemoteServiceSpec:
    """Check a registration and fill in its defaults; errors.InvalidArgument says what is wrong."""
    name = spec.name.strip()
    if not _NAME.match(name):
        raise errors.InvalidArgument(
            f"service name {spec.name!r} is not valid: use 1-63 letters, digits, '_', '-' or '.', "
            "starting with a letter (it becomes the reward component name)"
        )
    if name in reserved:
        raise errors.InvalidArgument(
            f"service name '{name}' is already a built-in verifier or configured reward function; choose another name"
        )
    url = spec.url.strip()
    protocol = check_url(url)
    if spec.protocol and spec.protocol != protocol:
        raise errors.InvalidArgument(
            f"protocol '{spec.protocol}' does not match the URL {url!r} (its scheme means '{protocol}'); "
            "leave protocol empty to take it from the URL"
        )
    if not _TOKEN_CHARS.match(spec.bearer_token):
        raise errors.InvalidArgument("bearer_token must be characters of A-Z a-z 0-9 - . _ ~ + / = (RFC 6750)")
    if spec.bearer_token and urlsplit(url).scheme.lower() != "https" and not _is_loopback(urlsplit(url).hostname):
        raise errors.InvalidArgument(
            "a bearer_token is sent only over https:// (or to this machine): it would cross the network in clear text"
        )
    # (the defaults are this service's settings: checked against the model's bounds too)
    return remote_service(
        {
            **spec.model_dump(),
            "name": name,
            "url": url,
            "protocol": protocol,
            "timeout_seconds": float(spec.timeout_seconds or defaults.timeout_seconds),
            "max_concurrency": spec.max_concurrency or defaults.max_concurrency,
            "max_batch_size": spec.max_batch_size or defaults.max_batch_size,
        }
    )


def check_url(url: str) -> str:
    """The protocol a URL means; only http, https and grpc URLs are accepted."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise errors.InvalidArgument(f"URL {url!r} is not valid: {e}") from None
    scheme = parts.scheme.lower()
    if scheme not in PROTOCOLS:
        raise errors.InvalidArgument(
            f"URL {url!r}: only http://, https:// and grpc:// URLs are accepted"
            + (f", not {scheme}://" if scheme else " (the URL has no scheme)")
        )
    if not parts.hostname:
        raise errors.InvalidArgument(f"URL {url!r} has no host")
    if parts.username is not None or parts.password is not None:
        raise errors.InvalidArgument(
            "a URL with a user name or password is refused (it would be listed and "
            "logged): give the service's credential as bearer_token"
        )
    try:
        httpx.URL(url)
    except (httpx.InvalidURL, ValueError) as e:
        raise errors.InvalidArgument(f"URL {url!r} is not valid: {e}") from None
    _check_host_name(url, parts.hostname)
    if scheme == "grpc":
        if port is None:
            raise errors.InvalidArgument(f"URL {url!r}: a grpc:// URL needs a port, e.g. grpc://judge:50053")
        if parts.path not in ("", "/") or parts.query:
            raise errors.InvalidArgument(f"URL {url!r}: a grpc:// URL is host:port only (no path or query)")
    return PROTOCOLS[scheme]


def _check_host_name(url: str, host: str) -> None:
    """A name DNS can carry (an address literal passes as it is): what a resolver would
    otherwise fail on later, with its codec's words."""
    if host.startswith("[") or host.replace(".", "").isdigit() or ":" in host:
        return
    if not is_host_name(host):
        raise errors.InvalidArgument(
            f"URL {url[:200]!r}: host {host[:100]!r} is not a valid host name (labels of 1-63 characters, 253 in all)"
        )


def _is_loopback(host: str | None) -> bool:
    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host or "").is_loopback
    except ValueError:
        return False


def record_to_json(spec: RemoteServiceSpec) -> str:
    """The record kept in Redis (the credential included: it is sent on every call)."""
    return json.dumps(spec.model_dump(), sort_keys=True)


def record_from_json(text: str | bytes) -> RemoteServiceSpec:
    """A kept record; fields a later version no longer has are ignored."""
    data = json.loads(text)
    return RemoteServiceSpec(**{k: v for k, v in data.items() if k in RemoteServiceSpec.model_fields})
