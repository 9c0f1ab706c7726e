"""Data parallelism of the torch backend: FSDP2 (torch.distributed.fsdp.fully_shard)
across the processes of a torchrun job (gloo on CPU, nccl on GPU).

Every rank holds the whole batch (the groups of the step) and trains its contiguous share
of each mini-batch; what a step computes once for the whole batch (old log-probs, the
reference's, the critic's values) is scored share by share and summed across ranks, so
every rank computes the same advantages. Loss normalization uses the whole mini-batch's
token and sequence counts, so each rank's loss is its share of one process's loss: their
sum is that loss, and FSDP's reduce-scatter (an average over ranks) is undone by scaling
each rank's loss by the world size before backward. The numbers equal one process's up
to float summation order (tests/service/test_trainer_fsdp.py).

A sharded model's forward and backward are collectives: every rank runs as many
micro-batches as the others (a rank with no samples left runs a stand-in whose mask is
all 0).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor, nn

from rlmesh.common import errors

if TYPE_CHECKING:
    from rlmesh.common.run_config import TrainingConfig


def _split_evenly(n: int, parts: int) -> list[range]:
    bounds = [round(k * n / parts) for k in range(parts + 1)]
    return [range(bounds[k], bounds[k + 1]) for k in range(parts)]


@dataclass(frozen=True)
class DataParallel:
    mode: str = "none"
    rank: int = 0
    world: int = 1

    @classmethod
    def from_config(cls, config: TrainingConfig) -> DataParallel:
        mode = getattr(config, "data_parallel", "none")
        if mode == "none":
            return cls()
        if not dist.is_available() or not dist.is_initialized():
            raise errors.InvalidArgument(
                f"data_parallel {mode!r} trains across the processes of a torch.distributed job: start them with "
                "torchrun and call torch.distributed.init_process_group (gloo on CPU) before building the backend"
            )
        return cls(mode, dist.get_rank(), dist.get_world_size())

    # ------------------------------------------------------------ the model

    def shard(self, model: nn.Module, *others: nn.Module | None) -> None:
        """fully_shard each transformer block (the classes Hugging Face marks as not to be
        split), then the whole model (embeddings, final norm, tied head); and each of
        `others` (the critic's value head) as a model of its own."""
        from torch.distributed.fsdp import fully_shard

        block_classes = set(getattr(model, "_no_split_modules", None) or [])
        blocks = [m for m in model.modules() if type(m).__name__ in block_classes]
        if not blocks:
            raise errors.InvalidArgument(
                f"data_parallel 'fsdp2': {type(model).__name__} names no transformer block class (_no_split_modules)"
            )
        for block in blocks:
            fully_shard(block)
        fully_shard(model)
        for other in others:
            if other is not None:
                fully_shard(other)

    # ------------------------------------------------------------ the batch

    def micro_chunks(self, indices: Sequence[int], size: int) -> list[list[int]]:
        """This rank's contiguous share of `indices`, cut into micro-batches of at most
        `size`: as many on every rank (some possibly empty)."""
        if not indices:
            return []
        share = [indices[i] for i in _split_evenly(len(indices), self.world)[self.rank]]
        count = math.ceil(math.ceil(len(indices) / self.world) / size)
        return [[share[i] for i in part] for part in _split_evenly(len(share), count)]

    # ------------------------------------------------------------ collectives

    def sum(self, tensor: Tensor) -> Tensor:
        """The element-wise sum over ranks (in place)."""
        if self.world > 1:
            dist.all_reduce(tensor)
        return tensor

    def full(self, tensor: Tensor) -> Tensor:
        """A sharded parameter (DTensor) gathered whole; a plain tensor as it is."""
        full_tensor = getattr(tensor, "full_tensor", None)
        return full_tensor() if full_tensor is not None else tensor

    def to_float(self, value: Tensor) -> float:
        return float(self.full(value))

    def reduce_totals(self, totals):
        """Metrics sums (batches.Totals) added up over ranks: each rank's losses are its
        share of the batch's, its token sums those of its own tokens."""
        if self.world == 1:
            return totals
        step_keys, token_keys = sorted(totals.per_step), sorted(totals.per_token)
        packed = torch.tensor(
            [totals.tokens] + [totals.per_step[k] for k in step_keys] + [totals.per_token[k] for k in token_keys],
            dtype=torch.float64,
            device="cuda" if dist.get_backend() == "nccl" else "cpu",
        )
        dist.all_reduce(packed)
        values = packed.tolist()
        totals.tokens = values[0]
        totals.per_step = dict(zip(step_keys, values[1 : 1 + len(step_keys)]))
        totals.per_token = dict(zip(token_keys, values[1 + len(step_keys) :]))
        return totals

    # ------------------------------------------------------------ checkpoints

    def full_state_dict(self, model: nn.Module) -> dict[str, Tensor]:
        """model.state_dict() with every sharded tensor gathered whole (a collective: every
        rank calls it); tied weights stay one tensor, as save_pretrained expects."""
        if self.mode == "none":
            return model.state_dict()
        gathered: dict[tuple, Tensor] = {}
        out = {}
        for name, value in model.state_dict().items():
            local = value.to_local() if hasattr(value, "to_local") else value
            key = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(value.shape))
            if key not in gathered:
                gathered[key] = self.full(value)
            out[name] = gathered[key]
        return out

    def optimizer_state(self, modules: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """The optimizer's state_dict(); sharded, the full state keyed by parameter name
        (torch.distributed.checkpoint), on rank 0 (others get an empty one)."""
        if self.mode == "none":
            return optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(
            modules, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )

    def load_optimizer_state(
        self, modules: nn.Module, optimizer: torch.optim.Optimizer, state: dict, by_name: bool
    ) -> None:
        """Load what optimizer_state saved, sharded or not, into this (sharded or not) model's optimizer."""
        if not by_name:
            if self.mode != "none":
                raise errors.InvalidArgument(
                    "this checkpoint was written by one process: resume it with data_parallel 'none', or train from "
                    "its weights alone by pointing model_path at a copy without optimizer.pt"
                )
            optimizer.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(modules, optimizer, state, options=StateDictOptions(full_state_dict=True))
