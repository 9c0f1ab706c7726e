"""Weight conversion between Hugging Face names and megatron's layout (fused QKV, fused
gate/up, vocabulary-sharded embeddings), in both directions: the name table (units: one
megatron parameter of one pipeline stage and the HF tensors it holds), this rank's shards
from HF tensors read by name (megatron_shards, HFCheckpoint), and the full HF tensors
from every rank's shards (gather_hf, a collective). Everything but gather_hf is plain
tensor code, checked without a process group (tests/unit/test_megatron_conversion.py)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from rlmesh.common import errors
from rlmesh.trainer.megatron.layout import HFLayout


@dataclass(frozen=True)
class Unit:
    """One megatron parameter of one pipeline stage and the HF tensors it holds."""

    stage: int
    local: str  # megatron name within the stage's model
    hf: tuple[str, ...]
    kind: str  # how TP shards split: qkv, fc1, rows, cols, vocab, replicated


def units(layout: HFLayout, pp: int) -> list[Unit]:
    """The name table: every megatron parameter, by pipeline stage, and the HF tensors it holds."""
    per_stage = layout.num_layers // pp
    out = [Unit(0, "embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab")]
    for layer in range(layout.num_layers):
        stage, i = divmod(layer, per_stage)
        hf, mg = f"model.layers.{layer}.", f"decoder.layers.{i}."
        attn = [hf + f"self_attn.{p}_proj" for p in "qkv"]
        out.append(Unit(stage, mg + "self_attention.linear_qkv.weight", tuple(a + ".weight" for a in attn), "qkv"))
        if layout.qkv_bias:
            out.append(Unit(stage, mg + "self_attention.linear_qkv.bias", tuple(a + ".bias" for a in attn), "qkv"))
        out += [
            Unit(stage, mg + "self_attention.linear_proj.weight", (hf + "self_attn.o_proj.weight",), "cols"),
            Unit(stage, mg + "mlp.linear_fc1.weight", (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"), "fc1"),
            Unit(stage, mg + "mlp.linear_fc2.weight", (hf + "mlp.down_proj.weight",), "cols"),
            Unit(stage, mg + "input_layernorm.weight", (hf + "input_layernorm.weight",), "replicated"),
            Unit(stage, mg + "pre_mlp_layernorm.weight", (hf + "post_attention_layernorm.weight",), "replicated"),
        ]
    out.append(Unit(pp - 1, "decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"))
    if not layout.tied:
        out.append(Unit(pp - 1, "output_layer.weight", ("lm_head.weight",), "vocab"))
    return out


def hf_names(layout: HFLayout) -> list[str]:
    """The HF parameter names in the order a transformers model lists them (tied
    weights once, as the input embedding)."""
    names = ["model.embed_tokens.weight"]
    for layer in range(layout.num_layers):
        p = f"model.layers.{layer}."
        for proj in "qkv":
            names.append(p + f"self_attn.{proj}_proj.weight")
            if layout.qkv_bias:
                names.append(p + f"self_attn.{proj}_proj.bias")
        names += [
            p + "self_attn.o_proj.weight",
            p + "mlp.gate_proj.weight",
            p + "mlp.up_proj.weight",
            p + "mlp.down_proj.weight",
            p + "input_layernorm.weight",
            p + "post_attention_layernorm.weight",
        ]
    names.append("model.norm.weight")
    if not layout.tied:
        names.append("lm_head.weight")
    return names


def hf_shape(layout: HFLayout, name: str) -> tuple[int, ...]:
    h, q, kv = layout.hidden, layout.heads * layout.head_dim, layout.kv_heads * layout.head_dim
    last = name.rsplit(".", 2)[-2]
    bias = name.endswith(".bias")
    shapes = {
        "embed_tokens": (layout.vocab, h),
        "lm_head": (layout.vocab, h),
        "q_proj": (q,) if bias else (q, h),
        "k_proj": (kv,) if bias else (kv, h),
        "v_proj": (kv,) if bias else (kv, h),
        "o_proj": (h, q),
        "gate_proj": (layout.ffn, h),
        "up_proj": (layout.ffn, h),
        "down_proj": (h, layout.ffn),
    }
    return shapes.get(last, (h,))  # norms


def _shard(unit: Unit, layout: HFLayout, hf: list[Tensor], tp_rank: int, tp: int) -> Tensor:
    """This TP rank's shard of a megatron parameter from its HF tensors."""
    if unit.kind == "qkv":
        # Megatron interleaves by query group: [q heads of group g, k of g, v of g] ...
        g, d = layout.kv_heads, layout.head_dim
        q, k, v = hf
        rest = q.shape[1:]
        fused = torch.cat([q.reshape(g, -1, d, *rest), k.reshape(g, 1, d, *rest), v.reshape(g, 1, d, *rest)], dim=1)
        return fused.chunk(tp, dim=0)[tp_rank].reshape(-1, *rest)
    if unit.kind == "fc1":  # each rank holds [its rows of gate; its rows of up]
        gate, up = hf
        return torch.cat([gate.chunk(tp)[tp_rank], up.chunk(tp)[tp_rank]])
    if unit.kind == "vocab":
        (w,) = hf
        w = torch.cat([w, w.new_zeros(layout.padded_vocab - layout.vocab, *w.shape[1:])])
        return w.chunk(tp)[tp_rank]
    if unit.kind == "cols":
        return hf[0].chunk(tp, dim=1)[tp_rank]
    return hf[0]


