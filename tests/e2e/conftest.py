"""The end-to-end tests' stack: every service real, on loopback, behind the REST API."""

from __future__ import annotations

import pytest

from rlmesh.common.grpc_server import sync_channel
from rlmesh.v1 import buffer_pb2_grpc
from tests.helpers.stack import start_local_stack


@pytest.fixture
def services(redis_url, start_in_loop, engine_url, tmp_path):
    stack = start_local_stack(start_in_loop, redis_url, engine_url, tmp_path)
    return stack.api, buffer_pb2_grpc.BufferStub(sync_channel(stack.addresses["buffer"]))
