"""MegatronBackend: the run's model as a megatron-core GPTModel, with tensor (TP) and
pipeline (PP) parallelism, trained by the same step as TorchBackend.

It is TorchBackend with the model swapped: batches, the RL and SFT losses and every
metric come from backend.py and algorithms.py unchanged; this module only builds the
model, runs its forward/backward across the ranks, and converts weights between Hugging
Face names and megatron's layout (fused QKV, fused gate/up, vocabulary-sharded
embeddings) in both directions, so that weight pushes and checkpoints carry the same HF
names and shapes as TorchBackend's and engines cannot tell the backends apart.

Ranks: world size = TP x PP (no data parallelism), megatron's rank order (TP fastest).
Every rank runs every call with the same arguments (rlmesh.trainer.ranks delivers them
from rank 0, which serves gRPC). Pipeline stages run one micro-batch at a time: stage k
receives the hidden states from stage k-1, runs its layers and sends them on; the last
stage takes the loss (the shared formulas) and the gradient flows back the same way. No
overlap between stages: simple and exact, which is what the CPU/gloo use needs; a GPU
deployment that wants the 1F1B schedule would plug megatron's own schedules in here.

Numerics: the logits of a step are gathered over the TP ranks (full vocabulary on every
rank) before the loss, so the formulas see exactly what TorchBackend's see. That costs
b x L x V floats per micro-batch per rank; a vocab-parallel log-softmax would avoid it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from rlmesh.common import errors
from rlmesh.common.net import free_port
from rlmesh.common.run_config import TrainerRunConfig
from rlmesh.trainer import megatron_cpu
from rlmesh.trainer.backend import TorchBackend
from rlmesh.trainer.batches import MicroBatch, token_log_probs
from rlmesh.trainer.checkpoints import (
    OPTIMIZER_FILE,
    RNG_FILE,
    CheckpointSnapshot,
    copy_model_extras,
    cpu_copy,
    rng_state,
    set_rng_state,
)

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


# --------------------------------------------------------------------------------------
# The model from a Hugging Face config
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HFLayout:
    """What of a Hugging Face Llama/Qwen2 config decides the megatron model and the
    weight conversion."""

    model_type: str
    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    padded_vocab: int  # rows of megatron's embedding: a multiple of TP
    eps: float
    rope_theta: float
    max_positions: int
    tied: bool
    qkv_bias: bool
    pad_token_id: int


def hf_layout(hf_config, tp: int, pp: int) -> HFLayout:
    """Check that the model is one this backend converts exactly, and at these sizes."""
    kind = hf_config.model_type
    if kind not in SUPPORTED_MODEL_TYPES:
        raise errors.InvalidArgument(
            f"backend 'megatron' builds {', '.join(SUPPORTED_MODEL_TYPES)} models; model_path holds a {kind!r} "
            "model (use backend 'torch')"
        )
    rope = getattr(hf_config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise errors.InvalidArgument(f"backend 'megatron': rope_type {rope.get('rope_type')!r} is not supported (only 'default')")
    if getattr(hf_config, "mlp_bias", False) or (kind == "llama" and getattr(hf_config, "attention_bias", False)):
        raise errors.InvalidArgument("backend 'megatron': Llama models with attention_bias or mlp_bias are not supported")
    if getattr(hf_config, "use_sliding_window", False):
        raise errors.InvalidArgument("backend 'megatron': sliding-window attention is not supported")
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads or hf_config.num_attention_heads
    layers = hf_config.num_hidden_layers
    for what, n, size in (("num_attention_heads", heads, tp), ("num_key_value_heads", kv_heads, tp),
                          ("num_hidden_layers", layers, pp)):
        if n % size:
            name = "tensor_parallel_size" if size == tp and what != "num_hidden_layers" else "pipeline_parallel_size"
            raise errors.InvalidArgument(f"backend 'megatron': the model's {what} ({n}) is not a multiple of {name} ({size})")
    pad = hf_config.pad_token_id
    return HFLayout(
        model_type=kind,
        num_layers=layers,
        hidden=hf_config.hidden_size,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        ffn=hf_config.intermediate_size,
        vocab=hf_config.vocab_size,
        padded_vocab=-(-hf_config.vocab_size // tp) * tp,
        eps=hf_config.rms_norm_eps,
        rope_theta=float(rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))),
        max_positions=hf_config.max_position_embeddings,
        tied=bool(hf_config.tie_word_embeddings),
        qkv_bias=kind == "qwen2",
        pad_token_id=int(pad) if pad is not None else 0,
    )


def build_model(layout: HFLayout, tp: int, pp: int, device: torch.device):
    """This rank's part of the GPTModel (its pipeline stage, its TP shard), weights
    uninitialised (they are loaded from a checkpoint next)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=layout.num_layers,
        hidden_size=layout.hidden,
        num_attention_heads=layout.heads,
        num_query_groups=layout.kv_heads,
        kv_channels=layout.head_dim,
        ffn_hidden_size=layout.ffn,
        normalization="RMSNorm",
        layernorm_epsilon=layout.eps,
        gated_linear_unit=True,  # SwiGLU
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=layout.qkv_bias,
        # The trainer runs without dropout (the importance ratio of a step's first pass must be 1).
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        perform_initialization=False,
        # The fused kernels are CUDA-only; these paths are plain torch everywhere.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        attention_softmax_in_fp32=True,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=layout.padded_vocab,
        max_sequence_length=layout.max_positions,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,  # gathered by _gather_vocab, whose backward suits a loss every TP rank computes
        # Across stages the tied embedding is two parameters kept equal by the trainer (see
        # MegatronBackend._tied_embedding): megatron's own set-up of that pair is CUDA-only.
        share_embeddings_and_output_weights=layout.tied and pp == 1,
        position_embedding_type="rope",
        rotary_base=layout.rope_theta,
    )
    return model.to(device).eval()


