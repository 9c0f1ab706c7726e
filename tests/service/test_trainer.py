"""The trainer: TorchBackend on the tiny model, the Trainer's run logic, its gRPC face,
and weight pushes through the real rollout service to the CPU reference engine over a
real gloo group."""

from __future__ import annotations

import asyncio
import json
import math
import time
from pathlib import Path

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from rlmesh.common import errors
from rlmesh.common.faults import FAULTS_DIR_ENV
from rlmesh.common.model_building import build_hf_model
from rlmesh.common.net import free_port
from rlmesh.common.run_config import WeightSyncConfig
from rlmesh.common.sample import ConversionError, SampleGroup, Status
from rlmesh.rollout.config import Settings as RolloutSettings
from rlmesh.rollout.server import start as start_rollout
from rlmesh.trainer.backend import TorchBackend
from rlmesh.trainer.config import Settings
from rlmesh.trainer.results import parse_run_config
from rlmesh.trainer.trainer import Trainer
from rlmesh.trainer.weight_sync import WeightPusher, plan_buckets
from rlmesh.v1 import buffer_pb2, trainer_pb2
from tests.helpers.chaos import eventually
from tests.helpers.trainer import (
    CPU,
    assert_engine_has,
    config,
    fill_buffer,
    independent_log_probs,
    make_groups,
    sample,
)

# ------------------------------------------------------------------ helpers


def params(backend: TorchBackend) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in backend.state_dict_for_sync()}


# ------------------------------------------------------------------ backend


