"""`rlmesh up`'s supervision on real processes: a service killed with SIGKILL, and the
embedded Redis, come back on the same port while the rest keeps running; Ctrl-C's path
(the stop event) still stops everything."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from rlmesh.cli.launcher import SERVICES, grpc_health, start_stack, supervise
from rlmesh.common.auth import TOKEN_ENV, TOKEN_FILE_ENV
from rlmesh.common.net import free_port


def eventually(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Poll until `condition` holds; the deadline only keeps a broken test from hanging."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout:.0f} s"
        time.sleep(0.1)


def rlmesh_health(address: str) -> int:
    """`rlmesh health` as the compose healthcheck runs it: no token in its environment."""
    env = {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, TOKEN_FILE_ENV)}
    return subprocess.run(
        [sys.executable, "-m", "rlmesh.cli", "health", address, "--timeout", "2"],
        env=env,
        capture_output=True,
        timeout=60,
    ).returncode


def redis_answers(url: str) -> bool:
    try:
        return redis.Redis.from_url(url, socket_timeout=2).ping()
    except redis.RedisError:
        return False


@pytest.mark.slow
def test_a_killed_service_and_redis_come_back_on_their_ports(tiny_model_dir, tmp_path):
    stack = start_stack(tmp_path / "stack", str(tiny_model_dir), echo=lambda _: None)
    stop, lines = threading.Event(), []
    loop = threading.Thread(target=supervise, args=(stack, stop), kwargs={"interval": 0.1, "echo": lines.append})
    loop.start()
    try:
        others = {name: stack.processes[name] for name in SERVICES if name != "reward"}
        killed = stack.processes["reward"]
        address = stack.address("reward")
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=30)

        eventually(
            lambda: stack.processes["reward"] is not killed and grpc_health(address) == "SERVING",
            "the reward service serving again",
        )
        assert stack.address("reward") == address
        assert rlmesh_health(address) == 0
        assert all(stack.processes[name] is p and p.poll() is None for name, p in others.items())
        assert lines[0].startswith("reward exited (killed by SIGKILL) after ")
        assert lines[0].endswith("restart attempt 1 in 1 s")
        assert "reward exited (killed by SIGKILL)" in (stack.data_dir / "logs" / "reward.log").read_text()

        old_redis = stack.redis
        old_redis.stop(kill=True)
        eventually(lambda: stack.redis is not old_redis and redis_answers(stack.redis_url), "Redis answering again")
        assert (stack.redis.port, stack.redis.password) == (old_redis.port, old_redis.password)
    finally:
        stop.set()
        loop.join(timeout=120)
    assert not loop.is_alive()
    assert all(p.poll() is not None for p in stack.processes.values()) and stack.redis.process.poll() is not None
    assert not (stack.data_dir / "up.json").exists()
    assert rlmesh_health(f"127.0.0.1:{free_port()}") == 1


@pytest.mark.slow
def test_a_terminated_demo_stops_the_stack_it_started(tmp_path):
    """`kill` (or a CI job's timeout) on `rlmesh demo` must not leave its services running."""

    def alive(pid: int) -> bool:
        try:
            return (Path("/proc") / str(pid) / "stat").read_text().split(")")[-1].split()[0] != "Z"
        except OSError:
            return False

    def children(pid: int) -> list[int]:  # the demo's services and Redis are its direct children
        found = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                if int(stat.read_text().split(")")[-1].split()[1]) == pid:
                    found.append(int(stat.parent.name))
            except (OSError, ValueError):
                pass
        return found

    demo = subprocess.Popen(
        [sys.executable, "-m", "rlmesh.cli", "demo", "--data-dir", str(tmp_path), "--rollouts", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        for line in demo.stdout:
            if " started: " in line:  # the stack is up and the run submitted
                break
        stack = children(demo.pid)
        assert len(stack) >= len(SERVICES) + 1  # the services, Redis
        demo.send_signal(signal.SIGTERM)
        assert demo.wait(timeout=120) != 0
    finally:
        if demo.poll() is None:  # (the test failed: leave nothing running behind it)
            for pid in children(demo.pid):
                os.kill(pid, signal.SIGKILL)
            demo.kill()
    eventually(lambda: not any(alive(pid) for pid in stack), "every process of the demo's stack stopped")
