"""The three training modes through the REST API (every service real, on loopback): each
run completes, trains exactly the groups it acknowledged, never on samples older than its
staleness bound, reports its phases, and learns the demo task (`python -m bench.async`
measures how well and how fast, over several seeds)."""

from __future__ import annotations

import pytest

from rlmesh.cli.demo import demo_config, run_metrics, write_task
from rlmesh.common.grpc_server import sync_channel
from rlmesh.v1 import buffer_pb2, buffer_pb2_grpc
from tests.helpers.runs import assert_time_split, run_config
from tests.helpers.stack import start_local_stack, wait_for_run


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "bound"), [("sync", 0), ("one_step_off", 1), ("fully_async", 2)])
def test_each_mode_completes_within_its_staleness_bound(services, tmp_path, tiny_model_dir, mode, bound):
    api, buffer = services
    config = {**run_config(tmp_path, tiny_model_dir, num_rollouts=4), "mode": mode}
    config["rollout"]["partial_rollout"] = mode == "fully_async"
    r = api.post("/runs", json=config)
    assert r.status_code == 201, r.text
    run = wait_for_run(api, r.json()["id"])
    assert run["status"] == "completed", run["error"]
    rl = [m for m in run_metrics(api, run["id"]) if "iteration/seconds" in m]
    assert [m["rollout_id"] for m in rl] == [1, 2, 3, 4]
    assert all(m["train/samples"] == 6 for m in rl)  # a full batch every step
    assert max(m.get("train/staleness_max", 0.0) for m in rl) <= bound
    assert "eval/held_out/reward_mean" in run["eval_after"]
    if mode != "fully_async":
        assert all(m["phase/generate_seconds"] > 0 for m in rl)
    assert_time_split(rl)
    s = buffer.GetStats(buffer_pb2.GetStatsRequest(run_id=run["id"]))
    assert s.leased_groups == 0
    assert s.acknowledged_groups == 2 + 4 * 2  # the SFT batch and four RL batches
    if mode != "fully_async":  # (fully_async leaves what it generated past the last step queued)
        assert s.groups_written == s.acknowledged_groups and s.queued_groups == 0


@pytest.mark.slow
def test_fully_async_pushes_weights_in_the_background_beside_the_next_step(services, tmp_path, tiny_model_dir):
    """weight_sync.background: each push runs beside the next train step. The run completes
    within its staleness bound; each step's record carries the push the step before it
    started; an evaluation between steps and the run's end wait for the push under way."""
    api, _ = services
    config = {**run_config(tmp_path, tiny_model_dir, num_rollouts=4), "mode": "fully_async"}
    config["weight_sync"] = {"background": True}
    config["eval"]["interval"] = 2
    r = api.post("/runs", json=config)
    assert r.status_code == 201, r.text
    run = wait_for_run(api, r.json()["id"])
    assert run["status"] == "completed", run["error"]
    rl = [m for m in run_metrics(api, run["id"]) if "iteration/seconds" in m]
    assert [m["rollout_id"] for m in rl] == [1, 2, 3, 4]
    assert all(m["train/samples"] == 6 for m in rl)
    assert max(m.get("train/staleness_max", 0.0) for m in rl) <= 2
    assert all(m["weights/copy_seconds"] >= 0 for m in rl)
    pushed = [m["weights/version"] for m in rl[1:] if "weights/version" in m]
    assert len(pushed) == 3 and pushed == sorted(set(pushed))
    assert "eval/held_out/reward_mean" in rl[1] and "eval/held_out/reward_mean" in run["eval_after"]
    assert_time_split(rl)