def test_first_step_has_ratio_one_and_matches_independent_log_probs(tiny_model_dir):
    backend = TorchBackend(config(tiny_model_dir, algorithm={"tis_cap": 2.0}), CPU)
    groups = make_groups()
    model = build_hf_model(AutoModelForCausalLM.from_pretrained, tiny_model_dir).eval()
    for g in groups:
        for s in g.samples:
            s.rollout_log_probs = independent_log_probs(model, s)
    before = params(backend)

    m = backend.train_step(groups)

    # Padded micro-batches score every response token exactly like an unpadded forward.
    assert m["train_rollout_logprob_abs_diff"] < 1e-5
    assert m["tis_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    # "old" is the policy before the step: ratio 1, nothing clipped, no KL.
    assert m["clip_frac"] == 0.0 and m["approx_kl"] == pytest.approx(0.0, abs=1e-7)
    assert m["samples"] == 5 and m["failed_count"] == 1 and m["truncated_fraction"] == pytest.approx(0.2)
    assert m["reward_mean"] == pytest.approx(2.5 / 5)
    assert m["response_length_mean"] == pytest.approx((4 + 2 + 5 + 2 + 3) / 5)
    assert m["trained_tokens"] == 16 and m["optimizer_steps"] == 1 and backend.step == 1
    assert m["grad_norm"] > 0 and m["entropy"] > 0 and m["lr"] == pytest.approx(1e-3)
    assert any(not torch.equal(before[n], t) for n, t in params(backend).items())


def test_policy_moves_towards_the_rewarded_response(tiny_model_dir):
    backend = TorchBackend(config(tiny_model_dir, optimizer={"lr": 3e-3}), CPU)
    good = sample(0, [5, 6, 7], [40, 41, 42], 1.0)
    bad = sample(1, [5, 6, 7], [50, 51, 52], 0.0)
    model = backend.policy

    def margin() -> float:
        return sum(independent_log_probs(model, good)) - sum(independent_log_probs(model, bad))

    start = margin()
    for _ in range(5):
        backend.train_step([SampleGroup("g", 0, [good, bad])])
    assert margin() > start + 1.0


def test_micro_batching_does_not_change_the_gradient(tiny_model_dir):
    results = []
    for micro in (1, 4):
        for aggregation in ("seq_mean_token_mean", "token_mean"):
            backend = TorchBackend(
                config(tiny_model_dir, micro_batch_size=micro, algorithm={"loss_aggregation": aggregation}), CPU
            )
            m = backend.train_step(make_groups())
            results.append((aggregation, m["grad_norm"], m["loss"]))
    by_aggregation: dict[str, list] = {}
    for aggregation, grad_norm, loss in results:
        by_aggregation.setdefault(aggregation, []).append((grad_norm, loss))
    for (g1, l1), (g4, l4) in by_aggregation.values():
        assert g1 == pytest.approx(g4, rel=1e-4)
        assert l1 == pytest.approx(l4, abs=1e-6)


def test_steps_per_rollout_split_the_batch(tiny_model_dir):
    backend = TorchBackend(config(tiny_model_dir, num_steps_per_rollout=2), CPU)
    m = backend.train_step(make_groups())
    assert m["optimizer_steps"] == 2 and backend.step == 2


@pytest.mark.parametrize(
    "algorithm",
    [
        {"advantage_estimator": "dr_grpo", "loss_aggregation": "seq_mean_token_sum"},
        {"advantage_estimator": "rloo", "dual_clip_c": 3.0, "entropy_coef": 0.01},
        {"advantage_estimator": "reinforce_plus_plus", "kl_coef": 0.1, "gamma": 0.9},
        {"advantage_estimator": "reinforce_plus_plus_baseline", "loss_aggregation": "token_mean"},
        {"advantage_estimator": "gspo", "eps_clip": 3e-4, "eps_clip_high": 4e-4},
        {"policy_loss": "cispo"},
        {"advantage_estimator": "grpo", "kl_coef": 0.1, "kl_reward_level": "sequence"},
        {"rollout_is_upper": 2.0, "rollout_is_level": "sequence", "rollout_is_mode": "mask"},
        {"advantage_estimator": "gae", "gamma": 0.99, "gae_lambda": 0.95, "kl_coef": 0.05},
    ],
)
def test_every_estimator_trains(tiny_model_dir, algorithm):
    backend = TorchBackend(config(tiny_model_dir, algorithm=algorithm, num_steps_per_rollout=2), CPU)
    assert (backend.reference is not None) == (algorithm.get("kl_coef", 0) > 0)
    m = backend.train_step(make_groups())
    assert m["optimizer_steps"] == 2
    assert all(torch.isfinite(torch.tensor(v)) for v in m.values()), m


def test_tokens_the_engine_sampled_far_off_the_trainer_are_masked_out(tiny_model_dir):
    backend = TorchBackend(config(tiny_model_dir, algorithm={"rollout_is_upper": 2.0, "rollout_is_mode": "mask"}), CPU)
    groups = make_groups()
    model = build_hf_model(AutoModelForCausalLM.from_pretrained, tiny_model_dir).eval()
    for g in groups:
        for s in g.samples:  # the engine saw each token e^3 times less likely than the trainer does
            s.rollout_log_probs = [lp - 3.0 for lp in independent_log_probs(model, s)]
    m = backend.train_step(groups)
    assert m["tis_weight_mean"] == 0.0 and m["pg_loss"] == 0.0


def test_kl_loss_against_the_frozen_reference(tiny_model_dir):
    backend = TorchBackend(config(tiny_model_dir, algorithm={"kl_loss_coef": 0.1, "kl_estimator": "k3"}), CPU)
    assert backend.reference is not None
    first = backend.train_step(make_groups())
    assert first["kl_loss"] == pytest.approx(0.0, abs=1e-7)  # policy == reference before any step
    second = backend.train_step(make_groups())
    assert second["kl_loss"] > 0
    assert all(not p.requires_grad for p in backend.reference.parameters())


@pytest.mark.parametrize("estimator", ["k3", "low_var_kl"])
def test_kl_stays_finite_beside_padding(tiny_model_dir, estimator):
    # Responses of different lengths are padded. Padded positions carry junk targets (the
    # prompt's first token, predicted from position 0); at this temperature their log-probs
    # are about -1e7 unless the token happens to be the argmax there, and exp(-log_ratio)
    # overflows. At the real tokens the policy still equals the reference (log-ratio 0),
    # so any overflow would come from padding.
    backend = TorchBackend(
        config(
            tiny_model_dir,
            rollout_temperature=1e-7,
            micro_batch_size=6,
            algorithm={"kl_loss_coef": 0.1, "kl_estimator": estimator},
        ),
        CPU,
    )
    with torch.no_grad():
        first = next(t for t in range(3, 40) if backend.policy(torch.tensor([[t]])).logits[0, 0].argmax() != t)
    groups = [
        SampleGroup("g0", 0, [sample(0, [first, 6, 7], [8, 9, 10, 1], 1.0), sample(1, [first, 6, 7], [11, 1], 0.0)])
    ]
    before = params(backend)
    m = backend.train_step(groups)
    assert math.isfinite(m["grad_norm"]) and m["kl_loss"] == pytest.approx(0.0, abs=1e-6)
    assert any(not torch.equal(before[n], t) for n, t in backend.state_dict_for_sync())


def test_sft_step_uses_its_own_optimizer_and_lowers_the_nll(tiny_model_dir):
    backend = TorchBackend(config(tiny_model_dir, sft_optimizer={"lr": 1e-2, "warmup_steps": 2}), CPU)
    groups = [SampleGroup("g", 0, [sample(0, [5, 6], [40, 41, 42, 1], 0.0, loss_mask=[1, 1, 0, 1])])]
    first = backend.sft_step(groups)
    assert first["lr"] == pytest.approx(5e-3)  # warmup: step 1 of 2
    for _ in range(4):
        last = backend.sft_step(groups)
    assert last["lr"] == pytest.approx(1e-2)
    assert last["sft_nll"] < first["sft_nll"] - 0.5
    assert last["trained_tokens"] == 3


def test_only_failed_samples_is_no_step(tiny_model_dir):
    backend = TorchBackend(config(tiny_model_dir), CPU)
    m = backend.train_step([SampleGroup("g", 0, [sample(0, [5], [6], 1.0, Status.FAILED)])])
    assert m["failed_count"] == 1 and m["samples"] == 0 and backend.step == 0


def test_bad_samples_are_refused_with_the_reason(tiny_model_dir):
    backend = TorchBackend(config(tiny_model_dir), CPU)
    with pytest.raises(errors.InvalidArgument, match="no prompt tokens"):
        backend.train_step([SampleGroup("g", 0, [sample(0, [], [6, 7], 1.0)])])
    with pytest.raises(ConversionError, match="loss_mask has 1 entries but response_length is 2"):
        backend.train_step([SampleGroup("g", 0, [sample(0, [5], [6, 7], 1.0, loss_mask=[1])])])


def test_checkpoint_round_trip(tiny_model_dir, tmp_path):
    backend = TorchBackend(config(tiny_model_dir, sft_optimizer={"lr": 1e-4}), CPU)
    backend.train_step(make_groups())
    backend.sft_step(make_groups())
    path = backend.save_checkpoint(tmp_path / "ckpt", {"weight_version": 7})
    assert (path / "model.safetensors").exists() and (path / "tokenizer.json").exists()
    state = json.loads((path / "trainer_state.json").read_text())
    assert state == {
        "step": 2,
        "weight_version": 7,
        "reference_model_path": str(tiny_model_dir),
        "reference_rebased": False,
        "sft_steps": 1,
    }

    resumed = TorchBackend(config(path, sft_optimizer={"lr": 1e-4}), CPU)
    assert resumed.step == 2 and resumed.resumed_state["weight_version"] == 7
    assert resumed.reference_path == str(tiny_model_dir)  # KL stays against the starting model
    for (name, a), (_, b) in zip(backend.state_dict_for_sync(), resumed.state_dict_for_sync()):
        assert torch.equal(a, b), name
    for key in ("rl", "sft"):
        saved = backend._optimizers[key].optimizer.state_dict()["state"][0]["exp_avg"]
        loaded = resumed._optimizers[key].optimizer.state_dict()["state"][0]["exp_avg"]
        assert torch.equal(saved, loaded)
    # The same step on both gives the same weights.
    backend.train_step(make_groups())
    resumed.train_step(make_groups())
    for (name, a), (_, b) in zip(backend.state_dict_for_sync(), resumed.state_dict_for_sync()):
        torch.testing.assert_close(a, b, msg=name)


# ------------------------------------------------------------------ run config and Trainer logic


def test_bad_run_config_names_the_field():
    with pytest.raises(errors.InvalidArgument, match=r"algorithm\.eps_clip: Input should be greater than 0"):
        parse_run_config(json.dumps({"model_path": "/m", "algorithm": {"eps_clip": -1}}))
    with pytest.raises(errors.InvalidArgument, match=r"model_path: Field required"):
        parse_run_config("{}")
    with pytest.raises(errors.InvalidArgument, match=r"config: Invalid JSON"):
        parse_run_config("{not json")
    with pytest.raises(errors.InvalidArgument, match=r"algorithm: .*kl_coef.*reinforce_plus_plus"):
        parse_run_config(json.dumps({"model_path": "/m", "algorithm": {"kl_coef": 0.1}}))


def test_trainer_holds_one_run(tiny_model_dir, tmp_path):
    async def scenario():
        trainer = Trainer(Settings(work_dir=tmp_path))
        cfg = config(tiny_model_dir)
        with pytest.raises(errors.NotFound, match="call InitRun first"):
            trainer.status("r1")
        status = await trainer.init_run("r1", cfg)
        assert (status.run_id, status.step, status.weight_version) == ("r1", 0, 0)
        assert (await trainer.init_run("r1", cfg)).run_id == "r1"  # retried InitRun
        with pytest.raises(errors.FailedPrecondition, match="already holds run 'r1'"):
            await trainer.init_run("r2", cfg)
        with pytest.raises(errors.FailedPrecondition, match="different config"):
            await trainer.init_run("r1", config(tiny_model_dir, seed=1))
        with pytest.raises(errors.InvalidArgument, match="loss must be"):
            await trainer.train_on_groups("r1", make_groups(), loss="dpo")

        result = await trainer.train_on_groups("r1", make_groups())
        assert (result.step, result.groups_trained, result.samples_trained) == (1, 2, 5)
        sft = await trainer.train_on_groups("r1", make_groups(), loss="sft")
        assert sft.step == 2 and "sft_nll" in sft.metrics

        path = await trainer.save_checkpoint("r1")
        assert path == (tmp_path / "r1" / "checkpoints" / "step_2").resolve()
        assert json.loads((path / "trainer_state.json").read_text())["run_id"] == "r1"

        with pytest.raises(errors.FailedPrecondition, match="no buffer_address"):
            await trainer.train_step("r1", num_groups=1)
        with pytest.raises(errors.FailedPrecondition, match="no rollout_address"):
            await trainer.publish_weights("r1", version=1)
        final = await trainer.end_run("r1")
        assert final.step == 2
        with pytest.raises(errors.NotFound):
            trainer.status("r1")
        await trainer.init_run("r2", config(tiny_model_dir, model_path=str(path)))
        assert trainer.status("r2").step == 2  # resumed from the checkpoint
        await trainer.close()

    asyncio.run(scenario())


def test_missing_model_is_invalid_argument(tmp_path):
    async def scenario():
        trainer = Trainer(Settings())
        with pytest.raises(errors.InvalidArgument, match="model_path .*: no model directory there"):
            await trainer.init_run("r1", config(tmp_path / "nope"))

    asyncio.run(scenario())


# ------------------------------------------------------------------ gRPC


def test_grpc_errors_are_status_codes_with_messages(trainer_server, tiny_model_dir):
    stub = trainer_server(buffer_address=f"127.0.0.1:{free_port()}")  # nothing listens there
    with pytest.raises(grpc.RpcError) as e:
        stub.InitRun(trainer_pb2.InitRunRequest(run_id="r1", config_json='{"model_path": "/m", "micro_batch_size": 0}'))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "micro_batch_size: Input should be greater than or equal to 1" in e.value.details()

    with pytest.raises(grpc.RpcError) as e:
        stub.GetStatus(trainer_pb2.GetStatusRequest(run_id="r1"))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND

    status = stub.InitRun(trainer_pb2.InitRunRequest(run_id="r1", config_json=config(tiny_model_dir).model_dump_json()))
    assert status.run_id == "r1" and status.model_path == str(tiny_model_dir)

    with pytest.raises(grpc.RpcError) as e:
        stub.TrainStep(trainer_pb2.TrainStepRequest(run_id="r1", num_groups=2))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "buffer (" in e.value.details() and "unavailable" in e.value.details()

    with pytest.raises(grpc.RpcError) as e:
        stub.TrainStep(trainer_pb2.TrainStepRequest(run_id="r1", num_groups=0))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    saved = stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(run_id="r1"))
    assert Path(saved.path, "model.safetensors").exists()
    assert stub.EndRun(trainer_pb2.EndRunRequest(run_id="r1")).step == 0


