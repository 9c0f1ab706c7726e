"""The off-policy correction inside a real training step (TorchBackend on the tiny model):
sync trains exactly as before whatever the engine's log-probs, the async modes' default
correction weighs the loss, and VCPO's ESS scaling shrinks the step."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from rlmesh.common.model_building import build_hf_model
from rlmesh.common.run_config import RunConfig
from rlmesh.trainer.backend import TorchBackend
from tests.helpers.trainer import CPU, config, independent_log_probs, make_groups


def params(backend: TorchBackend) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in backend.state_dict_for_sync()}


def off_engine_groups(model_dir, shift=lambda j: 1.5 * (-1) ** j):
    """make_groups() whose engine log-probs are the trainer's shifted token by token (as if
    sampled by older weights)."""
    groups = make_groups()
    model = build_hf_model(AutoModelForCausalLM.from_pretrained, model_dir).eval()
    for g in groups:
        for s in g.samples:
            s.rollout_log_probs = [lp + shift(j) for j, lp in enumerate(independent_log_probs(model, s))]
    return groups


def mode_config(model_dir, mode: str, **fields):
    run = RunConfig.model_validate(
        {
            "model_path": str(model_dir),
            "datasets": [{"name": "train", "path": "t.jsonl"}],
            "mode": mode,
            "micro_batch_size": 2,
            "optimizer": {"lr": 1e-3},
            **fields,
        }
    )
    return config(model_dir, **run.trainer_config().model_dump(exclude={"model_path", "micro_batch_size"}))


def test_sync_trains_bit_for_bit_as_without_engine_log_probs(tiny_model_dir):
    with_engine = TorchBackend(mode_config(tiny_model_dir, "sync"), CPU)
    without = TorchBackend(mode_config(tiny_model_dir, "sync"), CPU)
    a = with_engine.train_step(off_engine_groups(tiny_model_dir))
    b = without.train_step(make_groups())  # no rollout log-probs: nothing to correct with
    for name in ("loss", "pg_loss", "grad_norm", "clip_frac"):
        assert a[name] == b[name], name
    pa, pb = params(with_engine), params(without)
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    # the gap is still measured
    assert a["is_weight_max"] > 1 and a["is_ess"] < 1 and a["off_policy_lr_scale"] == 1.0


def test_async_default_correction_weighs_the_loss(tiny_model_dir):
    sync = TorchBackend(mode_config(tiny_model_dir, "sync"), CPU)
    fully_async = TorchBackend(mode_config(tiny_model_dir, "fully_async"), CPU)
    a = sync.train_step(off_engine_groups(tiny_model_dir))
    b = fully_async.train_step(off_engine_groups(tiny_model_dir))
    assert fully_async.config.off_policy.method == "tis" and fully_async.config.off_policy.ess_step_scaling
    # rho = e^-1.5 and e^1.5: every other token truncated at 2
    assert b["is_truncated_masked_fraction"] > 0 and b["is_weight_max"] <= 2.0 + 1e-6
    assert b["off_policy_lr_scale"] < 1.0
    assert a["pg_loss"] != b["pg_loss"]


def test_ess_step_scaling_shrinks_the_step(tiny_model_dir):
    plain = TorchBackend(mode_config(tiny_model_dir, "fully_async", off_policy={"method": "tis"}), CPU)
    scaled = TorchBackend(
        mode_config(tiny_model_dir, "fully_async", off_policy={"method": "tis", "ess_step_scaling": True}), CPU
    )
    start = params(plain)

    def moved(backend) -> float:
        return sum(float((t - start[n]).norm() ** 2) for n, t in params(backend).items()) ** 0.5

    # sequences alike in everything but how far the engine was off: a low ESS
    m_plain = plain.train_step(off_engine_groups(tiny_model_dir, lambda j: -0.7 * j))
    m_scaled = scaled.train_step(off_engine_groups(tiny_model_dir, lambda j: -0.7 * j))
    assert m_scaled["off_policy_lr_scale"] == m_scaled["is_ess"] ** 0.5 < 0.9
    assert moved(scaled) < moved(plain)
    assert m_plain["off_policy_lr_scale"] == 1.0


def test_the_optimal_baseline_changes_a_steps_advantages_only_where_the_ratios_differ(tiny_model_dir):
    """VCPO's baseline in a real step: with engine log-probs that leave the groups' sequence
    ratios unequal, the advantages differ from GRPO's plain group mean (which way, by hand:
    tests/unit/test_off_policy.py); with none (nothing to weigh by) the step is GRPO's, bit
    for bit."""
    correction = {"method": "tis", "optimal_baseline": True}
    plain = TorchBackend(mode_config(tiny_model_dir, "fully_async", off_policy={"method": "tis"}), CPU)
    weighted = TorchBackend(mode_config(tiny_model_dir, "fully_async", off_policy=correction), CPU)

    def likelier_now(j: int) -> float:  # the longer a response, the likelier now than when it was sampled
        return -0.7 * j

    a = plain.train_step(off_engine_groups(tiny_model_dir, likelier_now))
    b = weighted.train_step(off_engine_groups(tiny_model_dir, likelier_now))
    assert a["advantage_abs_mean"] != b["advantage_abs_mean"]

    plain = TorchBackend(mode_config(tiny_model_dir, "fully_async", off_policy={"method": "tis"}), CPU)
    weighted = TorchBackend(mode_config(tiny_model_dir, "fully_async", off_policy=correction), CPU)
    a, b = plain.train_step(make_groups()), weighted.train_step(make_groups())
    assert a["advantage_abs_mean"] == b["advantage_abs_mean"] and a["pg_loss"] == b["pg_loss"]
