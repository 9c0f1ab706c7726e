"""The megatron backend's process groups and collectives: torch.distributed and megatron's
TP/PP groups (init_parallel), the TP all-gather of the logits' vocabulary shards
(GatherVocab), and a JSON value sent from one rank to a group (broadcast_json)."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from torch import Tensor

from rlmesh.common import errors
from rlmesh.common.net import free_port
from rlmesh.trainer.megatron import cpu_shims


def init_parallel(tp: int, pp: int, device: torch.device) -> None:
    """torch.distributed (gloo on CPU, NCCL on GPU) and megatron's TP/PP groups. Under
    torchrun the world is its processes; a lone process (TP = PP = 1) makes a world of one."""
    from megatron.core import parallel_state, tensor_parallel

    cpu_shims.apply()
    if not dist.is_initialized():
        if "WORLD_SIZE" in os.environ:
            dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo")
        else:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    world = dist.get_world_size()
    if world != tp * pp:
        raise errors.InvalidArgument(
            f"backend 'megatron': tensor_parallel_size x pipeline_parallel_size = {tp * pp}, but the trainer runs "
            f"{world} rank(s); start it with `torchrun --nproc-per-node {tp * pp} -m rlmesh.cli serve trainer ...`"
        )
    if parallel_state.model_parallel_is_initialized():
        if (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
        ) == (tp, pp):
            return
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(1234)


class GatherVocab(torch.autograd.Function):
    """All-gather the vocabulary shards of the logits over the TP group. Every TP rank
    computes the same loss from the full logits, so the gradient of a shard is the slice
    of the (identical) full gradient: no reduction (torch.distributed.nn's all_gather
    would sum TP copies)."""

    @staticmethod
    def forward(ctx, shard: Tensor, group) -> Tensor:
        ctx.rank, ctx.width = dist.get_rank(group), shard.shape[-1]
        parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, shard.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad[..., ctx.rank * ctx.width : (ctx.rank + 1) * ctx.width].contiguous(), None


def broadcast_json(value, src: int, group=None):
    """`value` (JSON-able) from rank `src` to every rank of `group`, as bytes in a tensor."""
    data = (
        torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8) if dist.get_rank() == src else None
    )
    size = torch.tensor([data.numel() if data is not None else 0], dtype=torch.long)
    dist.broadcast(size, src=src, group=group)
    if data is None:
        data = torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(data, src=src, group=group)
    return json.loads(bytes(data.tolist()).decode()) if dist.get_rank() != src else value
