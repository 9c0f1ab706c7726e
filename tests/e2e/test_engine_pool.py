"""A dead engine leaves the pool and rejoins when healthy: a run on two engines (each its
own process, real weight pushes over gloo) goes on when one is SIGKILLed, pushes weights
to the one left, takes the restarted one back (it first receives the trainer's weights),
and completes on it alone once the other is killed too."""

from __future__ import annotations

import pytest

from rlmesh.common.grpc_server import sync_channel
from rlmesh.v1 import buffer_pb2, buffer_pb2_grpc
from tests.helpers.runs import run_config
from tests.helpers.stack import start_local_stack, wait_for_run
from tests.helpers.trainer import EngineProcess

# Room for the restarted engine to rejoin (at a push after the rollout service finds it healthy)
# and for a pause after that, before the run ends: with 10, a loaded CI machine once ended the
# run first.
ROLLOUTS = 20


@pytest.fixture
def two_engines(tiny_model_dir, tmp_path):
    engines = [EngineProcess(tiny_model_dir, tmp_path / f"engine-{name}.log") for name in "ab"]
    yield engines
    for engine in engines:
        if engine.process.poll() is None:
            engine.stop()


def kill(engine: EngineProcess) -> None:
    engine.process.kill()
    engine.process.wait(timeout=30)


@pytest.mark.slow
def test_a_run_goes_on_while_an_engine_is_dead_and_takes_it_back_when_it_returns(
    two_engines, redis_url, start_in_loop, tmp_path, tiny_model_dir
):
    a, b = two_engines
    stack = start_local_stack(
        start_in_loop,
        redis_url,
        a.url,
        tmp_path,
        rollout_settings={"engine_urls": [a.url, b.url], "generate_timeout_seconds": 30, "request_timeout_seconds": 10},
    )
    api, buffer = stack.api, buffer_pb2_grpc.BufferStub(sync_channel(stack.addresses["buffer"]))
    config = run_config(tmp_path, tiny_model_dir, num_rollouts=ROLLOUTS)
    config["max_outage_seconds"] = 120
    run_id = api.post("/runs", json=config).json()["id"]

    wait_for_run(api, run_id, lambda run: run["rollout_id"] >= 1)
    kill(b)
    # Training goes on without it: generation on a, weights pushed to a alone.
    run = wait_for_run(api, run_id, lambda run: run["rollout_id"] >= 2 or run["status"] != "running")
    assert run["status"] == "running", run["error"]
    assert a.weight_version() not in ("default", "0")

    pause(api, run_id)  # (pauses keep the run going long enough for what follows)
    b.start()  # on its port again, on its base weights
    assert b.weight_version() == "default"
    resume(api, run_id)
    # It rejoins at the next weight push: the same weights as a.
    run = wait_for_run(api, run_id, lambda run: run["status"] != "running" or b.weight_version() == a.weight_version())
    assert run["status"] == "running", (run["rollout_id"], run["error"])

    # Back in the rotation: with a gone for good, b alone finishes the run.
    pause(api, run_id)
    rejoined_at = int(b.weight_version())
    kill(a)
    resume(api, run_id)
    run = wait_for_run(api, run_id)
    assert run["status"] == "completed", run["error"]
    assert run["rollout_id"] == ROLLOUTS and run["waiting_for"] == ""
    assert int(b.weight_version()) > rejoined_at  # b alone took the pushes after a died
    s = buffer.GetStats(buffer_pb2.GetStatsRequest(run_id=run_id))
    assert s.acknowledged_groups == 2 + ROLLOUTS * 2 and (s.queued_groups, s.leased_groups) == (0, 0)


def pause(api, run_id: str) -> None:
    assert api.post(f"/runs/{run_id}/pause").json()["status"] == "paused"
    run = wait_for_run(api, run_id, lambda run: run["held"] or run["status"] not in ("running", "paused"), timeout=120)
    assert run["status"] == "paused" and run["rollout_id"] < ROLLOUTS, (run["rollout_id"], run["error"])


def resume(api, run_id: str) -> None:
    assert api.post(f"/runs/{run_id}/resume").json()["status"] == "running"