def test_train_step_leases_from_the_buffer_and_acknowledges_after_the_step(
    buffer_address, trainer_server, tiny_model_dir, tmp_path
):
    buffer = fill_buffer(buffer_address, "r1", tmp_path / "train.jsonl")
    stub = trainer_server(buffer_address=buffer_address)
    stub.InitRun(trainer_pb2.InitRunRequest(run_id="r1", config_json=config(tiny_model_dir).model_dump_json()))

    result = stub.TrainStep(trainer_pb2.TrainStepRequest(run_id="r1", num_groups=2, wait_seconds=5))
    assert (result.step, result.groups_trained, result.samples_trained) == (1, 2, 4)
    assert {"loss", "pg_loss", "clip_frac", "approx_kl", "entropy", "grad_norm", "lr"} <= set(result.metrics)
    stats = buffer.GetStats(buffer_pb2.GetStatsRequest(run_id="r1"))
    # (checkpoints are on by default, by time: an acknowledgment is provisional until a
    # checkpoint holds its step, and EndRun writes that checkpoint)
    assert (stats.provisional_groups, stats.queued_groups, stats.leased_groups) == (2, 0, 0)

    with pytest.raises(grpc.RpcError) as e:  # everything was consumed
        stub.TrainStep(trainer_pb2.TrainStepRequest(run_id="r1", num_groups=1, wait_seconds=0.05))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "buffer had only 0 of 1 groups for run 'r1'" in e.value.details()

    stub.EndRun(trainer_pb2.EndRunRequest(run_id="r1"))
    stats = buffer.GetStats(buffer_pb2.GetStatsRequest(run_id="r1"))
    assert (stats.acknowledged_groups, stats.provisional_groups) == (2, 0)
    stub.InitRun(trainer_pb2.InitRunRequest(run_id="r2", config_json=config(tiny_model_dir).model_dump_json()))
    with pytest.raises(grpc.RpcError) as e:  # the trainer knows r2, the buffer does not
        stub.TrainStep(trainer_pb2.TrainStepRequest(run_id="r2", num_groups=1))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "unknown run 'r2'" in e.value.details()


