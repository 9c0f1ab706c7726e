"""The running batch: its KV cache and attention state, and the batched prefill and decode forward passes.

Rows are left-padded to a common length, with an attention mask and explicit position ids.
New rows are prefilled together, then merged into the running batch by left-padding the
shorter cache; finished rows leave at once, and all-padding columns on the left are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from rlmesh.engine.protocol import GenerationRequest


def _cache_tensors(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))  # transformers < 4.54


def _make_cache(tensors: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    return DynamicCache(tensors)


def _left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    if width == 0:
        return t
    shape = list(t.shape)
    shape[dim] = width
    return torch.cat([t.new_zeros(shape), t], dim=dim)


@dataclass
class RunningBatch:
    """Rows decoding together. For each row the cache holds prompt + output[:-1]
    (left-padded to a common length); output[-1] is the next token to feed."""

    rows: list[GenerationRequest]
    cache: DynamicCache
    mask: torch.Tensor  # [rows, cached length], 1 = real token
    positions: torch.Tensor  # [rows], position of the token to feed next
    pending: torch.Tensor  # [rows], the token to feed next

    def merge(self, other: RunningBatch) -> None:
        length, other_length = self.mask.shape[1], other.mask.shape[1]
        width = max(length, other_length)
        merged = []
        for (k1, v1), (k2, v2) in zip(_cache_tensors(self.cache), _cache_tensors(other.cache)):
            k = torch.cat([_left_pad(k1, width - length, 2), _left_pad(k2, width - other_length, 2)], dim=0)
            v = torch.cat([_left_pad(v1, width - length, 2), _left_pad(v2, width - other_length, 2)], dim=0)
            merged.append((k, v))
        self.cache = _make_cache(merged)
        self.mask = torch.cat([_left_pad(self.mask, width - length, 1), _left_pad(other.mask, width - other_length, 1)])
        self.positions = torch.cat([self.positions, other.positions])
        self.pending = torch.cat([self.pending, other.pending])
        self.rows = self.rows + other.rows

    def keep(self, indices: list[int]) -> None:
        """Keep only these rows, then drop the left columns no remaining row uses."""
        index = torch.tensor(indices, dtype=torch.long)
        mask = self.mask[index]
        used = mask.any(dim=0)
        first = int(used.int().argmax()) if bool(used.any()) else mask.shape[1]
        self.cache = _make_cache([(k[index, :, first:], v[index, :, first:]) for k, v in _cache_tensors(self.cache)])
        self.mask = mask[:, first:]
        self.positions = self.positions[index]
        self.pending = self.pending[index]
        self.rows = [self.rows[i] for i in indices]

    def forward(self, model: torch.nn.Module, device: torch.device) -> torch.Tensor:
        """Feed every row its pending token (the cache, mask and positions advance by one);
        returns the logits of the next token, [rows, vocab]."""
        ones = torch.ones((len(self.rows), 1), dtype=self.mask.dtype)
        self.mask = torch.cat([self.mask, ones], dim=1)
        out = model(
            input_ids=self.pending.unsqueeze(1).to(device),
            attention_mask=self.mask.to(device),
            position_ids=self.positions.unsqueeze(1).to(device),
            past_key_values=self.cache,
            use_cache=True,
        )
        self.cache = out.past_key_values
        self.positions = self.positions + 1
        return out.logits[:, -1]


def prefill_forward(
    model: torch.nn.Module,
    sequences: list[list[int]],
    pad_id: int,
    device: torch.device,
    all_logits: bool,
    past: tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, DynamicCache, torch.Tensor]:
    """Run left-padded sequences through the model into a KV cache: a fresh one, or `past`
    (per-layer KV of cached prefixes, left-padded, and their mask) that the sequences
    continue. Returns the logits of the sequences' positions ([rows, width, vocab] with
    all_logits, else only the last position's), the cache and the attention mask over it
    ([rows, past width + width], 1 = real token; a row's padding may sit between its
    cached prefix and its new tokens)."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, seq in enumerate(sequences):
        ids[i, width - len(seq) :] = torch.tensor(seq)
        mask[i, width - len(seq) :] = 1
    cache = DynamicCache()
    if past is not None:
        cache = _make_cache(past[0])
        mask = torch.cat([past[1], mask], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, mask.shape[1] - width :]
    out = model(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        position_ids=positions.to(device),
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=0 if all_logits else 1,
    )
    return out.logits, out.past_key_values, mask


def row_kv(
    cache: DynamicCache, mask: torch.Tensor, row: int, start: int, end: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copies of one row's KV of its real tokens start..end ([1, heads, end - start, dim] per layer)."""
    columns = mask[row].nonzero().squeeze(1)[start:end]
    return [(k[row : row + 1, :, columns], v[row : row + 1, :, columns]) for k, v in _cache_tensors(cache)]
