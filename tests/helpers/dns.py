"""A stand-in resolver for made-up host names, for tests of the reward service's URL policy
(the only way to make a name resolve to a cloud metadata address, or change its answer)."""

from __future__ import annotations

import asyncio
import socket


def fake_dns(monkeypatch) -> dict[str, list[str]]:
    """name -> addresses, consulted by every asyncio loop's getaddrinfo in this process (the
    reward service resolves through it); other names resolve for real. Edit it to re-point a name."""
    names: dict[str, list[str]] = {}
    real = asyncio.BaseEventLoop.getaddrinfo

    async def getaddrinfo(self, host, port, *args, **kwargs):
        if host in names:
            return [
                (socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port))
                for a in names[host]
            ]
        return await real(self, host, port, *args, **kwargs)

    monkeypatch.setattr(asyncio.BaseEventLoop, "getaddrinfo", getaddrinfo)
    return names
