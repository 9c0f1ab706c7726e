"""End to end through the REST API: every service real and on loopback (the engine in its
own process), a real Redis, a real gloo weight group."""

from __future__ import annotations

import time

import grpc
import pytest
from transformers import AutoModelForCausalLM

from rlmesh.cli.demo import run_metrics
from rlmesh.common.faults import FAULTS_DIR_ENV
from rlmesh.common.grpc_server import sync_channel
from rlmesh.common.model_building import build_hf_model
from rlmesh.common.run_config import TrainerRunConfig
from rlmesh.v1 import buffer_pb2, trainer_pb2
from rlmesh.v1.trainer_pb2_grpc import TrainerStub
from tests.helpers.chaos import eventually
from tests.helpers.runs import run_config
from tests.helpers.stack import start_local_stack, wait_for_run


def assert_final_model(api, run: dict, tmp_path, step: int | None) -> None:
    """The run (completed or stopped, with checkpoints left at their defaults) names its final
    model relative to the trainer's work_dir, and transformers loads it; it is listed too."""
    assert run["final_model"] == f"{run['id']}/checkpoints/final"
    model = build_hf_model(AutoModelForCausalLM.from_pretrained, tmp_path / "trainer" / run["final_model"])
    assert model.config.vocab_size > 0
    listed = api.get(f"/runs/{run['id']}/checkpoints").json()
    finals = [c["step"] for c in listed if c["final"]]
    assert len(finals) == 1 and (step is None or finals[0] == step)
    # Listed as final_model is named: relative to the trainer's work_dir, no server directory.
    assert [c["path"] for c in listed if c["final"]] == [run["final_model"]]
    assert not any(c["path"].startswith("/") for c in listed)


@pytest.mark.slow
def test_run_completes_and_trains_every_group_exactly_once(services, tmp_path, tiny_model_dir):
    api, buffer = services
    r = api.post("/runs", json=run_config(tmp_path, tiny_model_dir, num_rollouts=3))
    assert r.status_code == 201, r.text
    run_id = r.json()["id"]
    run = wait_for_run(api, run_id)
    assert run["status"] == "completed", run["error"]
    assert run["rollout_id"] == 3 and run["phase"] == "done"
    assert "eval/held_out/reward_mean" in run["eval_before"] and "eval/held_out/reward_mean" in run["eval_after"]
    rl = [m for m in run_metrics(api, run["id"]) if "rollout/reward_mean" in m]
    assert [m["rollout_id"] for m in rl] == [1, 2, 3]
    # initial push + one after the warm start + one per rollout; the engine reports the last
    assert run["weight_version"] == 5
    assert all("train/loss" in m for m in rl)

    stats = buffer.GetStats(buffer_pb2.GetStatsRequest(run_id=run_id))
    # 1 SFT step x 2 groups + 3 rollouts x 2 groups, each written once and acknowledged once
    assert stats.groups_written == stats.acknowledged_groups == 8
    assert (stats.queued_groups, stats.leased_groups, stats.redelivered_groups) == (0, 0, 0)
    assert [s["id"] for s in api.get("/runs").json()] == [run_id]
    # eval records each reward component beside the weighted total
    assert run["eval_after"]["eval/held_out/reward/exact_match_mean"] == run["eval_after"]["eval/held_out/reward_mean"]
    assert_final_model(api, run, tmp_path, step=4)  # 1 SFT step + 3 RL steps


@pytest.mark.slow
def test_a_run_can_be_stopped_and_deleted(services, tmp_path, tiny_model_dir):
    api, buffer = services
    run_id = api.post("/runs", json=run_config(tmp_path, tiny_model_dir, num_rollouts=1000)).json()["id"]
    wait_for_run(api, run_id, lambda run: run["status"] == "running")
    # one run trains at a time (the next one waits in the queue), and an active run is not deleted
    queued = api.post("/runs", json=run_config(tmp_path, tiny_model_dir, num_rollouts=1)).json()
    assert (queued["status"], queued["queue_position"]) == ("queued", 1)
    assert api.delete(f"/runs/{run_id}").status_code == 409
    assert api.post(f"/runs/{run_id}/stop").json()["status"] == "stopping"
    run = wait_for_run(api, run_id)
    assert run["status"] == "stopped" and run["rollout_id"] < 1000
    assert_final_model(api, run, tmp_path, step=None)
    assert api.delete(f"/runs/{run_id}").json() == {"id": run_id, "deleted": True}
    assert api.get(f"/runs/{run_id}").status_code == 404
    with pytest.raises(grpc.RpcError) as e:  # its samples and prompts are gone from the buffer too
        buffer.GetStats(buffer_pb2.GetStatsRequest(run_id=run_id), timeout=10)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    # the queued run started once the stopped one had ended
    assert wait_for_run(api, queued["id"])["status"] == "completed"


