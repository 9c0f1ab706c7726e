"""Prometheus /metrics of the services, scraped for real after real calls: the gRPC server
metrics every service gets (counts per method, errors by status code, latency histograms),
each service's own metrics, the token the endpoint asks for, and bounded labels."""

from __future__ import annotations

import grpc
import httpx

from rlmesh.common import auth
from rlmesh.common.grpc_server import sync_channel
from rlmesh.common.net import free_port
from rlmesh.common.sample import Sample, Status, sample_from_proto, sample_to_proto
from rlmesh.coordinator.app import start as start_coordinator
from rlmesh.coordinator.config import Settings as CoordinatorSettings
from rlmesh.reward.config import Settings as RewardSettings
from rlmesh.reward.scoring import FAILURE_CAUSES
from rlmesh.reward.server import start as start_reward
from rlmesh.v1 import buffer_pb2, buffer_pb2_grpc, reward_pb2, reward_pb2_grpc
from tests.helpers.buffer import code_of, completed, create, prompts, put
from tests.helpers.prometheus import label_values, scrape, value
from tests.helpers.reward import CUSTOM, GROUP, make_sample

BUFFER = "rlmesh.v1.Buffer"


def test_grpc_calls_are_counted_per_method_and_status_code_and_timed(buffer, dataset):
    port = free_port()
    stub = buffer(metrics_port=port)
    url = f"http://127.0.0.1:{port}/metrics"
    create(stub, dataset)
    put(stub, [completed(g) for g in prompts(stub, 2)])
    for _ in range(3):
        stub.GetStats(buffer_pb2.GetStatsRequest(run_id="r1"))
    code, _ = code_of(lambda: stub.GetStats(buffer_pb2.GetStatsRequest(run_id="nope")))
    assert code == grpc.StatusCode.NOT_FOUND
    code, _ = code_of(lambda: stub.GetStats(buffer_pb2.GetStatsRequest(run_id="a:b")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT

    samples = scrape(url)
    method = {"grpc_service": BUFFER, "grpc_method": "GetStats", "grpc_type": "unary"}
    assert value(samples, "grpc_server_started_total", **method) == 5
    assert value(samples, "grpc_server_handled_total", **method, grpc_code="OK") == 3
    assert value(samples, "grpc_server_handled_total", **method, grpc_code="NOT_FOUND") == 1
    assert value(samples, "grpc_server_handled_total", **method, grpc_code="INVALID_ARGUMENT") == 1
    assert value(samples, "grpc_server_handling_seconds_count", **method) == 5
    assert value(samples, "grpc_server_handling_seconds_bucket", **method, le="+Inf") == 5
    assert value(samples, "grpc_server_handling_seconds_sum", **method) > 0
    for name in ("CreateRun", "GetPrompts", "PutGroups"):
        assert value(samples, "grpc_server_handled_total", grpc_method=name, grpc_code="OK") == 1
    # The buffer's own: depths per run, as the store counts them.
    assert value(samples, "rlmesh_buffer_queued_groups", run="r1") == 2
    assert value(samples, "rlmesh_buffer_leased_groups", run="r1") == 0
    assert value(samples, "rlmesh_buffer_dead_letter_groups", run="r1") == 0
    assert value(samples, "process_resident_memory_bytes") > 0


def test_refused_and_unknown_calls_are_counted_without_new_labels(buffer, dataset):
    port, grpc_port = free_port(), free_port()
    buffer(port=grpc_port, metrics_port=port)
    address = f"127.0.0.1:{grpc_port}"
    # No token: refused with UNAUTHENTICATED, and counted as such.
    bare = grpc.insecure_channel(address)
    code, _ = code_of(lambda: buffer_pb2_grpc.BufferStub(bare).GetStats(buffer_pb2.GetStatsRequest(run_id="r1")))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    # Methods the server does not have: each a new name, all counted under one "unknown" label.
    for i in range(5):
        call = sync_channel(address).unary_unary(f"/made.up.Service{i}/Method{i}")
        code, _ = code_of(lambda call=call: call(b""))
        assert code == grpc.StatusCode.UNIMPLEMENTED
    samples = scrape(f"http://127.0.0.1:{port}/metrics")
    assert value(samples, "grpc_server_handled_total", grpc_method="GetStats", grpc_code="UNAUTHENTICATED") == 1
    assert value(samples, "grpc_server_handled_total", grpc_service="unknown", grpc_code="UNIMPLEMENTED") == 5
    assert label_values(samples, "grpc_server_started_total", "grpc_service") <= {
        BUFFER,
        "unknown",
        "grpc.health.v1.Health",
    }


def test_metrics_endpoint_needs_the_stacks_token(buffer):
    port = free_port()
    buffer(metrics_port=port)
    url = f"http://127.0.0.1:{port}/metrics"
    refused = httpx.get(url)
    assert refused.status_code == 401 and "credentials_file" in refused.text
    assert httpx.get(url, headers={"authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(url, headers=auth.client_headers()).status_code == 200
    assert httpx.get(f"http://127.0.0.1:{port}/", headers=auth.client_headers()).status_code == 404


def test_metrics_endpoint_is_off_by_default_and_on_loopback():
    from rlmesh.buffer.config import Settings

    settings = Settings()
    assert settings.metrics_port == 0 and settings.metrics_host == "127.0.0.1"


def test_reward_failures_are_counted_by_reason(loop_thread):
    port = free_port()
    settings = RewardSettings(
        port=0, metrics_port=port, default_components={"math": 1.0}, custom_functions=CUSTOM, group_functions=GROUP
    )
    server, grpc_port = loop_thread.run(start_reward(settings))
    try:
        stub = reward_pb2_grpc.RewardStub(sync_channel(f"127.0.0.1:{grpc_port}"))

        def score(components: dict[str, float], *samples: Sample) -> list[Sample]:
            reply = stub.Score(
                reward_pb2.ScoreRequest(
                    samples=[sample_to_proto(s) for s in samples], spec=reward_pb2.RewardSpec(components=components)
                ),
                timeout=30,
            )
            return [sample_from_proto(m) for m in reply.samples]

        ok = make_sample(0, r"\boxed{2}", "2")
        assert [s.status for s in score({"math": 1.0}, ok, make_sample(1, "x", ""))] == [
            Status.COMPLETED,
            Status.FAILED,
        ]
        assert score({"broken": 1.0}, ok, ok)[0].status == Status.FAILED  # raises
        assert score({"not_a_number": 1.0}, ok)[0].status == Status.FAILED  # returns "yes"
        samples = scrape(f"http://127.0.0.1:{port}/metrics")
    finally:
        loop_thread.run(server.stop(None))
    assert value(samples, "rlmesh_reward_samples_scored_total") == 1
    assert value(samples, "rlmesh_reward_sample_failures_total", reason="raised") == 3  # no label (math), broken x2
    assert value(samples, "rlmesh_reward_sample_failures_total", reason="invalid_value") == 1
    assert label_values(samples, "rlmesh_reward_sample_failures_total", "reason") <= set(FAILURE_CAUSES)
    assert (
        value(
            samples, "grpc_server_handled_total", grpc_service="rlmesh.v1.Reward", grpc_method="Score", grpc_code="OK"
        )
        == 3
    )


def test_coordinator_counts_rest_requests_by_route_and_runs_by_status(start_in_loop, redis_url, silent_address):
    _, port = start_in_loop(
        lambda: start_coordinator(
            CoordinatorSettings(
                port=0,
                redis_url=redis_url,
                buffer_address=silent_address,
                rollout_address=silent_address,
                reward_address=silent_address,
                trainer_address=silent_address,
            )
        )
    )
    base = f"http://127.0.0.1:{port}"
    with httpx.Client(base_url=base, timeout=30, headers=auth.client_headers()) as api:
        body = {"model_path": "/models/m", "datasets": [{"name": "d", "path": "d.jsonl"}]}
        assert api.post("/runs", json=body).status_code == 201  # it waits on the silent services: stays active
        for run_id in ("nope1", "nope2"):
            assert api.get(f"/runs/{run_id}").status_code == 404
        assert api.get("/made/up/path").status_code == 404
    assert httpx.get(f"{base}/metrics").status_code == 401  # the stack's token, as every route
    samples = scrape(f"{base}/metrics")
    requests = "rlmesh_coordinator_http_requests_total"
    assert value(samples, requests, method="POST", route="/runs", status="201") == 1
    assert value(samples, requests, method="GET", route="/runs/{run_id}", status="404") == 2  # one label for all ids
    assert value(samples, requests, route="unmatched", status="404") == 1
    assert value(samples, requests, route="unmatched", status="401") == 1  # refused before routing
    assert value(samples, "rlmesh_coordinator_http_request_seconds_count", method="POST", route="/runs") == 1
    assert (
        value(samples, "rlmesh_coordinator_runs", status="pending")
        + value(samples, "rlmesh_coordinator_runs", status="running")
        == 1
    )
    assert value(samples, "rlmesh_coordinator_runs", status="completed") == 0
