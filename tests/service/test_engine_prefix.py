"""Prefix sharing in the CPU reference engine, over real HTTP: requests that share a prompt
prefix (a GRPO group's samples, in one request or several; an agent's next turn) reuse its
KV, say so in meta_info.cached_tokens, and answer exactly what an engine without the cache
answers; a weight update or /flush_cache empties the cache."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from rlmesh.common.auth import client_headers
from rlmesh.engine.config import Settings
from rlmesh.engine.server import start

GREEDY = {"temperature": 0, "ignore_eos": True}


def _engine(loop_thread, model_dir: Path, prefix_cache_mb: float):
    settings = Settings(
        model_path=str(model_dir),
        num_threads=1,
        max_batch_size=8,
        seed=0,
        context_length=1_000_000,
        prefix_cache_mb=prefix_cache_mb,
    )
    server, port = loop_thread.run(start(settings))
    return server, httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60, headers=client_headers())


@pytest.fixture
def engines(loop_thread, tiny_model_dir):
    """(with the prefix cache, without it)"""
    started = [_engine(loop_thread, tiny_model_dir, mb) for mb in (256, 0)]
    yield tuple(client for _, client in started)
    for server, client in started:
        client.close()
        loop_thread.run(server.stop())


def _generate(client: httpx.Client, body: dict) -> dict | list:
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _ids(text: str) -> list[int]:
    return [3 + (ord(c) % 90) for c in text]


def _workload(client: httpx.Client) -> list[dict]:
    """A GRPO group in one request (n=4) and as 4 concurrent requests, prompts sharing a
    prefix with prompt log-probs, and an agent's two turns; every answer in order."""
    system = _ids("You are a careful assistant. Reverse the letters of the word: ")
    answers: list[dict] = []
    group = system + _ids("banana")
    answers += _generate(
        client,
        {"input_ids": group, "sampling_params": {"max_new_tokens": 12, "n": 4, **GREEDY}, "return_logprob": True},
    )
    body = {"input_ids": group, "sampling_params": {"max_new_tokens": 9, **GREEDY}, "return_logprob": True}
    with ThreadPoolExecutor(4) as pool:
        answers += list(pool.map(lambda _: _generate(client, body), range(4)))
    mixed = [system + _ids(w) for w in ("kiwi", "apple pie", "fig")]
    answers += _generate(
        client,
        {
            "input_ids": mixed,
            "sampling_params": [{"max_new_tokens": n, **GREEDY} for n in (5, 14, 8)],
            "return_logprob": True,
            "logprob_start_len": [-1, 3, 30],
            "top_logprobs_num": 2,
        },
    )
    first = _generate(client, {"input_ids": system + _ids("plum"), "sampling_params": {"max_new_tokens": 10, **GREEDY}})
    second_turn = system + _ids("plum") + first["output_ids"] + _ids(" Now the word: pear")
    answers += [
        first,
        _generate(client, {"input_ids": second_turn, "sampling_params": {"max_new_tokens": 10, **GREEDY}}),
    ]
    return answers


def _same(a: dict, b: dict) -> None:
    assert a["output_ids"] == b["output_ids"] and a["text"] == b["text"]
    ma, mb = a["meta_info"], b["meta_info"]
    assert ma["finish_reason"] == mb["finish_reason"] and ma["prompt_tokens"] == mb["prompt_tokens"]
    for key in ("output_token_logprobs", "input_token_logprobs"):
        assert len(ma.get(key, [])) == len(mb.get(key, []))
        for (lp_a, t_a, _), (lp_b, t_b, _) in zip(ma.get(key, []), mb.get(key, [])):
            assert t_a == t_b
            assert (lp_a is None) == (lp_b is None) and (lp_a is None or abs(lp_a - lp_b) < 1e-4)
    for key in ("output_top_logprobs", "input_top_logprobs"):
        assert [[t for _, t, _ in top or []] for top in ma.get(key, [])] == [
            [t for _, t, _ in top or []] for top in mb.get(key, [])
        ]


def test_shared_prefixes_answer_as_without_the_cache_and_report_cached_tokens(engines):
    cached, plain = engines
    with_cache, without = _workload(cached), _workload(plain)
    assert len(with_cache) == len(without) == 13
    for a, b in zip(with_cache, without):
        _same(a, b)
    assert all(b["meta_info"]["cached_tokens"] == 0 for b in without)
    counts = [a["meta_info"]["cached_tokens"] for a in with_cache]
    prompt = with_cache[0]["meta_info"]["prompt_tokens"]
    # n=4 in one request: the prompt is computed once, three samples fork it.
    assert counts[:4] == [0, prompt, prompt, prompt]
    # The same prompt again, as separate requests: from the cache, all but the positions whose
    # logits give the last prompt token's log-prob and the next token (SGLang too computes the
    # last one); the whole prompt where two arrived together and one forked the other.
    assert all(c in (prompt - 2, prompt) for c in counts[4:8]) and prompt - 2 in counts[4:8]
    # Prompts sharing the instruction reuse it, except where prompt log-probs are asked for.
    shared = len(_ids("You are a careful assistant. Reverse the letters of the word: "))
    assert counts[8] == shared and counts[9] == 2 and counts[10] == 29
    # An agent's second turn reuses the first turn's prompt and output (but its last token).
    first = with_cache[11]
    assert counts[12] == first["meta_info"]["prompt_tokens"] + len(first["output_ids"]) - 1


def test_weight_updates_and_flush_empty_the_cache(engines, tiny_model_dir):
    client, _ = engines
    body = {"input_ids": _ids("a prompt long enough to share"), "sampling_params": {"max_new_tokens": 3, **GREEDY}}
    expected = _generate(client, body)
    again = _generate(client, body)
    assert again["meta_info"]["cached_tokens"] == again["meta_info"]["prompt_tokens"] - 1
    r = client.post("/update_weights_from_disk", json={"model_path": str(tiny_model_dir), "weight_version": "2"})
    assert r.status_code == 200, r.text
    after_update = _generate(client, body)
    assert after_update["meta_info"]["cached_tokens"] == 0
    assert after_update["output_ids"] == expected["output_ids"]  # (the same checkpoint)
    assert client.get("/flush_cache").status_code == 200
    assert _generate(client, body)["meta_info"]["cached_tokens"] == 0
