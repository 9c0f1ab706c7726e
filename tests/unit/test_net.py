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
