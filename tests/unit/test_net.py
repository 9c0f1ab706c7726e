"""free_port: ports a stack's services bind, away from those the OS gives outgoing connections."""

from __future__ import annotations

import socket

from rlmesh.common import net
from rlmesh.common.net import free_port


def test_ports_are_picked_below_the_ephemeral_range_and_never_twice():
    low = net._ephemeral_low()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    if low > net.PICKED_PORTS_LOW:  # (Linux: outgoing connections take their ports from low up)
        assert all(net.PICKED_PORTS_LOW <= p < low for p in ports)


def test_a_port_in_use_is_not_picked(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        spare = next(p for p in range(net.PICKED_PORTS_LOW, 30_000) if net._bindable("127.0.0.1", p))
        monkeypatch.setattr(net, "_ephemeral_low", lambda: 65_000)
        monkeypatch.setattr(net, "_picked", set())
        monkeypatch.setattr(net.random, "sample", lambda population, k: [busy, spare])
        assert free_port() == spare


def test_loopback_joins_no_proxy_only_when_a_proxy_is_set():
    quiet = {"NO_PROXY": "a.example"}
    net.loopback_bypasses_proxy(quiet)
    assert quiet == {"NO_PROXY": "a.example"}  # no proxy: nothing to bypass

    env = {"https_proxy": "http://proxy:3128", "NO_PROXY": "a.example", "no_proxy": "b.example,a.example"}
    net.loopback_bypasses_proxy(env)
    assert env["NO_PROXY"] == env["no_proxy"] == "a.example,b.example,127.0.0.1,localhost,::1"
    net.loopback_bypasses_proxy(env)  # (idempotent: a service started by the launcher runs it again)
    assert env["no_proxy"] == "a.example,b.example,127.0.0.1,localhost,::1"

    everything = {"HTTP_PROXY": "http://proxy:3128", "no_proxy": "*"}
    net.loopback_bypasses_proxy(everything)
    assert everything["NO_PROXY"] == "*"


def test_a_host_listed_twice_is_kept_once():
    env = {"HTTP_PROXY": "http://proxy:3128", "NO_PROXY": "a.example, a.example,,127.0.0.1"}
    net.loopback_bypasses_proxy(env)
    assert env["no_proxy"] == "a.example,127.0.0.1,localhost,::1"