def test_async_modes_need_a_staleness_bound_of_at_least_one(services, tmp_path, tiny_model_dir):
    api, _ = services
    r = api.post("/runs", json={**run_config(tmp_path, tiny_model_dir, 2), "mode": "fully_async", "max_staleness": 0})
    assert r.status_code == 422 and "max_staleness" in r.text
    r = api.post("/runs", json={**run_config(tmp_path, tiny_model_dir, 2), "mode": "sometimes"})
    assert r.status_code == 422 and "mode" in r.text


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "one_step_off", "fully_async"])
def test_over_sampling_the_dynamic_filter_and_partial_rollout_work_in_each_mode(
    redis_url, start_in_loop, engine_url, tmp_path, tiny_model_dir, mode
):
    stack = start_local_stack(
        start_in_loop,
        redis_url,
        engine_url,
        tmp_path,
        custom_functions={"parity": "tests.helpers.reward:first_char_parity"},
    )
    buffer = buffer_pb2_grpc.BufferStub(sync_channel(stack.addresses["buffer"]))
    config = {
        **run_config(tmp_path, tiny_model_dir, num_rollouts=3),
        "mode": mode,
        "reward": {"components": {"parity": 1.0}},
    }
    config["rollout"].update(group_filter="nonzero_std", over_sampling_groups=1, partial_rollout=True)
    r = stack.api.post("/runs", json=config)
    assert r.status_code == 201, r.text
    run = wait_for_run(stack.api, r.json()["id"])
    assert run["status"] == "completed", run["error"]
    rl = [m for m in run_metrics(stack.api, run["id"]) if "iteration/seconds" in m]
    assert [m["rollout_id"] for m in rl] == [1, 2, 3]
    assert all(m["train/samples"] == 6 for m in rl)  # a full batch of kept groups every step
    assert "eval/held_out/reward_mean" in run["eval_after"]

    s = buffer.GetStats(buffer_pb2.GetStatsRequest(run_id=run["id"]))
    assert s.leased_groups == 0 and s.acknowledged_groups == 2 + 3 * 2
    assert s.dropped_groups == s.dropped_by_reason.get("nonzero_std", 0)
    # Every RL group written has rewards that differ; the filter dropped the others.
    written = buffer.GetRecentGroups(buffer_pb2.GetRecentGroupsRequest(run_id=run["id"])).groups
    rl_groups = [g for g in written if len(g.samples) == 3]
    assert len(rl_groups) >= 3 * 2
    assert all(len({smp.reward for smp in g.samples}) > 1 for g in rl_groups)


@pytest.mark.slow
@pytest.mark.parametrize("pause_mode", ["in_place", "retract"])
def test_fully_async_keeps_requests_in_flight_across_weight_pushes(services, tmp_path, tiny_model_dir, pause_mode):
    api, buffer = services
    config = {**run_config(tmp_path, tiny_model_dir, num_rollouts=3), "mode": "fully_async", "pause_mode": pause_mode}
    config["rollout"]["sampling"] = {"max_new_tokens": 24, "ignore_eos": True}  # long enough to span a push
    r = api.post("/runs", json=config)
    assert r.status_code == 201, r.text
    run = wait_for_run(api, r.json()["id"])
    assert run["status"] == "completed", run["error"]
    rl = [m for m in run_metrics(api, run["id"]) if "iteration/seconds" in m]
    assert [m["rollout_id"] for m in rl] == [1, 2, 3] and all(m["train/samples"] == 6 for m in rl)
    assert max(m.get("train/staleness_max", 0.0) for m in rl) <= 2
    s = buffer.GetStats(buffer_pb2.GetStatsRequest(run_id=run["id"]))
    assert s.leased_groups == 0 and s.acknowledged_groups == 2 + 3 * 2


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "one_step_off", "fully_async"])
def test_each_mode_learns_the_demo_task(services, tmp_path, tiny_model_dir, mode):
    api, _ = services
    train, held_out = write_task(tmp_path)
    # 50 rollouts: at 30 a mode's held-out eval ended anywhere between 0.46 and 0.98 from
    # the same seed (the engine's batching makes runs differ), too close to the bar.
    config = demo_config(str(tiny_model_dir), train, held_out, rollouts=50).model_dump(mode="json")
    config.update(mode=mode, eval={**config["eval"], "interval": 0})
    # (each mode with the run config's defaults: the async modes' off-policy correction on)
    # Two seeds, and their mean against the bar: a single async run now and then learns
    # far less than the others (0.33 -> 0.46 once in a CI run; bench.async counts such
    # seeds, see benchmarks.md), and the claim is about what the mode learns, not one run.
    evals = []
    for seed in (0, 1):
        seeded = {**config, "seed": seed, "datasets": [{**d, "seed": seed} for d in config["datasets"]]}
        r = api.post("/runs", json=seeded)
        assert r.status_code == 201, r.text
        run = wait_for_run(api, r.json()["id"], timeout=600)
        assert run["status"] == "completed", run["error"]
        evals.append(tuple(run[k]["eval/held_out/reward_mean"] for k in ("eval_before", "eval_after")))
    before, after = (sum(e[i] for e in evals) / len(evals) for i in (0, 1))
    # (0.33 before; 0.86-1.00 after in 12 single runs of the three modes at 50 rollouts)
    assert after >= before + 0.2, (mode, evals)
