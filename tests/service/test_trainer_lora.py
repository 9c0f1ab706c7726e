"""LoRA in the torch backend (the run config's `lora`): only the adapters train, the
engines get merged weights under the base model's names (over the real rollout service
and weight group), the KL reference is the base model with the adapters disabled, and
checkpoints hold the adapters in PEFT's format and resume from them."""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel
from pydantic import ValidationError
from transformers import AutoModelForCausalLM

from rlmesh.common import errors
from rlmesh.common.model_building import build_hf_model
from rlmesh.common.run_config import TrainerRunConfig
from rlmesh.common.sample import Status
from rlmesh.trainer import lora
from rlmesh.trainer.backend import TorchBackend
from rlmesh.trainer.batches import prepare_batch
from rlmesh.trainer.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from rlmesh.v1 import trainer_pb2
from tests.helpers.trainer import CPU, config, independent_log_probs, make_groups

# The real engine, rollout service and trainer server of the trainer's tests.

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}


def base_model(model_dir):
    return build_hf_model(AutoModelForCausalLM.from_pretrained, model_dir).eval()


def adapters(backend: TorchBackend) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in backend.policy.named_parameters() if "lora_" in n}


def trained(model_dir, steps: int = 2, **overrides) -> TorchBackend:
    backend = TorchBackend(config(model_dir, lora=LORA, optimizer={"lr": 1e-2}, **overrides), CPU)
    for _ in range(steps):
        backend.train_step(make_groups())
    return backend


def test_only_the_adapters_train(tiny_model_dir):
    backend = TorchBackend(config(tiny_model_dir, lora=LORA, optimizer={"lr": 1e-2}), CPU)
    start = adapters(backend)
    assert start and all(torch.equal(v, torch.zeros_like(v)) for n, v in start.items() if "lora_B" in n)
    assert {n for n, p in backend.policy.named_parameters() if p.requires_grad} == set(start)
    backend.train_step(make_groups())
    assert any(not torch.equal(v, start[n]) for n, v in adapters(backend).items() if "lora_B" in n)
    base = dict(base_model(tiny_model_dir).named_parameters())
    for name, p in backend.policy.get_base_model().named_parameters():
        if "lora_" not in name:
            assert torch.equal(p, base[name.replace(".base_layer", "")]), name


def test_the_engines_get_merged_weights_under_the_base_names(tiny_model_dir):
    backend = trained(tiny_model_dir)
    pushed = dict(backend.state_dict_for_sync())
    base = base_model(tiny_model_dir)
    assert list(pushed) == [n for n, _ in base.named_parameters()]
    layers = dict(backend.policy.get_base_model().named_modules())
    for name, weight in base.named_parameters():
        module = name.removesuffix(".weight")
        if module.endswith(("q_proj", "v_proj")):
            a = layers[module].lora_A["default"].weight
            b = layers[module].lora_B["default"].weight
            torch.testing.assert_close(pushed[name], weight + (8.0 / 4) * b @ a, msg=name)  # W + alpha / r * B A
            assert not torch.equal(pushed[name], weight), name
        else:
            assert torch.equal(pushed[name], weight), name
    # The merged model computes what the policy with its adapters computes.
    base.load_state_dict(pushed, strict=False)
    s = make_groups()[0].samples[0]
    with torch.no_grad():
        expected = backend.policy(torch.tensor([s.tokens])).logits
    torch.testing.assert_close(base(torch.tensor([s.tokens])).logits, expected, atol=1e-5, rtol=1e-5)


def test_the_kl_reference_is_the_base_model_without_a_second_model(tiny_model_dir):
    backend = trained(tiny_model_dir, algorithm={"kl_loss_coef": 0.1, "kl_estimator": "k3"})
    assert backend.reference is None and backend.has_reference
    samples = [s for g in make_groups() for s in g.samples if s.status != Status.FAILED]
    batch = prepare_batch(make_groups(), backend.vocab_size).samples
    width = max(s.response_length for s in batch)
    ref = backend._reference_log_probs(batch, width)
    base = base_model(tiny_model_dir)
    for i, s in enumerate(samples):
        expected = torch.tensor(independent_log_probs(base, s))
        torch.testing.assert_close(ref[i, : s.response_length], expected, atol=1e-5, rtol=0)
        # ... while the policy itself has moved away from it
        assert not torch.allclose(torch.tensor(independent_log_probs(backend.policy, s)), expected, atol=1e-4)
    m = backend.train_step(make_groups())
    assert m["kl_loss"] > 0


