"""PPO with a critic in the torch backend (advantage_estimator 'gae'): the value head's
values come from the old pass, the critic is trained on the GAE returns with the clipped
value loss, its state is in checkpoints, and the engines never see it."""

from __future__ import annotations

import pytest
import torch

from rlmesh.trainer.backend import TorchBackend
from rlmesh.trainer.critic import VALUE_HEAD_FILE
from tests.helpers.trainer import CPU, config, make_groups

PPO = {"advantage_estimator": "gae", "gamma": 0.99, "gae_lambda": 0.95, "value_loss_coef": 0.5, "value_clip": 0.2}


def critic_state(backend: TorchBackend) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in backend.critic.state_dict().items()}


def test_the_critic_learns_the_returns(tiny_model_dir):
    # gamma = lambda = 1: the returns are the rewards, a fixed target to regress on.
    backend = TorchBackend(config(tiny_model_dir, algorithm={**PPO, "gamma": 1.0, "gae_lambda": 1.0}), CPU)
    first = backend.train_step(make_groups())
    # The head starts at zero: no value, so nothing of the returns is explained yet.
    assert first["value_mean"] == 0.0 and first["explained_variance"] == 0.0
    assert first["value_loss"] > 0 and first["return_mean"] == pytest.approx(first["reward_mean"], abs=0.2)
    assert any(not torch.equal(v, torch.zeros_like(v)) for v in critic_state(backend).values())
    for _ in range(19):
        last = backend.train_step(make_groups())
    assert last["value_loss"] < first["value_loss"] / 2
    assert last["explained_variance"] > 0.3
    assert all(torch.isfinite(torch.tensor(v)) for v in last.values()), last


def test_the_engines_get_the_policy_only(tiny_model_dir):
    plain = TorchBackend(config(tiny_model_dir), CPU)
    ppo = TorchBackend(config(tiny_model_dir, algorithm=PPO), CPU)
    assert [n for n, _ in ppo.state_dict_for_sync()] == [n for n, _ in plain.state_dict_for_sync()]


def test_the_critic_is_checkpointed_and_resumed(tiny_model_dir, tmp_path):
    backend = TorchBackend(config(tiny_model_dir, algorithm=PPO), CPU)
    backend.train_step(make_groups())
    path = backend.save_checkpoint(tmp_path / "ckpt")
    assert (path / VALUE_HEAD_FILE).is_file() and (path / "model.safetensors").is_file()

    resumed = TorchBackend(config(path, algorithm=PPO), CPU)
    for name, value in critic_state(backend).items():
        assert torch.equal(value, resumed.critic.state_dict()[name]), name
    # The same step on both moves policy and critic alike (the optimizer state of the head too).
    a, b = backend.train_step(make_groups()), resumed.train_step(make_groups())
    assert a["value_loss"] == pytest.approx(b["value_loss"], rel=1e-5)
    for name, value in critic_state(backend).items():
        torch.testing.assert_close(value, resumed.critic.state_dict()[name], msg=name)
    for (name, x), (_, y) in zip(backend.state_dict_for_sync(), resumed.state_dict_for_sync()):
        torch.testing.assert_close(x, y, msg=name)
