"""Each trainer rank's GET /health (rlmesh.trainer.rank_health), over real HTTP: what a
Kubernetes probe of a rank that serves no gRPC is told, and clear answers to anything else."""

from __future__ import annotations

import httpx
import pytest

from rlmesh.trainer.rank_health import HealthServer, RankHealth


@pytest.fixture
def endpoint():
    servers = []

    def start(health: RankHealth) -> str:
        servers.append(HealthServer(health, "127.0.0.1", 0))
        return f"http://127.0.0.1:{servers[-1].port}"

    yield start
    for server in servers:
        server.close()


def test_a_follower_is_healthy_once_it_has_joined_and_until_its_group_fails(endpoint):
    failure = ""
    health = RankHealth(rank=1, world_size=2, local_rank=0, group_failure=lambda: failure)
    url = endpoint(health) + "/health"
    answer = httpx.get(url, timeout=5)
    assert answer.status_code == 503 and answer.json()["joined"] is False  # joining the process group
    health.joined()
    answer = httpx.get(url, timeout=5)
    assert answer.status_code == 200
    assert answer.json() == {"rank": 1, "local_rank": 0, "world_size": 2, "joined": True, "serving": False}
    failure = "the ranks' command group failed: RuntimeError: Connection reset by peer"
    answer = httpx.get(url, timeout=5)
    assert answer.status_code == 503 and "Connection reset" in answer.json()["failure"]


def test_rank_0_is_healthy_only_while_it_serves_grpc(endpoint):
    health = RankHealth(rank=0, world_size=2)
    url = endpoint(health) + "/health"
    health.joined()
    assert httpx.get(url, timeout=5).status_code == 503
    health.serving(True)
    assert httpx.get(url, timeout=5).status_code == 200
    health.serving(False)  # graceful shutdown
    assert httpx.get(url, timeout=5).status_code == 503


def test_other_paths_and_methods_get_a_clear_json_answer(endpoint):
    url = endpoint(RankHealth(rank=0, world_size=1))
    missing = httpx.get(url + "/metrics", timeout=5)
    assert missing.status_code == 404 and "GET /health" in missing.json()["error"]
    refused = httpx.post(url + "/health", timeout=5)
    assert refused.status_code == 405 and "POST" in refused.json()["error"]
