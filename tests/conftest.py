"""Shared fixtures: a real Redis server, the tiny model, and servers run for real on
loopback in background threads (each with its own asyncio loop)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import redis
import torch

from rlmesh.buffer.config import Settings as BufferSettings
from rlmesh.buffer.server import start as start_buffer
from rlmesh.cli.embedded_redis import start_redis
from rlmesh.cli.launcher import http_ready, wait_until_ready
from rlmesh.cli.tiny_model import build_tiny_model
from rlmesh.common.auth import ensure_stack_token
from rlmesh.common.grpc_server import sync_channel
from rlmesh.v1 import buffer_pb2_grpc

# Two cores: keep torch from oversubscribing them while servers run beside the tests.
torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One token for every server the tests start (in-process or as subprocesses) and every client.
ensure_stack_token()


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need CUDA: skipped, with the reason, on machines without one."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def buffer_files_under_pytest_tmp(tmp_path_factory):
    """Every buffer the tests start (in-process or as a process) reads datasets and
    writes exports under pytest's temporary directory, where each test's tmp_path lies:
    its data_roots, model_roots and export_dir, by environment; every trainer its model_roots.
    Tests of the roots set their own."""
    base = str(tmp_path_factory.getbasetemp())
    os.environ["RLMESH_BUFFER_DATA_ROOTS"] = json.dumps([base])
    os.environ["RLMESH_BUFFER_EXPORT_DIR"] = base
    # (and load models and tokenizers from there: tiny_model_dir and each test's own)
    os.environ["RLMESH_BUFFER_MODEL_ROOTS"] = json.dumps([base])
    os.environ["RLMESH_TRAINER_MODEL_ROOTS"] = json.dumps([base])
    # (and every engine loads trainers' disk pushes from there: their work_dir is a tmp_path)
    os.environ["RLMESH_ENGINE_WEIGHT_ROOTS"] = json.dumps([base])


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server) -> str:
    """A real Redis, flushed before each test (by its admin: the services' user may not);
    the URL is the services' (a restricted ACL user, as `rlmesh up` gives them)."""
    redis.Redis.from_url(redis_server.admin_url).flushall()
    return redis_server.url


@pytest.fixture
def silent_address():
    """host:port of a listener that accepts connections and never speaks: calls to it wait
    for their deadline (a run that calls it stays active for the test)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    yield f"127.0.0.1:{listener.getsockname()[1]}"
    listener.close()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


class LoopThread:
    """An asyncio event loop in a daemon thread, for running servers beside sync tests."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Awaitable, timeout: float | None = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@pytest.fixture
def loop_thread():
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture
def start_in_loop(loop_thread) -> Callable:
    """start_in_loop(factory) runs an async start function (returning (server, port)) in
    the background loop and returns its result. The fixture keeps the servers alive
    (an unreferenced grpc.aio server is shut down when collected) and stops them after
    the test."""
    started = []

    def run(factory):
        result = loop_thread.run(factory())
        started.append(result)
        return result

    yield run
    for result in reversed(started):
        server = result[0] if isinstance(result, tuple) else result
        stop = getattr(server, "stop", None)
        if stop is not None:
            try:
                loop_thread.run(_stop(server), timeout=30)
            except Exception:
                pass


async def _stop(server) -> None:
    import inspect

    if hasattr(server, "should_exit"):  # uvicorn
        server.should_exit = True
        return
    result = server.stop(0)
    if inspect.isawaitable(result):
        await result
    close_service = getattr(server, "close_service", None)  # (a service of start_service)
    if close_service is not None:
        await close_service()


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir, tmp_path_factory):
    """The CPU reference engine in its own process (as in production: the weight group's
    ranks must live in different processes)."""
    import subprocess
    import sys

    from rlmesh.common.net import free_port

    port = free_port()
    log = open(tmp_path_factory.mktemp("engine") / "engine.log", "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlmesh.cli",
            "serve",
            "engine",
            "--model-path",
            str(tiny_model_dir),
            "--port",
            str(port),
            "--num-threads",
            "1",
            "--enable-metrics",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(lambda: http_ready(url), proc, "the reference engine", timeout=120)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture
def dataset(tmp_path) -> Path:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"q": f"question {i}", "a": str(i)}) + "\n" for i in range(5)))
    return path


@pytest.fixture
def buffer(redis_url, start_in_loop):
    """buffer(**settings) -> a stub of a fresh buffer server on the test's Redis."""

    def factory(**overrides):
        settings = BufferSettings(**{"redis_url": redis_url, "port": 0, **overrides})
        _, port = start_in_loop(lambda: start_buffer(settings))
        return buffer_pb2_grpc.BufferStub(sync_channel(f"127.0.0.1:{port}"))

    return factory