# --------------------------------------------------------------------------------------
# Weight conversion: Hugging Face names <-> megatron's layout
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Unit:
    """One megatron parameter of one pipeline stage and the HF tensors it holds."""

    stage: int
    local: str  # megatron name within the stage's model
    hf: tuple[str, ...]
    kind: str  # how TP shards split: qkv, fc1, rows, cols, vocab, replicated


def _units(layout: HFLayout, pp: int) -> list[_Unit]:
    per_stage = layout.num_layers // pp
    units = [_Unit(0, "embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab")]
    for layer in range(layout.num_layers):
        stage, i = divmod(layer, per_stage)
        hf, mg = f"model.layers.{layer}.", f"decoder.layers.{i}."
        attn = [hf + f"self_attn.{p}_proj" for p in "qkv"]
        units.append(_Unit(stage, mg + "self_attention.linear_qkv.weight", tuple(a + ".weight" for a in attn), "qkv"))
        if layout.qkv_bias:
            units.append(_Unit(stage, mg + "self_attention.linear_qkv.bias", tuple(a + ".bias" for a in attn), "qkv"))
        units += [
            _Unit(stage, mg + "self_attention.linear_proj.weight", (hf + "self_attn.o_proj.weight",), "cols"),
            _Unit(stage, mg + "mlp.linear_fc1.weight", (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"), "fc1"),
            _Unit(stage, mg + "mlp.linear_fc2.weight", (hf + "mlp.down_proj.weight",), "cols"),
            _Unit(stage, mg + "input_layernorm.weight", (hf + "input_layernorm.weight",), "replicated"),
            _Unit(stage, mg + "pre_mlp_layernorm.weight", (hf + "post_attention_layernorm.weight",), "replicated"),
        ]
    units.append(_Unit(pp - 1, "decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"))
    if not layout.tied:
        units.append(_Unit(pp - 1, "output_layer.weight", ("lm_head.weight",), "vocab"))
    return units


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
        names += [p + "self_attn.o_proj.weight", p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight",
                  p + "mlp.down_proj.weight", p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    names.append("model.norm.weight")
    if not layout.tied:
        names.append("lm_head.weight")
    return names


def _hf_shape(layout: HFLayout, name: str) -> tuple[int, ...]:
    h, q, kv = layout.hidden, layout.heads * layout.head_dim, layout.kv_heads * layout.head_dim
    last = name.rsplit(".", 2)[-2]
    bias = name.endswith(".bias")
    shapes = {
        "embed_tokens": (layout.vocab, h), "lm_head": (layout.vocab, h),
        "q_proj": (q,) if bias else (q, h), "k_proj": (kv,) if bias else (kv, h), "v_proj": (kv,) if bias else (kv, h),
        "o_proj": (h, q), "gate_proj": (layout.ffn, h), "up_proj": (layout.ffn, h), "down_proj": (h, layout.ffn),
    }
    return shapes.get(last, (h,))  # norms


def _shard(unit: _Unit, layout: HFLayout, hf: list[Tensor], tp_rank: int, tp: int) -> Tensor:
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


def _unshard(unit: _Unit, layout: HFLayout, shards: list[Tensor]) -> list[Tensor]:
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


def megatron_shards(layout: HFLayout, read: Callable[[str], Tensor], tp_rank: int, tp: int, pp_rank: int, pp: int) -> dict[str, Tensor]:
    """This rank's megatron tensors (local names) from HF tensors, read by name."""
    out = {}
    for unit in _units(layout, pp):
        if unit.stage == pp_rank:
            out[unit.local] = _shard(unit, layout, [read(n) for n in unit.hf], tp_rank, tp)
    if layout.tied and pp_rank == pp - 1 and pp > 1:  # the last stage's copy of the shared embedding
        out["output_layer.weight"] = _shard(_units(layout, pp)[0], layout, [read("model.embed_tokens.weight")], tp_rank, tp)
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
    for unit in _units(layout, pp):
        if unit.stage == pp_rank:
            shard = local[unit.local].detach().contiguous()
            shards = [torch.empty_like(shard) for _ in range(tp)]
            dist.all_gather(shards, shard, group=tp_group)
            if tp_rank == 0:
                for name, tensor in zip(unit.hf, _unshard(unit, layout, shards), strict=True):
                    tensor = tensor.to("cpu", copy=True).contiguous()
                    if rank == 0:
                        out[name] = tensor
                    else:
                        dist.send(tensor, dst=pp_ranks[0])
        elif rank == 0:  # the owner is another stage's first TP rank
            for name in unit.hf:
                out[name] = torch.empty(_hf_shape(layout, name), dtype=_dtype_of(local))
                dist.recv(out[name], src=pp_ranks[unit.stage])
    return {name: out[name] for name in hf_names(layout)} if rank == 0 else {}


def _dtype_of(local: Mapping[str, Tensor]) -> torch.dtype:
    return next(iter(local.values())).dtype


class _HFCheckpoint:
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


# --------------------------------------------------------------------------------------
# Process groups
# --------------------------------------------------------------------------------------


def init_parallel(tp: int, pp: int, device: torch.device) -> None:
    """torch.distributed (gloo on CPU, NCCL on GPU) and megatron's TP/PP groups. Under
    torchrun the world is its processes; a lone process (TP = PP = 1) makes a world of one."""
    from megatron.core import parallel_state, tensor_parallel

    megatron_cpu.apply()
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
        if (parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_pipeline_model_parallel_world_size()) == (tp, pp):
            return
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(1234)


class _GatherVocab(torch.autograd.Function):
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


# --------------------------------------------------------------------------------------
# The backend
# --------------------------------------------------------------------------------------


class MegatronBackend(TorchBackend):
    def __init__(
        self,
        config: TrainerRunConfig,
        device: torch.device,
        mixed_precision: bool = True,
        resume_from: Path | None = None,
    ) -> None:
        from megatron.core import parallel_state as ps
        from transformers import AutoConfig

        self.tp, self.pp = config.tensor_parallel_size, config.pipeline_parallel_size
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
        init_parallel(self.tp, self.pp, device)
        self._ps = ps
        self.tp_rank, self.pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        self.first_stage, self.last_stage = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        path = Path(config.model_path)
        try:
            self.hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise errors.InvalidArgument(f"model_path: cannot read a Hugging Face config from {str(path)!r}: {e}") from None
        self.layout = hf_layout(self.hf_config, self.tp, self.pp)
        # The global rank of this TP rank's last pipeline stage: log-probs and the metrics of a
        # step are taken there and broadcast over the pipeline group.
        self._last_stage_rank = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())[-1]
        self._tp_sharded = {u.local: u.kind != "replicated" for u in _units(self.layout, self.pp) if u.stage == self.pp_rank}
        self._tp_sharded["output_layer.weight"] = True  # also the last stage's copy of a tied embedding
        super().__init__(config, device, mixed_precision, resume_from)

    # ---------------------------------------------------------------- model

    def _load_model(self, path: str, what: str):
        if not Path(path).is_dir():
            raise errors.InvalidArgument(f"{what}: {path!r} is not a directory (a local Hugging Face checkpoint)")
        model = build_model(self.layout, self.tp, self.pp, self.device)
        shards = megatron_shards(self.layout, _HFCheckpoint(Path(path)), self.tp_rank, self.tp, self.pp_rank, self.pp)
        params = dict(model.named_parameters())
        if set(params) != set(shards):
            raise RuntimeError(f"megatron parameters {sorted(set(params) ^ set(shards))} have no conversion")
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(shards[name])
        return model

    def _token_space(self) -> tuple[int, int]:
        return self.layout.pad_token_id, self.layout.vocab

    # ---------------------------------------------------------------- forward/backward over the stages

    def _stage_forward(self, model, mb: MicroBatch, grad: bool) -> tuple[Tensor | None, Tensor | None]:
        """This stage's forward of `mb`: (its input from the previous stage or None, its
        output: hidden states [L, b, h] sent on, or on the last stage the response logits)."""
        ids = mb.input_ids
        b, length = ids.shape
        received = None
        if not self.first_stage:
            received = torch.empty(length, b, self.layout.hidden, device=self.device)
            dist.recv(received, src=self._ps.get_pipeline_model_parallel_prev_rank())
            received.requires_grad_(grad)
        model.set_input_tensor(received)
        positions = torch.arange(length, device=self.device).unsqueeze(0).expand(b, -1)
        # Causal (True = hidden), given rather than megatron's default, which is made on "cuda".
        # Right padding needs nothing more: no real token attends to a later pad.
        causal = torch.ones(length, length, dtype=torch.bool, device=self.device).triu(1)[None, None]
        with self._autocast():
            out = model(input_ids=ids, position_ids=positions, attention_mask=causal)
        if not self.last_stage:
            dist.send(out.detach().contiguous(), dst=self._ps.get_pipeline_model_parallel_next_rank())
            return received, out
        logits = out.float()  # [b, L, V / TP]
        if self.tp > 1:
            logits = _GatherVocab.apply(logits, self._ps.get_tensor_model_parallel_group())
        logits = logits[..., : self.layout.vocab]
        index = mb.logit_index.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
        return received, logits.gather(1, index) / self.temperature

    def _backward(self, model, mb: MicroBatch, loss_of: Callable[..., Tensor], values: bool = False) -> None:
        if values:  # refused with the run config (TrainingConfig): no critic on a megatron model
            raise NotImplementedError("backend 'megatron' has no critic")
        received, out = self._stage_forward(model, mb, grad=True)
        if self.last_stage:
            loss_of(out).backward()
        else:
            grad = torch.empty_like(out)
            dist.recv(grad, src=self._ps.get_pipeline_model_parallel_next_rank())
            out.backward(grad)
        if received is not None:
            dist.send(received.grad.contiguous(), dst=self._ps.get_pipeline_model_parallel_prev_rank())

    @torch.no_grad()
    def _response_log_probs(self, model, mb: MicroBatch) -> Tensor:
        """Log-probs [b, R] of the response tokens, on every rank (taken on the last stage)."""
        _, out = self._stage_forward(model, mb, grad=False)
        log_probs = token_log_probs(out, mb.targets) if self.last_stage else torch.empty(mb.targets.shape, device=self.device)
        dist.broadcast(log_probs, src=self._last_stage_rank, group=self._ps.get_pipeline_model_parallel_group())
        return log_probs

    def _response_logits(self, model, mb: MicroBatch) -> Tensor:
        if self.pp > 1:
            raise NotImplementedError("with pipeline stages, logits exist on the last stage only")
        return self._stage_forward(model, mb, grad=torch.is_grad_enabled())[1]

    # ---------------------------------------------------------------- gradients and steps

    def _tied_embedding(self) -> Tensor | None:
        """With tied embeddings over several stages, this stage's copy of them (the first
        stage's input embedding, the last stage's output layer), else None."""
        if not (self.layout.tied and self.pp > 1):
            return None
        if self.first_stage:
            return self.policy.embedding.word_embeddings.weight
        return self.policy.output_layer.weight if self.last_stage else None

    def _counted_once(self, name: str, param: Tensor) -> bool:
        """Whether this rank's copy of a parameter counts in the global gradient norm:
        TP-replicated parameters (norms) count on TP rank 0 only; the last stage's copy of
        a tied embedding not at all. (From the conversion table: megatron marks its
        sharded parameters only when it initialises them itself.)"""
        if self.last_stage and not self.first_stage and param is self._tied_embedding():
            return False
        return self._tp_sharded[name] or self.tp_rank == 0

    def _clip_grad_norm(self, max_norm: float) -> float:
        tied = self._tied_embedding()
        if tied is not None:
            # Both copies of the tied embedding take the sum of both gradients, so they stay equal.
            if tied.grad is None:
                tied.grad = torch.zeros_like(tied)
            dist.all_reduce(tied.grad, group=self._ps.get_embedding_group())
        grads = [p.grad for n, p in self.policy.named_parameters() if p.grad is not None and self._counted_once(n, p)]
        square = torch.zeros((), dtype=torch.float64, device=self.device)
        for g in grads:
            square += g.double().pow(2).sum()
        dist.all_reduce(square, group=self._ps.get_model_parallel_group())
        norm = float(square.sqrt())
        coef = max_norm / (norm + 1e-6)  # as torch.nn.utils.clip_grad_norm_
        if coef < 1:
            for p in self._params:
                if p.grad is not None:
                    p.grad.mul_(coef)
        return norm

    def _from_last_stage(self, metrics: dict[str, float]) -> dict[str, float]:
        """The metrics of the last stage (where the losses are taken), on every rank."""
        if self.pp == 1:
            return metrics
        return broadcast_json(metrics, self._last_stage_rank, self._ps.get_pipeline_model_parallel_group())

    def train_step(self, groups) -> dict[str, float]:
        with self._lock:
            return self._from_last_stage(super().train_step(groups))

    def sft_step(self, groups) -> dict[str, float]:
        with self._lock:
            return self._from_last_stage(super().sft_step(groups))

    # ---------------------------------------------------------------- weights and checkpoints

    def hf_state_dict(self) -> dict[str, Tensor]:
        """Collective: the policy's weights by HF name, full size, on rank 0 ({} elsewhere)."""
        with self._lock:
            return gather_hf(self.layout, dict(self.policy.named_parameters()))

    def state_dict_for_sync(self) -> Iterator[tuple[str, Tensor]]:
        """(HF name, tensor) on rank 0, as TorchBackend's: what engines load. Every rank
        must call it (collective)."""
        yield from self.hf_state_dict().items()

    def _hf_model_for_save(self):
        """A transformers model of the run's config without memory (meta device): the
        writer save_pretrained needs, given the gathered weights as its state dict."""
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(self.hf_config)

    def save_weights(self, path: Path) -> Path:
        """Collective; rank 0 writes a complete HF model directory."""
        weights = self.hf_state_dict()
        if dist.get_rank() == 0:
            path.mkdir(parents=True, exist_ok=True)
            self._hf_model_for_save().save_pretrained(path, state_dict=weights)
            copy_model_extras(Path(self.config.model_path), path)
        return path

    def snapshot(self) -> CheckpointSnapshot:
        """Collective. The checkpoint holds HF-named weights (a complete HF model, loadable
        by either backend) and the AdamW state in HF names too (exp_avg, exp_avg_sq), so a
        run resumes at any TP/PP sizes."""
        with self._lock:
            weights = self.hf_state_dict()
            optimizers = {}
            for name, opt in self._distinct_optimizers().items():
                names = {id(p): n for n, p in self.policy.named_parameters()}
                state = opt.optimizer.state
                moments = {}
                for key in ("exp_avg", "exp_avg_sq"):
                    local = {names[id(p)]: state[p][key] if p in state else torch.zeros_like(p) for p in self._params}
                    moments[key] = gather_hf(self.layout, local)
                adam_step = next((float(s["step"]) for s in state.values()), 0.0)
                optimizers[name] = {
                    "format": "hf_names", "step": adam_step, **moments,
                    "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.optimizer.param_groups],
                    "scheduler": opt.scheduler.state_dict(),
                }
            return CheckpointSnapshot(
                model=self._hf_model_for_save(),
                weights=weights,
                optimizers=cpu_copy(optimizers, {}),
                rng=rng_state(self.device),
                state={"step": self.step, "reference_model_path": self.reference_path, "backend": "megatron"},
                extras_from=Path(self.config.model_path),
            )

    def _resume(self, path: Path, state: dict) -> dict:
        saved = torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
        names = {id(p): n for n, p in self.policy.named_parameters()}
        for name, opt in self._distinct_optimizers().items():
            entry = saved.get(name)
            if entry is None:
                continue
            if entry.get("format") != "hf_names":
                raise errors.InvalidArgument(
                    f"checkpoint {str(path)!r} was written by the torch backend; its optimizer state cannot be "
                    "resumed with backend 'megatron' (start from its model directory instead)"
                )
            moments = {
                key: megatron_shards(self.layout, entry[key].__getitem__, self.tp_rank, self.tp, self.pp_rank, self.pp)
                for key in ("exp_avg", "exp_avg_sq")
            }
            for p in self._params:
                local = names[id(p)]
                opt.optimizer.state[p] = {
                    "step": torch.tensor(entry["step"]),
                    "exp_avg": moments["exp_avg"][local].to(self.device),
                    "exp_avg_sq": moments["exp_avg_sq"][local].to(self.device),
                }
            opt.scheduler.load_state_dict(entry["scheduler"])
        if (path / RNG_FILE).is_file():
            set_rng_state(torch.load(path / RNG_FILE, weights_only=True), self.device)
        self.step = int(state.get("step", 0))
        log.info("resumed from checkpoint %s at step %d (megatron TP=%d PP=%d)", path, self.step, self.tp, self.pp)
        return state


def broadcast_json(value, src: int, group=None):
    """`value` (JSON-able) from rank `src` to every rank of `group`, as bytes in a tensor."""
    data = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8) if dist.get_rank() == src else None
    size = torch.tensor([data.numel() if data is not None else 0], dtype=torch.long)
    dist.broadcast(size, src=src, group=group)
    if data is None:
        data = torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(data, src=src, group=group)
    return json.loads(bytes(data.tolist()).decode()) if dist.get_rank() != src else value