# ------------------------------------------------------------------ weight push


def moved(backend: TorchBackend, delta: float) -> list[tuple[str, torch.Tensor]]:
    """Change every weight, so that the engine can only match by receiving them."""
    with torch.no_grad():
        for p in backend.policy.parameters():
            p.add_(delta)
    return list(backend.state_dict_for_sync())


def test_plan_buckets():
    f32 = [(f"w{i}", torch.zeros(10)) for i in range(5)]  # 40 bytes each
    assert [[n for n, _ in b] for b in plan_buckets(f32, 100)] == [["w0", "w1"], ["w2", "w3"], ["w4"]]
    assert len(plan_buckets(f32, 10)) == 5  # larger than a bucket: alone
    assert len(plan_buckets(f32, 60, wire_dtype=torch.bfloat16)) == 2  # 20 bytes each as sent: 3 + 2
    mixed = [("a", torch.zeros(2)), ("b", torch.zeros(2, dtype=torch.bfloat16)), ("c", torch.zeros(2))]
    assert [[n for n, _ in b] for b in plan_buckets(mixed, 1000)] == [["a"], ["b"], ["c"]]  # one dtype each


def test_publish_weights_through_the_rollout_service(rollout_address, engine, trainer_server, tiny_model_dir, tmp_path):
    stub = trainer_server(rollout_address=rollout_address)
    cfg = config(tiny_model_dir, weight_sync={"bucket_bytes": 128 * 1024})
    stub.InitRun(trainer_pb2.InitRunRequest(run_id="r1", config_json=cfg.model_dump_json()))

    first = stub.PublishWeights(trainer_pb2.PublishWeightsRequest(run_id="r1", version=1))
    trainer = trainer_server.trainers[-1]
    buckets = plan_buckets(list(trainer._run.backend.state_dict_for_sync()), 128 * 1024)
    assert first.version == 1 and first.bytes == 137_728 * 4 and first.buckets == len(buckets) > 1
    assert engine.weight_version() == "1"
    group = trainer._run.pusher._group.name
    weights = moved(trainer._run.backend, 0.01)

    stub.PublishWeights(trainer_pb2.PublishWeightsRequest(run_id="r1", version=2))
    assert engine.weight_version() == "2"
    assert_engine_has(engine, weights)  # every parameter, bit for bit
    assert trainer._run.pusher._group.name == group  # the group is kept across pushes
    assert stub.GetStatus(trainer_pb2.GetStatusRequest(run_id="r1")).weight_version == 2

    weights = moved(trainer._run.backend, 0.01)
    disk = stub.PublishWeights(trainer_pb2.PublishWeightsRequest(run_id="r1", version=3, method="disk"))
    assert disk.bytes > 0 and engine.weight_version() == "3"
    assert_engine_has(engine, weights[:3])
    assert sorted(p.name for p in (tmp_path / "r1" / "weights").iterdir()) == ["v3"]

    with pytest.raises(grpc.RpcError) as e:
        stub.PublishWeights(trainer_pb2.PublishWeightsRequest(run_id="r1", version=4, method="nfs"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_push_whose_caller_went_away_goes_to_its_end(
    rollout_address, engine, trainer_server, tiny_model_dir, tmp_path, monkeypatch
):
    """PublishWeights's caller goes away (a coordinator restarting) while bucket 1 is on its
    way and the engine has been asked for bucket 2: the push goes on to its end. Before, it
    stopped there, and the next push broadcast its first bucket into the engine's wait for
    bucket 2 (gloo aborted the engine's process on the size mismatch). A push whose caller
    went away while it waited for the model is not made."""
    monkeypatch.setenv(FAULTS_DIR_ENV, str(tmp_path))
    stub = trainer_server(rollout_address=rollout_address)
    cfg = config(tiny_model_dir, weight_sync={"bucket_bytes": 128 * 1024})
    stub.InitRun(trainer_pb2.InitRunRequest(run_id="r1", config_json=cfg.model_dump_json()))
    stub.PublishWeights(trainer_pb2.PublishWeightsRequest(run_id="r1", version=1))  # (opens the group)
    backend, process = trainer_server.trainers[-1]._run.backend, engine.process

    weights = moved(backend, 0.01)
    hold = tmp_path / "trainer.mid_push.hold"
    hold.touch()
    pushing = stub.PublishWeights.future(trainer_pb2.PublishWeightsRequest(run_id="r1", version=2), timeout=120)
    eventually(lambda: (tmp_path / "trainer.mid_push.reached").exists(), "bucket 2 asked for", timeout=60)
    waiting = stub.PublishWeights.future(trainer_pb2.PublishWeightsRequest(run_id="r1", version=3), timeout=120)
    time.sleep(0.5)  # (queued behind the held push)
    assert pushing.cancel() and waiting.cancel()
    hold.unlink()
    eventually(lambda: engine.weight_version() == "2", "the push carried on", timeout=60)
    assert_engine_has(engine, weights)
    time.sleep(1)
    assert engine.weight_version() == "2"  # (version 3's caller had gone)

    weights = moved(backend, 0.01)
    stub.PublishWeights(trainer_pb2.PublishWeightsRequest(run_id="r1", version=4))
    assert engine.weight_version() == "4" and engine.process is process and process.poll() is None
    assert_engine_has(engine, weights)


def test_weights_pushed_again_to_a_restarted_engine_keep_their_version_until_the_next_step(
    rollout_address, engine, trainer_server, tiny_model_dir
):
    """An engine that restarted on its base weights gets the run's weights again (`again`):
    nothing was trained since the last push, so they go out under its version. A new version
    made samples generated on the very same weights count as stale (sync's staleness 0 read
    1 after an engine was killed)."""
    stub = trainer_server(rollout_address=rollout_address)
    stub.InitRun(trainer_pb2.InitRunRequest(run_id="r1", config_json=config(tiny_model_dir).model_dump_json()))
    trainer = trainer_server.trainers[-1]
    weights = moved(trainer._run.backend, 0.01)
    stub.PublishWeights(trainer_pb2.PublishWeightsRequest(run_id="r1", version=1))

    engine.restart()  # back on its checkpoint's weights
    again = stub.PublishWeights(trainer_pb2.PublishWeightsRequest(run_id="r1", version=2, again=True))
    assert again.version == 1 and engine.weight_version() == "1"
    assert_engine_has(engine, weights)
    assert stub.GetStatus(trainer_pb2.GetStatusRequest(run_id="r1")).weight_version == 1

    weights = moved(trainer._run.backend, 0.01)
    trainer._run.backend.step += 1  # (what a train step does to them, without a buffer to lease from)
    again = stub.PublishWeights(trainer_pb2.PublishWeightsRequest(run_id="r1", version=2, again=True))
    assert again.version == 2 and engine.weight_version() == "2"
    assert_engine_has(engine, weights)


def test_a_background_push_sends_the_weights_of_its_call_while_training_goes_on(
    rollout_address, engine, trainer_server, tiny_model_dir
):
    """PublishWeights(background) answers once the weights are copied; the push goes on from
    the copy, so what changes the weights meanwhile (the next train step) is not in it, and
    WaitForPush answers with its outcome. A version it never started is FAILED_PRECONDITION;
    a method other than the broadcast is refused."""
    stub = trainer_server(rollout_address=rollout_address)
    stub.InitRun(trainer_pb2.InitRunRequest(run_id="r1", config_json=config(tiny_model_dir).model_dump_json()))
    backend = trainer_server.trainers[-1]._run.backend
    moved(backend, 0.01)
    expected = params(backend)

    started = stub.PublishWeights(trainer_pb2.PublishWeightsRequest(run_id="r1", version=1, background=True))
    assert started.version == 1 and started.bytes == 0
    moved(backend, 0.01)  # a train step's change, after the copy
    done = stub.WaitForPush(trainer_pb2.WaitForPushRequest(run_id="r1", version=1))
    assert done.version == 1 and done.bytes == 137_728 * 4 and engine.weight_version() == "1"
    assert_engine_has(engine, expected.items())
    assert stub.WaitForPush(trainer_pb2.WaitForPushRequest(run_id="r1", version=1)).version == 1  # (asked again)

    with pytest.raises(grpc.RpcError) as e:
        stub.WaitForPush(trainer_pb2.WaitForPushRequest(run_id="r1", version=2))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "push again" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        stub.PublishWeights(trainer_pb2.PublishWeightsRequest(run_id="r1", version=2, method="disk", background=True))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "distributed" in e.value.details()


def test_a_background_push_that_fails_is_aborted_for_wait_for_push(loop_thread, trainer_server, tiny_model_dir):
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    server, port = loop_thread.run(start_rollout(RolloutSettings(port=0, engine_urls=[down])))
    try:
        stub = trainer_server(rollout_address=f"127.0.0.1:{port}")
        stub.InitRun(trainer_pb2.InitRunRequest(run_id="r1", config_json=config(tiny_model_dir).model_dump_json()))
        stub.PublishWeights(trainer_pb2.PublishWeightsRequest(run_id="r1", version=1, background=True))
        with pytest.raises(grpc.RpcError) as e:
            stub.WaitForPush(trainer_pb2.WaitForPushRequest(run_id="r1", version=1))
        assert e.value.code() == grpc.StatusCode.ABORTED
        assert "push of weights v1 failed (push again)" in e.value.details() and down in e.value.details()
    finally:
        loop_thread.run(server.stop(None))


def test_flattened_bf16_buckets_and_a_new_group_after_an_engine_restart(
    loop_thread, rollout_address, engine, tiny_model_dir
):
    backend = TorchBackend(config(tiny_model_dir), CPU)
    sync = WeightSyncConfig(bucket_bytes=64 * 1024, backend="gloo", load_format="flattened_bucket")
    pusher = WeightPusher(rollout_address, "r-flat")
    try:
        weights = moved(backend, 0.02)
        result = loop_thread.run(pusher.push_distributed(weights, 5, sync, wire_dtype=torch.bfloat16))
        assert result.bytes == 137_728 * 2 and result.buckets == len(plan_buckets(weights, 64 * 1024, torch.bfloat16))
        assert_engine_has(engine, weights, torch.bfloat16)
        group = pusher._group.name

        engine.restart()  # back with its checkpoint's weights and outside any group
        weights = moved(backend, 0.02)
        loop_thread.run(pusher.push_distributed(weights, 6, sync))
        assert engine.weight_version() == "6" and pusher._group.name != group
        assert_engine_has(engine, weights)
    finally:
        loop_thread.run(pusher.close())


def test_many_buckets_each_requested_while_the_one_before_is_received(
    loop_thread, rollout_address, engine, tiny_model_dir
):
    """Over gloo a bucket's UpdateWeights goes out while the bucket before it is still being
    broadcast (the engine queues it behind that one): every bucket lands, in order, bit
    for bit, and the push says when each bucket started, had its first tensor out and ended."""
    backend = TorchBackend(config(tiny_model_dir), CPU)
    sync = WeightSyncConfig(bucket_bytes=16 * 1024, backend="gloo")  # one broadcast per tensor, many buckets
    pusher = WeightPusher(rollout_address, "r-many")
    try:
        for version in (7, 8):  # the second push reuses the engine's receive buffers
            weights = moved(backend, 0.02)
            result = loop_thread.run(pusher.push_distributed(weights, version, sync, wire_dtype=torch.bfloat16))
            assert result.buckets == len(plan_buckets(weights, 16 * 1024, torch.bfloat16)) > 4
            assert [t.index for t in result.timings] == list(range(result.buckets))
            assert all(t.started <= t.first_sent <= t.finished <= result.seconds for t in result.timings)
            assert engine.weight_version() == str(version)
            assert_engine_has(engine, weights, torch.bfloat16)
    finally:
        loop_thread.run(pusher.close())


@pytest.mark.parametrize("pause_mode", ["", "abort"])
def test_push_to_an_engine_that_is_down_is_a_clear_error(loop_thread, pause_mode):
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    server, port = loop_thread.run(start_rollout(RolloutSettings(port=0, engine_urls=[down])))
    pusher = WeightPusher(f"127.0.0.1:{port}", "r-down")
    try:
        # (the rollout service's own UNAVAILABLE, engines down, is an answer: not waited out
        # as if the service itself were unreachable)
        with pytest.raises(errors.Unavailable, match=f"engines not answering, weights not pushed: {down}"):
            loop_thread.run(
                pusher.push_distributed([("w", torch.zeros(2))], 1, WeightSyncConfig(), pause_mode=pause_mode),
                timeout=20,
            )
    finally:
        loop_thread.run(pusher.close())
        loop_thread.run(server.stop(None))


@pytest.mark.parametrize("pause_mode", ["", "abort"])
def test_a_push_waits_for_a_rollout_service_that_is_coming_up(loop_thread, pause_mode, caplog):
    """A push that starts while the rollout service is still (re)starting waits for it
    rather than failing (its ListEngines, and its PauseGeneration when it pauses the
    engines): here it gets as far as the engines, which are down."""
    down = f"http://127.0.0.1:{free_port()}"
    port = free_port()
    pusher = WeightPusher(f"127.0.0.1:{port}", "r-late")

    async def push_then_start_rollout():
        push = asyncio.ensure_future(
            pusher.push_distributed([("w", torch.zeros(2))], 1, WeightSyncConfig(), pause_mode=pause_mode)
        )
        await asyncio.sleep(1.0)  # refused meanwhile
        assert not push.done()
        server, _ = await start_rollout(RolloutSettings(port=port, engine_urls=[down]))
        try:
            return await asyncio.wait_for(asyncio.shield(push), 30)
        except Exception as e:
            return e
        finally:
            await server.stop(None)

    try:
        outcome = loop_thread.run(push_then_start_rollout())
        assert isinstance(outcome, errors.Unavailable) and "engines not answering" in str(outcome)
        waited = {r.getMessage().split("(")[1].split(")")[0] for r in caplog.records if "waiting for" in r.getMessage()}
        assert waited == ({"ListEngines", "PauseGeneration"} if pause_mode else {"ListEngines"})
    finally:
        loop_thread.run(pusher.close())
