"""Tiny Llama and Qwen2 models built from a config, for the megatron backend's tests."""

from __future__ import annotations

from pathlib import Path

import torch


def build_model(family: str, path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    # 4 query heads over 2 KV groups (GQA); vocabulary 37 is not a multiple of TP (padded).
    dims = dict(
        vocab_size=37,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    if family == "llama":
        model = LlamaForCausalLM(
            LlamaConfig(
                tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, **dims
            )
        )
    else:
        model = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=True, **dims))
        with torch.no_grad():  # random QKV biases, so that a mix-up shows
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.1)
    model.save_pretrained(path)
    return path
