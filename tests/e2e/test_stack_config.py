"""`rlmesh up --config`: a section's plug-in registrations reach the service (real processes,
as `rlmesh up` starts them), and a reload (what SIGHUP does) restarts only the service whose
section changed, on its port, which then has the new registrations."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import yaml

from rlmesh.cli.launcher import SERVICES, grpc_health, reload_config, start_stack, supervise
from rlmesh.cli.stack_config import load_stack_config
from rlmesh.common.auth import client_headers


def registered_tools(api: httpx.Client, tmp_path, tiny_model_dir) -> str:
    """What the rollout service says it has, asked through POST /runs (a run naming a tool it
    lacks is refused with 422 before anything starts)."""
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "p", "label": "l"}\n')
    run = {
        "model_path": str(tiny_model_dir),
        "datasets": [{"name": "train", "path": str(data)}],
        "rollout": {"generate": {"name": "agent", "options": {"tools": ["nope"], "tool_parser": "hermes"}}},
    }
    r = api.post("/runs", json=run)
    assert r.status_code == 422, r.text
    return next(e["msg"] for e in r.json()["detail"] if "unknown tools" in e["msg"])


@pytest.mark.slow
def test_plugins_come_from_the_stack_config_and_a_reload_restarts_only_their_service(tmp_path, tiny_model_dir):
    config_file = tmp_path / "stack.yaml"
    config_file.write_text(yaml.safe_dump({"rollout": {"tools": {"first": "rlmesh.cli.agent_demo:code"}}}))
    data_dir = tmp_path / "stack"
    data_dir.mkdir()
    (data_dir / "datasets").mkdir()
    stack = start_stack(
        data_dir, str(tiny_model_dir), echo=lambda _: None, service_config=load_stack_config(config_file)
    )
    stop, reload, lines = threading.Event(), threading.Event(), []
    loop = threading.Thread(
        target=supervise,
        args=(stack, stop),
        kwargs={
            "interval": 0.1,
            "echo": lines.append,
            "reload": reload,
            "on_reload": lambda: reload_config(stack, load_stack_config(config_file), echo=lines.append),
        },
    )
    loop.start()
    api = httpx.Client(base_url=stack.coordinator_url, timeout=30, headers=client_headers())
    try:
        assert registered_tools(api, data_dir / "datasets", tiny_model_dir).endswith(
            "the rollout service has: first (settings tools / http_tools)"
        )
        before = dict(stack.processes)

        config_file.write_text(yaml.safe_dump({"rollout": {"tools": {"second": "rlmesh.cli.agent_demo:code"}}}))
        reload.set()
        deadline = time.monotonic() + 120
        while stack.processes["rollout"] is before["rollout"] or grpc_health(stack.address("rollout")) != "SERVING":
            assert time.monotonic() < deadline, lines
            time.sleep(0.2)
        assert "rollout: its settings changed; restarting it on its port" in lines
        assert "second (settings tools" in registered_tools(api, data_dir / "datasets", tiny_model_dir)
        assert all(stack.processes[n] is before[n] and before[n].poll() is None for n in SERVICES if n != "rollout")
    finally:
        api.close()
        stop.set()
        loop.join(timeout=120)
