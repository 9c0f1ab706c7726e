"""The compose file's safe defaults: only the coordinator is published (on loopback unless
the operator says otherwise), the services talk on an internal network, every rlmesh
service gets the stack's token, Redis demands a password that the services use, every
service has a healthcheck, and the image runs as an unprivileged user."""

from __future__ import annotations

from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RLMESH_SERVICES = ("buffer", "reward", "rollout", "trainer", "coordinator")


def compose() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def test_only_the_coordinator_is_published_and_on_loopback_by_default():
    services = compose()["services"]
    published = {name: s["ports"] for name, s in services.items() if s.get("ports")}
    assert list(published) == ["coordinator"]
    assert published["coordinator"] == ["${RLMESH_API_BIND:-127.0.0.1}:8000:8000"]
    assert all(s.get("network_mode") != "host" for s in services.values())


def test_services_talk_on_an_internal_network_with_secrets():
    spec = compose()
    assert spec["networks"]["internal"]["internal"] is True
    base = spec["x-rlmesh"]
    assert base["networks"] == ["internal"] and base["read_only"] is True and base["cap_drop"] == ["ALL"]
    env = base["environment"]
    assert env["RLMESH_TOKEN"].startswith("${RLMESH_TOKEN:?")  # no token, no start
    for service in ("BUFFER", "REWARD", "COORDINATOR"):
        assert env[f"RLMESH_{service}_REDIS_URL"].startswith("redis://:${REDIS_PASSWORD")
    assert "requirepass" in " ".join(spec["services"]["redis"]["command"])
    assert "--api-key" in " ".join(spec["services"]["sglang"]["command"])
    for name in RLMESH_SERVICES:
        assert "internal" in spec["services"][name]["networks"]


def test_every_rlmesh_service_has_a_healthcheck_on_its_own_port():
    services = compose()["services"]
    for name in RLMESH_SERVICES:
        service = services[name]
        port = service["command"][service["command"].index("--port") + 1]
        test = service["healthcheck"]["test"]
        assert test[0] == "CMD"
        if name == "coordinator":  # HTTP; the image has python but no curl
            assert test[1] == "python" and f"http://127.0.0.1:{port}/health" in test[-1]
        else:  # gRPC health, open without the token
            assert test[1:] == ["rlmesh", "health", f"127.0.0.1:{port}"]
        assert service["healthcheck"]["start_period"]


def test_the_image_runs_as_an_unprivileged_user():
    users = [line.split()[1] for line in (DEPLOY / "Dockerfile").read_text().splitlines() if line.startswith("USER ")]
    assert users and not users[-1].startswith(("0", "root"))
