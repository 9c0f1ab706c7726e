"""HF <-> megatron weight conversion as plain tensor functions (no process group), the
model checks of the megatron backend, and the run config's backend settings."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from transformers import LlamaConfig, MistralConfig, Qwen2Config

from rlmesh.common import errors
from rlmesh.common.run_config import TrainerRunConfig
from rlmesh.trainer.megatron.conversion import hf_names, hf_shape, megatron_shards, units, unshard
from rlmesh.trainer.megatron.layout import hf_layout

DIMS = dict(
    vocab_size=37,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=4,
)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)])
def test_megatron_shards_put_back_together_give_the_hf_tensors(tp, pp, tied):
    layout = hf_layout(Qwen2Config(tie_word_embeddings=tied, **DIMS), tp, pp)
    torch.manual_seed(0)
    hf = {name: torch.randn(hf_shape(layout, name)) for name in hf_names(layout)}
    shards = {(t, s): megatron_shards(layout, hf.__getitem__, t, tp, s, pp) for t in range(tp) for s in range(pp)}

    rebuilt = {}
    for unit in units(layout, pp):
        parts = [shards[(t, unit.stage)][unit.local] for t in range(tp)]
        assert len({p.shape for p in parts}) == 1  # TP ranks hold equal shards
        rebuilt.update(zip(unit.hf, unshard(unit, layout, parts), strict=True))
    assert set(rebuilt) == set(hf)
    for name, tensor in hf.items():
        assert torch.equal(rebuilt[name], tensor), name
    if tied and pp > 1:  # the last stage's copy of the tied embedding is the embedding
        last = torch.cat([shards[(t, pp - 1)]["output_layer.weight"] for t in range(tp)])[: layout.vocab]
        assert torch.equal(last, hf["model.embed_tokens.weight"])


def test_fused_qkv_is_grouped_by_kv_head():
    """Megatron's linear_qkv rows: for each KV group, its query heads, then its key, then
    its value (a rank of TP holds whole groups)."""
    layout = hf_layout(LlamaConfig(**{**DIMS, "num_attention_heads": 4, "num_key_value_heads": 2}), 1, 1)
    d = layout.head_dim
    hf = {name: torch.zeros(hf_shape(layout, name)) for name in hf_names(layout)}
    q, k, v = (hf[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    for head in range(4):
        q[head * d : (head + 1) * d] = 10 + head
    for group in range(2):
        k[group * d : (group + 1) * d] = 20 + group
        v[group * d : (group + 1) * d] = 30 + group
    fused = megatron_shards(layout, hf.__getitem__, 0, 1, 0, 1)["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert fused[::d, 0].tolist() == [10, 11, 20, 30, 12, 13, 21, 31]


def test_models_the_backend_cannot_convert_are_refused_with_the_reason():
    with pytest.raises(errors.InvalidArgument, match="builds llama, qwen2 models; model_path holds a 'mistral'"):
        hf_layout(MistralConfig(**DIMS), 1, 1)
    with pytest.raises(
        errors.InvalidArgument, match=r"num_key_value_heads \(4\) is not a multiple of tensor_parallel_size \(8\)"
    ):
        hf_layout(LlamaConfig(**DIMS), 8, 1)
    with pytest.raises(
        errors.InvalidArgument, match=r"num_hidden_layers \(4\) is not a multiple of pipeline_parallel_size \(3\)"
    ):
        hf_layout(LlamaConfig(**DIMS), 1, 3)
    with pytest.raises(errors.InvalidArgument, match="rope_type 'llama3'"):
        hf_layout(
            LlamaConfig(
                rope_parameters={
                    "rope_type": "llama3",
                    "rope_theta": 5e5,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
                **DIMS,
            ),
            1,
            1,
        )
    assert hf_layout(LlamaConfig(**DIMS), 4, 1).padded_vocab == 40  # vocabulary padded to a multiple of TP


def test_run_config_parallel_sizes_need_the_megatron_backend():
    assert TrainerRunConfig(model_path="m").backend == "torch"
    config = TrainerRunConfig(model_path="m", backend="megatron", tensor_parallel_size=2, pipeline_parallel_size=2)
    assert (config.tensor_parallel_size, config.pipeline_parallel_size) == (2, 2)
    with pytest.raises(ValidationError, match="need backend 'megatron'"):
        TrainerRunConfig(model_path="m", tensor_parallel_size=2)
    with pytest.raises(ValidationError, match="backend"):
        TrainerRunConfig(model_path="m", backend="deepspeed")


@pytest.mark.parametrize(
    "feature, refused",
    [
        ({"lora": {"rank": 4}}, "lora"),
        ({"data_parallel": "fsdp2"}, "data_parallel 'fsdp2'"),
        ({"algorithm": {"advantage_estimator": "gae"}}, "advantage_estimator 'gae' \\(a critic\\)"),
    ],
)
def test_the_megatron_backend_refuses_the_torch_backends_features(feature, refused):
    # The megatron backend trains the whole model on its own ranks: LoRA, FSDP2 and a critic
    # are the torch backend's, refused at validation rather than silently ignored.
    TrainerRunConfig(model_path="m", **feature)  # fine with the torch backend
    with pytest.raises(ValidationError, match=f"backend 'megatron' does not support {refused}"):
        TrainerRunConfig(model_path="m", backend="megatron", **feature)