def unshard(unit: Unit, layout: HFLayout, shards: list[Tensor]) -> list[Tensor]:
    """The HF tensors of a megatron parameter from its TP shards (in TP rank order)."""
    if unit.kind == "qkv":
        g, d = layout.kv_heads, layout.head_dim
        fused = torch.cat(shards)
        rest = fused.shape[1:]
        fused = fused.reshape(g, -1, d, *rest)
        q = fused[:, :-2].reshape(-1, *rest)
        return [q, fused[:, -2].reshape(-1, *rest), fused[:, -1].reshape(-1, *rest)]
    if unit.kind == "fc1":
        halves = [s.chunk(2) for s in shards]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    if unit.kind == "vocab":
        return [torch.cat(shards)[: layout.vocab]]
    if unit.kind == "cols":
        return [torch.cat(shards, dim=1)]
    return [shards[0]]


def megatron_shards(
    layout: HFLayout, read: Callable[[str], Tensor], tp_rank: int, tp: int, pp_rank: int, pp: int
) -> dict[str, Tensor]:
    """This rank's megatron tensors (local names) from HF tensors, read by name."""
    out = {}
    for unit in units(layout, pp):
        if unit.stage == pp_rank:
            out[unit.local] = _shard(unit, layout, [read(n) for n in unit.hf], tp_rank, tp)
    if layout.tied and pp_rank == pp - 1 and pp > 1:  # the last stage's copy of the shared embedding
        out["output_layer.weight"] = _shard(
            units(layout, pp)[0], layout, [read("model.embed_tokens.weight")], tp_rank, tp
        )
    return out


def gather_hf(layout: HFLayout, local: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Collective over all ranks: the full HF tensors from every rank's megatron tensors
    (`local`, by local name): TP shards gathered within each stage, stages sent to global
    rank 0. Returns them (CPU, in HF order) on rank 0, {} elsewhere."""
    from megatron.core import parallel_state as ps

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    pp, pp_rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    tp_group = ps.get_tensor_model_parallel_group()
    pp_ranks = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
    rank = dist.get_rank()
    out: dict[str, Tensor] = {}
    for unit in units(layout, pp):
        if unit.stage == pp_rank:
            shard = local[unit.local].detach().contiguous()
            shards = [torch.empty_like(shard) for _ in range(tp)]
            dist.all_gather(shards, shard, group=tp_group)
            if tp_rank == 0:
                for name, tensor in zip(unit.hf, unshard(unit, layout, shards), strict=True):
                    tensor = tensor.to("cpu", copy=True).contiguous()
                    if rank == 0:
                        out[name] = tensor
                    else:
                        dist.send(tensor, dst=pp_ranks[0])
        elif rank == 0:  # the owner is another stage's first TP rank
            for name in unit.hf:
                out[name] = torch.empty(hf_shape(layout, name), dtype=_dtype_of(local))
                dist.recv(out[name], src=pp_ranks[unit.stage])
    return {name: out[name] for name in hf_names(layout)} if rank == 0 else {}


def _dtype_of(local: Mapping[str, Tensor]) -> torch.dtype:
    return next(iter(local.values())).dtype


class HFCheckpoint:
    """Reads the tensors of a local HF checkpoint (safetensors) by name, without loading
    the whole of it."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise errors.InvalidArgument(f"backend 'megatron': {str(path)!r} holds no *.safetensors weights")
        self._where: dict[str, object] = {}
        for f in files:
            handle = safe_open(str(f), framework="pt")
            for name in handle.keys():  # noqa: SIM118 (a safetensors handle is not a dict)
                self._where[name] = handle

    def __call__(self, name: str) -> Tensor:
        if name not in self._where:
            raise errors.InvalidArgument(f"backend 'megatron': the checkpoint has no tensor {name!r}")
        return self._where[name].get_tensor(name).float()
