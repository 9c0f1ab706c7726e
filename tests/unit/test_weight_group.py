"""The weight group's rendezvous store listens on the configured interface only (torch's
store alone would listen on every interface)."""

from __future__ import annotations

import socket

import pytest

from rlmesh.common.weight_group import rendezvous_socket


def test_the_rendezvous_listens_on_the_configured_interface_only():
    port, fd = rendezvous_socket("127.0.0.1")
    with socket.socket(fileno=fd) as sock:
        assert sock.getsockname() == ("127.0.0.1", port)


def test_an_address_of_another_machine_is_a_clear_error():
    with pytest.raises(OSError, match="weight_sync_bind_address"):
        rendezvous_socket("192.0.2.1")  # TEST-NET-1: never an address of this machine