@pytest.mark.slow
def test_bad_requests_get_clear_http_errors(services, tmp_path, tiny_model_dir):
    api, _ = services
    bad = run_config(tmp_path, tiny_model_dir, num_rollouts=1)
    bad["rollout"]["n_samples_per_prompt"] = 0
    r = api.post("/runs", json=bad)
    assert r.status_code == 422
    assert any(e["loc"][-2:] == ["rollout", "n_samples_per_prompt"] for e in r.json()["detail"])
    r = api.get("/runs/nope")
    assert r.status_code == 404 and "nope" in r.json()["detail"]
    assert api.post("/runs/nope/stop").status_code == 404
    assert api.get("/docs").status_code == 200


@pytest.mark.slow
def test_reward_services_are_registered_through_the_rest_api(services):
    api, _ = services
    assert api.get("/reward-services").json() == []
    r = api.post("/reward-services", json={"name": "judge", "url": "ftp://example.invalid/score"})
    assert r.status_code == 400 and "ftp" in r.json()["detail"]
    r = api.post("/reward-services", json={"name": "judge", "url": "http://127.0.0.1:9/score", "timeout_seconds": 0.5})
    assert r.status_code == 409 and r.json()["code"] == "FAILED_PRECONDITION"
    assert api.delete("/reward-services/judge").json() == {"removed": False}
    stats = api.get("/reward-services/stats")
    assert stats.status_code == 200 and isinstance(stats.json()["samples_scored"], int)  # (not proto3's "0")


@pytest.mark.slow
def test_a_trainer_still_holding_a_run_that_ended_lets_it_go_for_the_next(
    redis_url, start_in_loop, engine_url, tmp_path, tiny_model_dir
):
    # What a coordinator killed between a run's final status and its EndRun (or an EndRun that
    # failed) leaves behind: the trainer holds a run that is over (every later InitRun was
    # refused with "already holds run ...", so every later run failed).
    stack = start_local_stack(start_in_loop, redis_url, engine_url, tmp_path)
    trainer = TrainerStub(sync_channel(stack.addresses["trainer"]))
    config = TrainerRunConfig(model_path=str(tiny_model_dir), device="cpu")
    trainer.InitRun(trainer_pb2.InitRunRequest(run_id="ended", config_json=config.model_dump_json()))
    assert trainer.GetStatus(trainer_pb2.GetStatusRequest(held_run=True)).run_id == "ended"

    run_id = stack.api.post("/runs", json=run_config(tmp_path, tiny_model_dir, num_rollouts=1)).json()["id"]
    run = wait_for_run(stack.api, run_id)
    assert run["status"] == "completed", run["error"]
    assert trainer.GetStatus(trainer_pb2.GetStatusRequest(held_run=True)).run_id == ""  # (the run has ended on it too)


@pytest.mark.slow
def test_an_evaluation_of_a_whole_dataset_has_a_deadline_for_its_size(
    redis_url, start_in_loop, engine_url, tmp_path, tiny_model_dir
):
    # eval.limit 0 evaluates every row; its deadline used to be the base alone, whatever the
    # dataset's size, so a long evaluation was cut and retried until the run failed.
    stack = start_local_stack(
        start_in_loop, redis_url, engine_url, tmp_path,
        coordinator_settings={"work_deadline_seconds": 0.001, "per_group_deadline_seconds": 10},
    )  # fmt: skip
    config = run_config(tmp_path, tiny_model_dir, num_rollouts=1)
    config.update(max_outage_seconds=10, eval={**config["eval"], "limit": 0})
    run = wait_for_run(stack.api, stack.api.post("/runs", json=config).json()["id"])
    assert run["status"] == "completed", run["error"]
    assert "eval/held_out/reward_mean" in run["eval_before"] and "eval/held_out/reward_mean" in run["eval_after"]


@pytest.mark.slow
def test_a_train_step_whose_answer_was_lost_is_not_taken_again(
    redis_url, start_in_loop, engine_url, tmp_path, tiny_model_dir, monkeypatch
):
    """fully_async: the trainer's first step outlives the coordinator's deadline for it (held
    before its acknowledgment), so the coordinator never gets its answer. Before, the retry
    found the buffer holding groups (the next batch: in fully_async it always does) and trained
    a second batch for the same iteration; now it finds the trainer past the step it stood at,
    and the run ends with one optimizer step per iteration."""
    faults = tmp_path / "faults"
    faults.mkdir()
    monkeypatch.setenv(FAULTS_DIR_ENV, str(faults))
    stack = start_local_stack(
        start_in_loop, redis_url, engine_url, tmp_path,
        coordinator_settings={"work_deadline_seconds": 0.001, "per_group_deadline_seconds": 2},
    )  # fmt: skip
    config = run_config(tmp_path, tiny_model_dir, num_rollouts=2)
    config.update(mode="fully_async", max_outage_seconds=120, sft_warmup={"steps": 0})
    hold = faults / "trainer.before_ack.hold"
    hold.touch()
    run_id = stack.api.post("/runs", json=config).json()["id"]
    try:
        eventually(lambda: (faults / "trainer.before_ack.reached").exists(), "the first step trained", timeout=120)
        time.sleep(5 + 2 * 2 + 3)  # (past the TrainStep's deadline: a 5 s wait for the batch, 2 s a group)
    finally:
        hold.unlink()
    run = wait_for_run(stack.api, run_id)
    assert run["status"] == "completed", run["error"]
    assert_final_model(stack.api, run, tmp_path, step=2)
