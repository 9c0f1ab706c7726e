"""The example reward service (examples/reward_service/app.py), end to end: started on
loopback, registered by URL with the reward service, and named in a run's reward
components; the run's rewards come from it. Then the same with the service dying
mid-run: its samples fail with the reason, and the run still completes."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import httpx
import pytest

from rlmesh.cli.demo import run_metrics
from rlmesh.common.grpc_server import sync_channel
from rlmesh.v1 import reward_pb2, reward_pb2_grpc
from tests.helpers.stack import start_local_stack, wait_for_run

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "reward_service" / "app.py"


def load_example():
    spec = importlib.util.spec_from_file_location("rlmesh_example_reward_service", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a fresh copy per test: its counter starts at 0
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def stack(redis_url, start_in_loop, engine_url, tmp_path):
    local = start_local_stack(
        start_in_loop,
        redis_url,
        engine_url,
        tmp_path,
        remote_timeout_seconds=5,
        remote_backoff_seconds=0.01,
        breaker_failure_threshold=2,
        breaker_cooldown_seconds=60,
    )
    example = load_example()
    judge_server, judge_port = start_in_loop(lambda: example.start())
    return (
        local.api,
        reward_pb2_grpc.RewardStub(sync_channel(local.addresses["reward"])),
        f"http://127.0.0.1:{judge_port}",
        judge_server,
    )


def run_config(tmp_path: Path, model_dir: Path, num_rollouts: int, components: dict[str, float]) -> dict:
    rows = [{"prompt": f"rev {a}{b}=", "label": f"{b}{a}"} for a in "abcd" for b in "abcd"]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {
        "model_path": str(model_dir),
        "datasets": [{"name": "train", "path": str(tmp_path / "train.jsonl")}],
        "num_rollouts": num_rollouts,
        "rollout": {"rollout_batch_size": 2, "n_samples_per_prompt": 3, "sampling": {"max_new_tokens": 4}},
        "reward": {"components": components},
        "optimizer": {"lr": 1e-3},
    }


def finished(run: dict) -> bool:
    return run["status"] in ("completed", "failed", "stopped")


def judge_stats(reward) -> reward_pb2.RemoteServiceStats:
    return next(
        s for s in reward.GetStats(reward_pb2.GetRewardStatsRequest(), timeout=10).services if s.name == "judge"
    )


@pytest.mark.slow
def test_a_run_rewarded_by_a_service_registered_by_url(stack, tmp_path, tiny_model_dir):
    api, reward, judge_url, _ = stack
    reward.RegisterService(
        reward_pb2.RegisterServiceRequest(service=reward_pb2.RemoteService(name="judge", url=f"{judge_url}/score")),
        timeout=30,
    )

    components = {"judge/exact": 1.0, "judge/similarity": 0.5}
    r = api.post("/runs", json=run_config(tmp_path, tiny_model_dir, 2, components))
    assert r.status_code == 201, r.text
    run = wait_for_run(api, r.json()["id"], finished)
    assert run["status"] == "completed", run["error"]
    rollouts = [m for m in run_metrics(api, run["id"]) if "rollout/reward_mean" in m]
    assert [m["rollout_id"] for m in rollouts] == [1, 2]
    assert all(m["rollout/failed_ratio"] == 0.0 for m in rollouts)

    stats = judge_stats(reward)
    assert stats.samples_scored == 2 * 2 * 3 and stats.samples_failed == 0 and stats.failures == 0
    assert stats.calls >= 2 and stats.breaker_state == "closed"
    assert httpx.get(f"{judge_url}/stats").json()["samples_scored"] == 2 * 2 * 3 + 1  # + the registration probe


@pytest.mark.slow
def test_the_run_goes_on_when_the_service_dies(stack, tmp_path, tiny_model_dir, loop_thread):
    api, reward, judge_url, judge_server = stack
    reward.RegisterService(
        reward_pb2.RegisterServiceRequest(service=reward_pb2.RemoteService(name="judge", url=f"{judge_url}/score")),
        timeout=30,
    )

    config = run_config(tmp_path, tiny_model_dir, 8, {"judge/similarity": 1.0, "exact_match": 0.1})
    run_id = api.post("/runs", json=config).json()["id"]
    wait_for_run(api, run_id, lambda run: finished(run) or any("rollout/reward_mean" in m for m in run["metrics"]))
    judge_server.should_exit = True  # the reward service dies after the first rollout
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # wait until it is really gone
        try:
            httpx.get(f"{judge_url}/stats", timeout=1)
        except httpx.HTTPError:
            break
        time.sleep(0.05)
    run = wait_for_run(api, run_id, finished)
    assert run["status"] == "completed", run["error"]
    rollouts = [m for m in run_metrics(api, run["id"]) if "rollout/failed_ratio" in m]
    assert len(rollouts) == 8 and rollouts[0]["rollout/failed_ratio"] == 0.0
    assert rollouts[-1]["rollout/failed_ratio"] == 1.0 and rollouts[-1]["rollout/failed/reward"] == 6.0
    assert rollouts[-1]["train/failed_count"] == 6.0  # never scored 0 silently: left out of training

    stats = judge_stats(reward)
    assert stats.samples_failed >= 6 and stats.breaker_state == "open"
    assert "cannot connect" in stats.last_error
