"""Prefix sharing: a radix tree of token ids holding their KV cache, and the prefill plan that uses it.

Requests that share a prompt prefix (the n samples of a GRPO group, sent as one request with
n > 1 or as separate requests; the turns of an agent conversation) compute it once:

- In one prefill, rows with the same tokens are computed once and forked (their KV rows copied).
- Across prefills, a row takes the longest prefix the tree holds and computes only the rest.
  Every prefilled sequence is put in the tree, and so is every finished one (prompt + output),
  so an agent's next turn finds its conversation so far.

The tree (SGLang's radix cache, in miniature) is bounded in bytes with LRU eviction of leaves.
KV is copied out of it, never shared with a running batch, so evicting needs no reference
counts. It holds KV of one set of weights: any weight change flushes it (`Engine`), and a
request whose KV began under older weights is not put back.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

# Per layer (keys, values), each [1, kv heads, tokens, head dim].
KV = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(eq=False)
class _Node:
    key: tuple[int, ...]
    kv: KV
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)
    last_used: int = 0

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.kv)


def _common(a: Sequence[int], start: int, b: tuple[int, ...], limit: int) -> int:
    """How many of b's tokens a[start:] starts with (at most limit)."""
    n = min(len(b), len(a) - start, limit)
    i = 0
    while i < n and a[start + i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """Token ids -> their KV, longest-prefix lookup. Used from the engine's worker thread only."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.root = _Node((), [], None)
        self.bytes = 0
        self.tokens = 0
        self.epoch = 0  # bumped by every flush: KV begun under an older epoch is not put back
        self._clock = itertools.count(1)

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def flush(self) -> None:
        self.root = _Node((), [], None)
        self.bytes = self.tokens = 0
        self.epoch += 1

    def match(self, tokens: Sequence[int], limit: int) -> tuple[int, KV]:
        """The longest cached prefix of tokens (at most `limit` long): its length and KV (copies)."""
        node, pos, segments = self.root, 0, []
        now = next(self._clock)
        while pos < limit and self.enabled:
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = _common(tokens, pos, child.key, limit - pos)
            child.last_used = now
            segments.append((child, n))
            pos += n
            if n < len(child.key):
                break
            node = child
        if not segments:
            return 0, []
        layers = len(segments[0][0].kv)
        kv = [
            (
                torch.cat([s.kv[layer][0][:, :, :n] for s, n in segments], dim=2),
                torch.cat([s.kv[layer][1][:, :, :n] for s, n in segments], dim=2),
            )
            for layer in range(layers)
        ]
        return pos, kv

    def insert(self, tokens: Sequence[int], kv_for: Callable[[int, int], KV]) -> None:
        """Put tokens in the tree; kv_for(start, end) gives the KV of tokens[start:end] (only
        the part not cached yet is asked for)."""
        if not self.enabled or not tokens:
            return
        node, pos = self.root, 0
        now = next(self._clock)
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = _common(tokens, pos, child.key, len(tokens))
            child.last_used = now
            if n < len(child.key):
                child = self._split(child, n)
            pos += n
            node = child
        if pos == len(tokens):
            return
        kv = kv_for(pos, len(tokens))
        leaf = _Node(tuple(tokens[pos:]), kv, node, last_used=now)
        if leaf.nbytes > self.max_bytes:
            return  # larger than the whole cache
        node.children[leaf.key[0]] = leaf
        self.bytes += leaf.nbytes
        self.tokens += len(leaf.key)
        self._evict()

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut node's edge after `at` tokens; returns the upper part. Both parts are copied so
        that evicting one frees its memory."""
        upper = _Node(node.key[:at], [(k[:, :, :at].clone(), v[:, :, :at].clone()) for k, v in node.kv], node.parent)
        upper.last_used = node.last_used
        assert node.parent is not None
        node.parent.children[upper.key[0]] = upper
        node.key = node.key[at:]
        node.kv = [(k[:, :, at:].clone(), v[:, :, at:].clone()) for k, v in node.kv]
        node.parent = upper
        upper.children[node.key[0]] = node
        return upper

    def _evict(self) -> None:
        """Least recently used leaves go until the cache fits its bound."""
        if self.bytes <= self.max_bytes:
            return
        leaves = [(n.last_used, id(n), n) for n in self._nodes() if not n.children]
        heapq.heapify(leaves)
        while self.bytes > self.max_bytes and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            self.bytes -= leaf.nbytes
            self.tokens -= len(leaf.key)
            if parent is not self.root and not parent.children:
                heapq.heappush(leaves, (parent.last_used, id(parent), parent))

    def _nodes(self) -> list[_Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out


@dataclass
class PrefillPlan:
    """What one prefill computes: `unique` sequences (rows with the same tokens computed once),
    `row_of[i]`: the unique row request i forks from, and per unique row the cached prefix
    taken from the tree (`cached[u]` tokens, `past[u]` its KV)."""

    unique: list[list[int]]
    row_of: list[int]
    cached: list[int]
    past: list[KV]


def reuse_limit(sequence: list[int], prompt_len: int, return_logprob: bool, logprob_start_len: int) -> int:
    """How much of a sequence may come from the cache: all but its last token (its logits
    choose the next one), and none of the positions whose logits give the prompt
    log-probs asked for (a prompt position's log-prob comes from the previous position)."""
    limit = len(sequence) - 1
    if return_logprob and len(sequence) == prompt_len:  # (a retracted request's were recorded already)
        start = prompt_len - 1 if logprob_start_len < 0 else min(logprob_start_len, prompt_len - 1)
        limit = min(limit, max(start - 1, 0))
    return max(limit, 0)


def plan_prefill(cache: PrefixCache, sequences: list[list[int]], limits: list[int]) -> PrefillPlan:
    rows: dict[tuple[int, ...], int] = {}
    unique: list[list[int]] = []
    unique_limit: list[int] = []
    row_of = []
    for i, (seq, limit) in enumerate(zip(sequences, limits)):
        # (without the cache every row is computed: the engine as it was, for comparison)
        u = rows.setdefault(tuple(seq), len(unique)) if cache.enabled else i
        if u == len(unique):
            unique.append(seq)
            unique_limit.append(limit)
        else:
            unique_limit[u] = min(unique_limit[u], limit)
        row_of.append(u)
    cached, past = [], []
    for seq, limit in zip(unique, unique_limit):
        n, kv = cache.match(seq, limit)
        cached.append(n)
        past.append(kv)
    return PrefillPlan(unique, row_of, cached, past)


def batch_past(past: list[KV], cached: list[int]) -> tuple[KV, torch.Tensor] | None:
    """The rows' cached prefixes left-padded to one width: per-layer KV [rows, heads, width, dim]
    and the mask [rows, width] (1 = a cached token); None when no row has one."""
    width = max(cached, default=0)
    if width == 0:
        return None
    model = next(kv for kv in past if kv)
    layers = []
    for layer, (k0, v0) in enumerate(model):
        ks, vs = [], []
        for kv, n in zip(past, cached):
            pad_k = k0.new_zeros((1, k0.shape[1], width - n, k0.shape[3]))
            pad_v = v0.new_zeros((1, v0.shape[1], width - n, v0.shape[3]))
            ks.append(torch.cat([pad_k, kv[layer][0]], dim=2) if n else pad_k)
            vs.append(torch.cat([pad_v, kv[layer][1]], dim=2) if n else pad_v)
        layers.append((torch.cat(ks), torch.cat(vs)))
    mask = torch.zeros((len(cached), width), dtype=torch.long)
    for i, n in enumerate(cached):
        if n:
            mask[i, width - n :] = 1
    return layers, mask
