"""A peer that stays down: the run shows `waiting for <service>` in GET /runs/{id} while
its calls are retried, and fails only when the run's outage budget (max_outage_seconds)
is spent, with a message that names the service. (Peers that come back within the budget:
test_crashes.py, test_chaos.py, test_engine_pool.py.)"""

from __future__ import annotations

import pytest

from rlmesh.common.net import free_port
from tests.helpers.runs import run_config
from tests.helpers.stack import FINAL, start_local_stack, wait_for_run


@pytest.mark.slow
def test_a_run_waits_for_engines_that_stay_down_then_fails_naming_them(
    redis_url, start_in_loop, tmp_path, tiny_model_dir
):
    dead_engine = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    stack = start_local_stack(
        start_in_loop,
        redis_url,
        dead_engine,
        tmp_path,
        rollout_settings={
            "tokenizer_path": str(tiny_model_dir),
            "peer_outage_seconds": 1,
            "request_timeout_seconds": 2,
        },
    )
    config = {**run_config(tmp_path, tiny_model_dir, num_rollouts=2), "max_outage_seconds": 6}
    r = stack.api.post("/runs", json=config)
    assert r.status_code == 201, r.text
    run_id = r.json()["id"]

    waiting = wait_for_run(stack.api, run_id, lambda run: run["waiting_for"] != "" or run["status"] in FINAL)
    assert waiting["status"] in ("pending", "running"), waiting["error"]
    # e.g. "waiting for trainer at ...: UNAVAILABLE: engines not answering, weights not pushed: <url>"
    assert waiting["waiting_for"].startswith("waiting for ")
    assert "engines not answering" in waiting["waiting_for"] and dead_engine in waiting["waiting_for"]

    run = wait_for_run(stack.api, run_id)
    assert run["status"] == "failed"
    assert "did not recover within the outage budget of 6 s" in run["error"]
    assert "engines not answering" in run["error"] and dead_engine in run["error"]