def test_a_checkpoint_holds_the_adapters_and_resumes_from_them(tiny_model_dir, tmp_path):
    backend = trained(tiny_model_dir)
    path = backend.save_checkpoint(tmp_path / "ckpt", {"weight_version": 3})
    assert (path / ADAPTER_WEIGHTS).is_file() and (path / ADAPTER_CONFIG).is_file()
    assert not (path / "model.safetensors").exists()  # the adapters only
    state = json.loads((path / "trainer_state.json").read_text())
    assert state["lora_base_model_path"] == str(tiny_model_dir) and state["step"] == 2
    # PEFT itself loads it onto the base model.
    loaded = build_hf_model(PeftModel.from_pretrained, base_model(tiny_model_dir), path)
    for (name, a), (_, b) in zip(backend.state_dict_for_sync(), _merged(loaded)):
        torch.testing.assert_close(a, b, msg=name)

    resumed = TorchBackend(config(path, lora=LORA, optimizer={"lr": 1e-2}), CPU)
    assert resumed.step == 2 and resumed.reference_path == str(tiny_model_dir)
    for name, value in adapters(backend).items():
        assert torch.equal(value, adapters(resumed)[name]), name
    backend.train_step(make_groups())
    resumed.train_step(make_groups())
    for name, value in adapters(backend).items():
        torch.testing.assert_close(value, adapters(resumed)[name], msg=name)

    with pytest.raises(errors.InvalidArgument, match="holds LoRA adapters"):
        TorchBackend(config(path), CPU)
    with pytest.raises(errors.InvalidArgument, match="do not fit"):
        TorchBackend(config(path, lora={**LORA, "rank": 2}), CPU)


def _merged(peft_model):
    merged = peft_model.merge_and_unload()
    return [(n, p.detach()) for n, p in merged.named_parameters()]


def test_lora_settings_are_checked(tiny_model_dir):
    for bad in (
        {"rank": 0},
        {"dropout": 1.0},
        {"target_modules": ["q_proj; rm"]},
        {"target_modules": []},
        {"alpha": -1},
        {"ranks": 4},
    ):
        with pytest.raises(ValidationError):
            config(tiny_model_dir, lora=bad)
    with pytest.raises(ValidationError, match="lora with data_parallel 'fsdp2'"):
        config(tiny_model_dir, lora=LORA, data_parallel="fsdp2")
    with pytest.raises(errors.InvalidArgument, match="lora.target_modules"):
        TorchBackend(config(tiny_model_dir, lora={"target_modules": ["no_such_proj"]}), CPU)
    assert (
        TrainerRunConfig.model_validate(
            {"model_path": "m", "lora": {"target_modules": "all-linear"}}
        ).lora.target_modules
        == "all-linear"
    )


def test_dropout_is_on_in_training_passes_only(tiny_model_dir):
    backend = TorchBackend(config(tiny_model_dir, lora={**LORA, "dropout": 0.5}), CPU)
    m = backend.train_step(make_groups())
    # The old pass is deterministic (eval mode) and B = 0 at the start, so the ratio is 1
    # even with dropout in the training pass; afterwards dropout is off again.
    assert m["approx_kl"] == pytest.approx(0.0, abs=1e-6)
    dropouts = [d for n, d in backend.policy.named_modules() if n.endswith("lora_dropout.default")]
    assert dropouts and not any(d.training for d in dropouts)
    with lora.dropout_active(backend.policy):
        assert all(d.training for d in dropouts)


def engine_has(engine, weights) -> None:
    # Not bit for bit: W + scale * B A is a matmul, whose last bit may depend on how the
    # BLAS splits it across threads, so two evaluations on a loaded machine can differ.
    for name, value in weights:
        torch.testing.assert_close(engine.tensor(name), value, atol=1e-6, rtol=1e-6, msg=name)


def test_merged_weights_reach_the_engine(rollout_address, engine, trainer_server, tiny_model_dir, tmp_path):
    stub = trainer_server(rollout_address=rollout_address)
    cfg = config(tiny_model_dir, lora=LORA)
    stub.InitRun(trainer_pb2.InitRunRequest(run_id="r-lora", config_json=cfg.model_dump_json()))
    backend = trainer_server.trainers[-1]._run.backend
    with torch.no_grad():  # adapters that change the weights, so only merged ones can match
        for name, p in backend.policy.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.05)
    weights = list(backend.state_dict_for_sync())
    stub.PublishWeights(trainer_pb2.PublishWeightsRequest(run_id="r-lora", version=1))
    assert engine.weight_version() == "1"
    engine_has(engine, weights)

    with torch.no_grad():
        for name, p in backend.policy.named_parameters():
            if "lora_B" in name:
                p.mul_(2)
    weights = list(backend.state_dict_for_sync())
    stub.PublishWeights(trainer_pb2.PublishWeightsRequest(run_id="r-lora", version=2, method="disk"))
    assert engine.weight_version() == "2"
    engine_has(engine, weights)
