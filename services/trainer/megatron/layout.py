"""The megatron model from a Hugging Face config: whether a Llama/Qwen2 config is one the
megatron backend converts exactly, at the run's TP/PP sizes (HFLayout, hf_layout), and
this rank's part of the GPTModel built from it (build_model). megatron-core is imported
inside build_model only."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlmesh.common import errors

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


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
        raise errors.InvalidArgument(
            f"backend 'megatron': rope_type {rope.get('rope_type')!r} is not supported (only 'default')"
        )
    if getattr(hf_config, "mlp_bias", False) or (kind == "llama" and getattr(hf_config, "attention_bias", False)):
        raise errors.InvalidArgument(
            "backend 'megatron': Llama models with attention_bias or mlp_bias are not supported"
        )
    if getattr(hf_config, "use_sliding_window", False):
        raise errors.InvalidArgument("backend 'megatron': sliding-window attention is not supported")
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads or hf_config.num_attention_heads
    layers = hf_config.num_hidden_layers
    for what, n, size in (
        ("num_attention_heads", heads, tp),
        ("num_key_value_heads", kv_heads, tp),
        ("num_hidden_layers", layers, pp),
    ):
        if n % size:
            name = "tensor_parallel_size" if size == tp and what != "num_hidden_layers" else "pipeline_parallel_size"
            raise errors.InvalidArgument(
                f"backend 'megatron': the model's {what} ({n}) is not a multiple of {name} ({size})"
            )
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
