"""The engine's prefix cache: longest-prefix lookup over a radix tree of token ids, the KV
it hands back, and its bound in bytes with least-recently-used eviction."""

from __future__ import annotations

import torch

from rlmesh.engine.prefix_cache import PrefixCache, plan_prefill, reuse_limit

LAYERS, HEADS, DIM = 2, 2, 3
BYTES_PER_TOKEN = LAYERS * 2 * HEADS * DIM * 4  # float32 keys and values


def kv_of(tokens: list[int]):
    """A fake KV whose values say which token (and layer) they belong to."""

    def kv_for(start: int, end: int):
        ids = torch.tensor(tokens[start:end], dtype=torch.float32).view(1, 1, -1, 1)
        return [
            (ids.expand(1, HEADS, -1, DIM) + 1000 * layer, -ids.expand(1, HEADS, -1, DIM) - 1000 * layer)
            for layer in range(LAYERS)
        ]

    return kv_for


def tokens_in(kv) -> list[int]:
    return [int(x) for x in kv[0][0][0, 0, :, 0]]


def test_longest_prefix_is_found_with_its_kv_across_split_edges():
    cache = PrefixCache(max_bytes=1 << 20)
    a = [1, 2, 3, 4, 5, 6]
    b = [1, 2, 3, 9, 9]
    cache.insert(a, kv_of(a))
    cache.insert(b, kv_of(b))  # splits a's edge after 3 tokens
    assert cache.tokens == 8
    n, kv = cache.match([1, 2, 3, 4, 7], limit=10)
    assert n == 4 and tokens_in(kv) == [1, 2, 3, 4]
    assert [int(x) for x in kv[1][1][0, 0, :, 0]] == [-1001, -1002, -1003, -1004]
    n, kv = cache.match(b, limit=4)  # a limit (the last token is always computed) is kept
    assert n == 4 and tokens_in(kv) == [1, 2, 3, 9]
    assert cache.match([7, 1, 2], limit=3) == (0, [])


def test_only_the_part_not_cached_is_asked_for():
    cache = PrefixCache(max_bytes=1 << 20)
    asked = []
    a = [5, 6, 7]

    def recording(start: int, end: int):
        asked.append((start, end))
        return kv_of(a + [8, 9])(start, end)

    cache.insert(a, recording)
    cache.insert(a + [8, 9], recording)
    cache.insert(a, recording)
    assert asked == [(0, 3), (3, 5)]


def test_bounded_in_bytes_least_recently_used_go_first():
    cache = PrefixCache(max_bytes=10 * BYTES_PER_TOKEN)
    old, used, new = [1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3]
    cache.insert(old, kv_of(old))
    cache.insert(used, kv_of(used))
    cache.match(used, limit=4)  # used since: outlives `old`
    cache.insert(new, kv_of(new))
    assert cache.bytes <= cache.max_bytes and cache.tokens == 8
    assert cache.match(old, limit=4)[0] == 0
    assert cache.match(used, limit=4)[0] == 4 and cache.match(new, limit=4)[0] == 4
    too_long = list(range(100, 120))
    cache.insert(too_long, kv_of(too_long))  # larger than the whole cache: not kept, nothing evicted
    assert cache.match(too_long, limit=20)[0] == 0 and cache.tokens == 8


def test_flush_empties_and_off_means_nothing_is_kept():
    cache = PrefixCache(max_bytes=1 << 20)
    cache.insert([1, 2, 3], kv_of([1, 2, 3]))
    epoch = cache.epoch
    cache.flush()
    assert cache.match([1, 2, 3], limit=3)[0] == 0 and cache.bytes == 0 and cache.epoch == epoch + 1
    off = PrefixCache(max_bytes=0)
    off.insert([1, 2, 3], kv_of([1, 2, 3]))
    assert off.match([1, 2, 3], limit=3)[0] == 0


def test_a_prefill_computes_identical_rows_once():
    cache = PrefixCache(max_bytes=1 << 20)
    plan = plan_prefill(cache, [[1, 2, 3], [4, 5], [1, 2, 3]], [2, 1, 2])
    assert plan.unique == [[1, 2, 3], [4, 5]] and plan.row_of == [0, 1, 0]
    off = plan_prefill(PrefixCache(max_bytes=0), [[1, 2, 3], [1, 2, 3]], [2, 2])
    assert off.row_of == [0, 1]


def test_reuse_leaves_the_positions_prompt_logprobs_need():
    seq = list(range(10))
    assert reuse_limit(seq, 10, return_logprob=False, logprob_start_len=-1) == 9
    assert reuse_limit(seq, 10, return_logprob=True, logprob_start_len=-1) == 8  # the last prompt token's
    assert reuse_limit(seq, 10, return_logprob=True, logprob_start_len=4) == 3
    assert reuse_limit(seq, 10, return_logprob=True, logprob_start_len=0) == 0
    assert reuse_limit(seq + [10, 11], 10, return_logprob=True, logprob_start_len=0) == 11  # retracted: recorded
