"""The critic of PPO with GAE (advantage_estimator 'gae'): a value head on the policy.

A linear head on the policy's last hidden state, V(s_t) = w . h_t + b, rather than a
second model: the values come out of the forward passes the policy makes anyway (no
second model's memory, no second forward), which is what keeps PPO with a critic
affordable next to GRPO on one device. The value loss trains the head and, through the
shared trunk, the policy (the value_loss_coef balances the two), as in the value-head
models of TRL and OpenRLHF's shared-critic option.

The head starts at zero (V = 0 everywhere), so the first returns are the rewards and
nothing random enters the first advantages. It is saved beside a checkpoint's model as
VALUE_HEAD_FILE (safetensors) and restored on resume; engines never see it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor, nn

from rlmesh.common import errors

VALUE_HEAD_FILE = "value_head.safetensors"


class ValueHead(nn.Module):
    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: Tensor) -> Tensor:
        """[..., H] hidden states -> [...] values (float32)."""
        return self.linear(hidden.float()).squeeze(-1)


def build_value_head(hidden_size: int, device: torch.device, checkpoint: Path | None = None) -> ValueHead:
    """A fresh (zero) head, or the one saved in `checkpoint` when it holds one."""
    head = ValueHead(hidden_size)
    saved = checkpoint / VALUE_HEAD_FILE if checkpoint is not None else None
    if saved is not None and saved.is_file():
        try:
            head.load_state_dict(load_file(saved))
        except RuntimeError as e:  # a head of another hidden size
            raise errors.InvalidArgument(f"{saved}: the value head does not fit this model: {e}") from None
    return head.to(device)
