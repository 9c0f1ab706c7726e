"""Every rlmesh service started in-process on loopback (the engine runs in its own
process, see the engine_url fixture), for end-to-end tests through the REST API."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from rlmesh.buffer.config import Settings as BufferSettings
from rlmesh.buffer.server import start as start_buffer
from rlmesh.common.auth import client_headers
from rlmesh.common.net import free_port
from rlmesh.coordinator.app import start as start_coordinator
from rlmesh.coordinator.config import Settings as CoordinatorSettings
from rlmesh.reward.config import Settings as RewardSettings
from rlmesh.reward.server import start as start_reward
from rlmesh.rollout.config import Settings as RolloutSettings
from rlmesh.rollout.server import start as start_rollout
from rlmesh.trainer.config import Settings as TrainerSettings
from rlmesh.trainer.server import start as start_trainer

FINAL = ("completed", "failed", "stopped")


@dataclass
class LocalStack:
    api: httpx.Client  # the coordinator's REST API
    addresses: dict[str, str]  # service name -> host:port
    servers: dict[str, object] = field(default_factory=dict)  # service name -> its server
    metrics_urls: dict[str, str] = field(default_factory=dict)  # gRPC service -> its /metrics (metrics=True)


def start_local_stack(
    start_in_loop,
    redis_url: str,
    engine_url: str,
    work_dir: Path,
    rollout_settings: dict | None = None,
    coordinator_settings: dict | None = None,
    metrics: bool = False,
    **reward_settings,
) -> LocalStack:
    addr, servers, metrics_urls = {}, {}, {}

    def up(name: str, start, settings) -> None:
        if metrics and name != "coordinator":
            settings.metrics_port = free_port()
            metrics_urls[name] = f"http://127.0.0.1:{settings.metrics_port}/metrics"
        servers[name], port = start_in_loop(lambda: start(settings))
        addr[name] = f"127.0.0.1:{port}"

    up("buffer", start_buffer, BufferSettings(redis_url=redis_url, port=0))
    # The tests' remote reward services listen on loopback (as `rlmesh up` allows).
    up(
        "reward",
        start_reward,
        RewardSettings(port=0, redis_url=redis_url, **{"remote_allowed_networks": ["127.0.0.0/8"], **reward_settings}),
    )
    up(
        "rollout",
        start_rollout,
        RolloutSettings(
            port=0,
            buffer_address=addr["buffer"],
            reward_address=addr["reward"],
            **{"engine_urls": [engine_url], **(rollout_settings or {})},
        ),
    )
    up(
        "trainer",
        start_trainer,
        TrainerSettings(
            port=0, buffer_address=addr["buffer"], rollout_address=addr["rollout"], work_dir=work_dir / "trainer"
        ),
    )
    up(
        "coordinator",
        start_coordinator,
        CoordinatorSettings(
            port=0,
            redis_url=redis_url,
            buffer_address=addr["buffer"],
            rollout_address=addr["rollout"],
            reward_address=addr["reward"],
            trainer_address=addr["trainer"],
            **(coordinator_settings or {}),
        ),
    )
    api = httpx.Client(base_url=f"http://{addr['coordinator']}", timeout=30, headers=client_headers())
    return LocalStack(api, addr, servers, metrics_urls)


def wait_for_run(
    api: httpx.Client,
    run_id: str,
    done: Callable[[dict], bool] = lambda run: run["status"] in FINAL,
    timeout: float = 300,
) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        run = api.get(f"/runs/{run_id}").json()
        if done(run):
            return run
        if time.monotonic() > deadline:
            raise AssertionError(f"run {run_id} still {run['status']} after {timeout} s")
        time.sleep(0.1)
