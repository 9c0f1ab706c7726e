"""A short run as a practitioner watches it: every service's Prometheus /metrics scraped
after the run, and the run's metric records in TensorBoard event files and an offline W&B
run, under the names the API shows."""

from __future__ import annotations

import pytest

from rlmesh.cli.demo import run_metrics
from tests.helpers.prometheus import scrape, value
from tests.helpers.run_logs import tensorboard_scalars, wandb_history
from tests.helpers.runs import run_config
from tests.helpers.stack import start_local_stack, wait_for_run


@pytest.mark.slow
def test_a_run_shows_in_prometheus_tensorboard_and_wandb(
    redis_url, start_in_loop, engine_url, tmp_path, tiny_model_dir
):
    log_dir = tmp_path / "run-logs"
    stack = start_local_stack(
        start_in_loop, redis_url, engine_url, tmp_path, metrics=True, coordinator_settings={"log_dir": log_dir}
    )
    config = run_config(tmp_path, tiny_model_dir, num_rollouts=2)
    config["logging"] = {"tensorboard": True, "wandb": {"project": "rlmesh-test", "mode": "offline"}}
    r = stack.api.post("/runs", json=config)
    assert r.status_code == 201, r.text
    run_id = r.json()["id"]
    run = wait_for_run(stack.api, run_id)
    assert run["status"] == "completed", run["error"]
    records = run_metrics(stack.api, run["id"])
    rl = [m for m in records if "train/loss" in m]

    # TensorBoard: every number of every record, under its name, at its iteration (or SFT step).
    scalars = tensorboard_scalars(log_dir / run_id / "tensorboard")
    assert [step for step, _ in scalars["train/loss"]] == [1, 2]
    assert [v for _, v in scalars["train/loss"]] == pytest.approx([m["train/loss"] for m in rl])
    for name in (
        "rollout/reward_mean",
        "weights/version",
        "iteration/seconds",
        "eval/held_out/reward_mean",
        "sft/loss",
    ):
        assert name in scalars, sorted(scalars)
    assert "time" not in scalars

    # W&B, offline: the same rows, the same names.
    (wandb_run,) = (log_dir / run_id / "wandb").glob(f"offline-run-*-{run_id}")
    history = wandb_history(wandb_run)
    logged = [row for row in history if "train/loss" in row]
    assert [row["rollout_id"] for row in logged] == [1, 2]
    assert [row["train/loss"] for row in logged] == pytest.approx([m["train/loss"] for m in rl])
    assert any("eval/held_out/reward_mean" in row for row in history)

    # Prometheus: each service's own view of the same run.
    coordinator = scrape(f"http://{stack.addresses['coordinator']}/metrics")
    assert value(coordinator, "rlmesh_coordinator_iterations_total", mode="sync") == 2
    assert value(coordinator, "rlmesh_coordinator_iteration_seconds_count", mode="sync") == 2
    assert value(coordinator, "rlmesh_coordinator_runs", status="completed") == 1
    assert value(coordinator, "rlmesh_coordinator_runs", status="running") == 0
    assert value(coordinator, "rlmesh_coordinator_http_requests_total", method="POST", route="/runs", status="201") == 1
    assert value(coordinator, "rlmesh_coordinator_http_requests_total", route="/runs/{run_id}") >= 1
    assert value(coordinator, "rlmesh_coordinator_run_log_failures_total") == 0

    trainer = scrape(stack.metrics_urls["trainer"])
    assert value(trainer, "rlmesh_trainer_step_seconds_count", loss="rl") == 2
    assert value(trainer, "rlmesh_trainer_step_seconds_count", loss="sft") == 1
    assert value(trainer, "rlmesh_trainer_step_seconds_sum") > 0
    assert value(trainer, "grpc_server_handled_total", grpc_method="TrainStep", grpc_code="OK") == 3

    rollout = scrape(stack.metrics_urls["rollout"])
    assert value(rollout, "rlmesh_rollout_generated_tokens_total") > 0
    assert value(rollout, "rlmesh_rollout_engine_requests_in_flight") == 0
    assert value(rollout, "rlmesh_rollout_engine_requests_total", outcome="ok") > 0

    buffer = scrape(stack.metrics_urls["buffer"])
    # 1 SFT step and 2 rollouts of 2 groups, all acknowledged, none left
    assert value(buffer, "rlmesh_buffer_acknowledged_groups_total", run=run_id) == 6
    assert value(buffer, "rlmesh_buffer_queued_groups", run=run_id) == 0

    reward = scrape(stack.metrics_urls["reward"])
    assert (
        value(reward, "rlmesh_reward_samples_scored_total") + value(reward, "rlmesh_reward_sample_failures_total") > 0
    )
    assert value(reward, "grpc_server_handled_total", grpc_service="rlmesh.v1.Reward", grpc_code="OK") > 0

    engine = scrape(f"{engine_url}/metrics", headers={})  # open, like SGLang's
    assert value(engine, "sglang:generation_tokens_total") >= value(rollout, "rlmesh_rollout_generated_tokens_total")
    assert value(engine, "sglang:num_running_reqs") == 0 and value(engine, "sglang:num_queue_reqs") == 0
