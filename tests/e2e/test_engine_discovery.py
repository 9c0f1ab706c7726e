"""Engines that come and go without a restart: the rollout service finds its engines in a
router's worker list (GET /list_workers, served here; the test changes it during the run).
A run starts on one reference engine; two more join while it trains, each taking
generation only once the trainer's push gave it the run's weights; one is dropped from the
list (alive: it takes no request after its last in-flight one) and one dies and is
dropped; the run completes on the first with every group accounted for. Each engine is its
own process, weights are pushed over gloo."""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from rlmesh.common.grpc_server import sync_channel
from rlmesh.v1 import buffer_pb2, buffer_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from tests.helpers.runs import run_config
from tests.helpers.stack import start_local_stack, wait_for_run
from tests.helpers.trainer import EngineProcess

ROLLOUTS = 12


class WorkerList:
    """A router's worker list, as SGLang's router answers GET /list_workers: {"urls": [...]}."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = list(urls)
        worker_list = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                body = json.dumps({"urls": worker_list.urls}).encode()
                self.send_response(200 if self.path == "/list_workers" else 404)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/list_workers"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def three_engines(tiny_model_dir, tmp_path):
    engines = [EngineProcess(tiny_model_dir, tmp_path / f"engine-{name}.log", ("--enable-metrics",)) for name in "abc"]
    yield engines
    for engine in engines:
        if engine.process.poll() is None:
            engine.stop()


def prompt_tokens(engine: EngineProcess) -> float:
    """The engine's own count of the prompt tokens it took (SGLang's metric name)."""
    text = httpx.get(f"{engine.url}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r"^sglang:prompt_tokens(?:_total)?\{[^}]*\} (\S+)$", text, re.M))


@pytest.mark.slow
def test_engines_join_and_leave_a_running_run_without_a_restart(
    three_engines, redis_url, start_in_loop, tmp_path, tiny_model_dir
):
    a, b, c = three_engines
    workers = WorkerList([a.url])
    stack = start_local_stack(
        start_in_loop,
        redis_url,
        a.url,
        tmp_path,
        rollout_settings={
            "engine_discovery": {"source": "router", "list_url": workers.url, "interval_seconds": 0.2},
            "generate_timeout_seconds": 30,
            "request_timeout_seconds": 10,
        },
    )
    api = stack.api
    buffer = buffer_pb2_grpc.BufferStub(sync_channel(stack.addresses["buffer"]))
    rollout = rollout_pb2_grpc.RolloutStub(sync_channel(stack.addresses["rollout"]))

    def engines() -> dict[str, rollout_pb2.EngineInfo]:
        return {e.url: e for e in rollout.ListEngines(rollout_pb2.ListEnginesRequest(), timeout=30).engines}

    def until(condition, what: str) -> None:
        wait_for_run(api, run_id, lambda run: run["status"] not in ("running", "paused") or condition())
        assert condition(), what

    config = run_config(tmp_path, tiny_model_dir, num_rollouts=ROLLOUTS)
    config["max_outage_seconds"] = 120
    run_id = api.post("/runs", json=config).json()["id"]
    wait_for_run(api, run_id, lambda run: run["rollout_id"] >= 1)
    assert set(engines()) == {a.url}

    # b and c join while the run is held between iterations, on their base weights.
    joined_at = pause(api, run_id)["weight_version"]
    assert b.weight_version() == c.weight_version() == "default"
    workers.urls = [a.url, b.url, c.url]
    until(lambda: set(engines()) == {a.url, b.url, c.url}, "the rollout service did not find b and c")
    listed = engines()
    reply = rollout.ListEngines(rollout_pb2.ListEnginesRequest(), timeout=30)
    assert reply.discovery == f"router {workers.url}" and reply.discovery_error == ""
    assert [listed[e.url].state for e in (b, c)] == ["behind", "behind"]  # no generation on base weights
    resume(api, run_id)

    # Each generates once the next push reached it, and never on older weights.
    until(lambda: all(engines()[e.url].generate_requests for e in (b, c)), "b and c took no generation")
    pause(api, run_id)
    listed = engines()
    for e in (b, c):
        assert int(listed[e.url].first_answer_version) > joined_at, listed[e.url]
        assert e.weight_version() == a.weight_version(), "a joined engine holds the run's weights"
        assert listed[e.url].state == "serving"

    # c leaves the list (alive) while the run generates: after its last in-flight request it takes no more.
    resume(api, run_id)
    workers.urls = [a.url, b.url]
    until(
        lambda: (lambda r: c.url not in {e.url for e in [*r.engines, *r.leaving]})(
            rollout.ListEngines(rollout_pb2.ListEnginesRequest(), timeout=30)
        ),
        "c is still in the pool",
    )
    c_took = prompt_tokens(c)

    # b dies, then leaves the list: its requests are generated again on a.
    b.process.kill()
    b.process.wait(timeout=30)
    workers.urls = [a.url]
    run = wait_for_run(api, run_id)
    assert run["status"] == "completed", run["error"]
    assert run["rollout_id"] == ROLLOUTS and run["waiting_for"] == ""
    assert set(engines()) == {a.url}
    assert prompt_tokens(c) == c_took, "c took requests after it left the list"
    s = buffer.GetStats(buffer_pb2.GetStatsRequest(run_id=run_id))
    assert s.acknowledged_groups == 2 + ROLLOUTS * 2 and (s.queued_groups, s.leased_groups) == (0, 0)
    assert s.dead_letter_groups == 0


def pause(api, run_id: str) -> dict:
    assert api.post(f"/runs/{run_id}/pause").json()["status"] == "paused"
    run = wait_for_run(api, run_id, lambda run: run["held"] or run["status"] not in ("running", "paused"), timeout=120)
    assert run["status"] == "paused" and run["rollout_id"] < ROLLOUTS, (run["rollout_id"], run["error"])
    return run


def resume(api, run_id: str) -> None:
    assert api.post(f"/runs/{run_id}/resume").json()["status"] == "running"
