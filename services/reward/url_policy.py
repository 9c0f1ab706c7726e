"""Which hosts the reward service may call: the policy for remote reward service URLs.

A registration names a URL, so without a policy anyone who can register could make the
reward service POST to whatever it can reach (an engine's admin routes, a cloud metadata
endpoint). Every address a URL's host resolves to is checked:

- never called, whatever the settings: link-local addresses (169.254.0.0/16, fe80::/10,
  where cloud metadata endpoints live), known cloud metadata addresses and host names
  (metadata.google.internal, ...), unspecified (0.0.0.0, ::), "this network" (0.0.0.0/8),
  multicast, broadcast and reserved addresses;
- called only where the operator allows it (`remote_allowed_networks`, CIDRs or host
  names): loopback (127.0.0.0/8, ::1), private (10/8, 172.16/12, 192.168/16, fc00::/7),
  shared (100.64/10) and every other address that is not globally routable;
- called freely: public addresses.

IPv4 addresses carried in IPv6 ones (::ffff:a.b.c.d, 6to4, NAT64 64:ff9b::/96) are judged
as the IPv4 address they carry. One forbidden address refuses the whole host.

DNS rebinding: the check is not done once at registration only. The transports resolve
and check the host again before every call and then connect to one of the addresses they
just checked (never resolving the name a second time), so a name that later resolves to
a forbidden address gets refused calls, not a connection.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from collections.abc import Iterable
from urllib.parse import urlsplit

from rlmesh.common import errors
from rlmesh.common.net import METADATA_HOSTS

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# Cloud metadata endpoints outside link-local space (AWS IPv6, Alibaba, Azure's wire
# server, Oracle's legacy one); 169.254.169.254 and its kin are link-local anyway.
METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(a) for a in ("fd00:ec2::254", "100.100.100.200", "168.63.129.16", "192.0.0.192")
)

_THIS_NETWORK = ipaddress.ip_network("0.0.0.0/8")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_HOSTNAME = re.compile(r"^(?=.{1,253}$)[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*$")
_DEFAULT_PORTS = {"http": 80, "https": 443}

FORBIDDEN, LOCAL, PUBLIC = "forbidden", "local", "public"


class Refused(errors.InvalidArgument):
    """The URL's host is, or resolves to, an address the policy does not let the service call."""


class Unresolvable(errors.FailedPrecondition):
    """The URL's host could not be resolved (in time)."""


def embedded_ipv4(ip: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address stands for (IPv4-mapped, 6to4, NAT64), if any."""
    if ip.version == 4:
        return None
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def classify(ip: IPAddress) -> tuple[str, str]:
    """(FORBIDDEN | LOCAL | PUBLIC, what the address is, for messages)."""
    carried = embedded_ipv4(ip)
    if carried is not None:
        return classify(carried)
    if ip in METADATA_ADDRESSES:
        return FORBIDDEN, "a cloud metadata address"
    if ip.is_loopback:  # before is_reserved: ::1 lies in the reserved ::/8
        return LOCAL, "a loopback address"
    if ip.is_link_local:
        return FORBIDDEN, "a link-local address (where cloud metadata endpoints live)"
    if ip.is_unspecified or ip.is_multicast or ip.is_reserved or ip in _THIS_NETWORK:
        return FORBIDDEN, "an unspecified, multicast, broadcast or reserved address"
    if ip.is_global and not (ip.version == 6 and ip.is_site_local):
        return PUBLIC, "a public address"
    return LOCAL, "a private (not globally routable) address"


def _host_name(host: str) -> str:
    return host.lower().rstrip(".")


class UrlPolicy:
    """allowed: the reward setting remote_allowed_networks, CIDRs ("10.0.0.0/8", "::1")
    and host names ("judge.internal") whose loopback or private addresses may be called.
    Nothing lifts the ban on link-local and metadata addresses."""

    def __init__(self, allowed: Iterable[str] = ()) -> None:
        self.networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        self.hosts: set[str] = set()
        for entry in allowed:
            try:
                self.networks.append(ipaddress.ip_network(entry.strip(), strict=False))
                continue
            except ValueError:
                pass
            name = _host_name(entry.strip())
            if not _HOSTNAME.match(name):
                raise ValueError(
                    f"{entry!r} is neither a network (CIDR such as 10.0.0.0/8, or an address) nor a host name"
                )
            self.hosts.add(name)

    def allows(self, ip: IPAddress, host: str = "") -> tuple[bool, str]:
        """Whether the service may call `ip` (reached through the URL host `host`), and what it is."""
        kind, what = classify(ip)
        if kind == FORBIDDEN:
            return False, what
        if kind == PUBLIC or _host_name(host) in self.hosts:
            return True, what
        candidates = [ip] + [c for c in (embedded_ipv4(ip),) if c is not None]
        return any(c in net for c in candidates for net in self.networks), what

    async def resolve(self, url: str, timeout: float) -> list[str]:
        """The addresses of the URL's host, every one checked, in the resolver's order.
        Raises Refused when the host or any of its addresses is not allowed (a name with one
        bad address is refused whole: which one a later connection would get is not ours to
        pick), Unresolvable when it does not resolve within `timeout` seconds."""
        parts = urlsplit(url)
        host = parts.hostname or ""
        if _host_name(host) in METADATA_HOSTS:
            raise Refused(f"URL {url!r}: {host} is a cloud metadata host; the reward service never calls it")
        port = parts.port or _DEFAULT_PORTS.get(parts.scheme.lower(), 0)
        try:
            # getaddrinfo runs in a thread (the loop's executor); wait_for bounds the wait.
            infos = await asyncio.wait_for(
                asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM), timeout
            )
        except (asyncio.TimeoutError, TimeoutError):
            raise Unresolvable(f"URL {url!r}: cannot resolve {host} within {timeout:g} s") from None
        except (socket.gaierror, UnicodeError) as e:
            raise Unresolvable(f"URL {url!r}: cannot resolve {host}: {getattr(e, 'strerror', None) or e}") from None
        addresses = list(dict.fromkeys(info[4][0] for info in infos))
        for address in addresses:
            ip = ipaddress.ip_address(address)
            allowed, what = self.allows(ip, host)
            if not allowed:
                if classify(ip)[0] == FORBIDDEN:
                    raise Refused(f"URL {url!r}: {host} resolves to {what}, which the reward service never calls")
                raise Refused(
                    f"URL {url!r}: {host} resolves to {what}, which this reward service does not call; an operator "
                    "can allow it with the reward setting remote_allowed_networks (CIDRs or host names)"
                )
        if not addresses:
            raise Unresolvable(f"URL {url!r}: {host} resolves to no address")
        return addresses


# The conformance kit (`rlmesh reward check`) runs on the operator's own machine against
# their own service: any address but the never-called ones.
ANY_ADDRESS = UrlPolicy(["0.0.0.0/0", "::/0"])
