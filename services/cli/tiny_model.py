"""A tiny Hugging Face causal LM and character-level tokenizer, built from local code
only (no downloads), saved as an ordinary HF checkpoint directory. The demo and the tests
use it; every service loads a user's own local checkpoint directory the same way."""

from __future__ import annotations

import string
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from rlmesh.common.model_building import build_hf_model

PAD, EOS, UNK = "<pad>", "</s>", "<unk>"
CHARS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]

# A chat template so chat-formatted datasets work with the tiny model too.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] | upper }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}A: {% endif %}"
)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {PAD: 0, EOS: 1, UNK: 2}
    for c in CHARS:
        vocab.setdefault(c, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK, clean_up_tokenization_spaces=False
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(
    out_dir: str | Path,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    max_positions: int = 256,
    seed: int = 0,
) -> Path:
    """Write a randomly initialised Llama-architecture model and its tokenizer to out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 4,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_positions,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = build_hf_model(LlamaForCausalLM, config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
