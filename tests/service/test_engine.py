"""The CPU reference engine, over real HTTP on loopback: SGLang's /generate shapes, stop
conditions, abort, pause, info endpoints and weight updates from disk (the engine as its
own process, SIGTERM and weight groups: test_engine_process.py)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from rlmesh.cli.tiny_model import build_tiny_model
from rlmesh.common.auth import client_headers
from rlmesh.engine.config import Settings
from rlmesh.engine.server import start
from tests.helpers.engine import LONG, wait_until_in_flight
from tests.helpers.weight_group import in_background


def _settings(model_dir: Path, **overrides) -> Settings:
    values = dict(model_path=str(model_dir), num_threads=1, max_batch_size=8, seed=0, context_length=1_000_000)
    values.update(overrides)
    return Settings(**values)


@pytest.fixture
def engine_url(loop_thread, tiny_model_dir):
    server, port = loop_thread.run(start(_settings(tiny_model_dir)))
    yield f"http://127.0.0.1:{port}"
    loop_thread.run(server.stop())


@pytest.fixture
def client(engine_url):
    with httpx.Client(base_url=engine_url, timeout=60, headers=client_headers()) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _greedy(client: httpx.Client, input_ids: list[int], n: int = 20, **extra) -> dict:
    params = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True, **extra}
    r = client.post("/generate", json={"input_ids": input_ids, "sampling_params": params, "return_logprob": True})
    assert r.status_code == 200, r.text
    return r.json()


def _stream_chunks(base_url: str, body: dict, on_chunk) -> list[dict]:
    chunks = []
    with (
        httpx.Client(base_url=base_url, timeout=60, headers=client_headers()) as c,
        c.stream("POST", "/generate", json=body) as r,
    ):
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            chunks.append(json.loads(line[len("data: ") :]))
            on_chunk(chunks)
    return chunks


# -- /generate ------------------------------------------------------------------


def test_generate_shapes_and_logprobs(client, tokenizer):
    r = client.post(
        "/generate",
        json={
            "text": "hello",
            "sampling_params": {"max_new_tokens": 6, "temperature": 0.8, "top_p": 0.9, "top_k": 20, "ignore_eos": True},
            "return_logprob": True,
        },
    )
    assert r.status_code == 200, r.text
    out = r.json()
    meta = out["meta_info"]
    assert set(out) == {"text", "output_ids", "meta_info"}
    assert len(out["output_ids"]) == 6 == meta["completion_tokens"]
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == len(tokenizer("hello")["input_ids"])
    assert meta["cached_tokens"] == 0
    assert meta["weight_version"] == "default"
    assert isinstance(meta["id"], str) and meta["id"]
    logprobs = meta["output_token_logprobs"]
    assert [entry[1] for entry in logprobs] == out["output_ids"]
    assert all(len(e) == 3 and isinstance(e[0], float) and e[0] <= 0 and e[2] is None for e in logprobs)
    assert out["text"] == tokenizer.decode(out["output_ids"], skip_special_tokens=True)

    r = client.post(
        "/generate",
        json={
            "text": "hi",
            "sampling_params": {"max_new_tokens": 3},
            "return_logprob": True,
            "return_text_in_logprobs": True,
        },
    )
    for _lp, token_id, text in r.json()["meta_info"]["output_token_logprobs"]:
        assert text == tokenizer.decode([token_id])


def test_greedy_matches_the_model_and_logprobs(client, tokenizer, hf_model):
    prompt = tokenizer("The cat")["input_ids"]
    out = _greedy(client, prompt, n=12)
    ids = out["output_ids"]
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt + ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    for i, (lp, token_id, _) in enumerate(out["meta_info"]["output_token_logprobs"]):
        position = len(prompt) + i - 1
        assert token_id == int(logits[position].argmax())
        assert lp == pytest.approx(float(logprobs[position, token_id]), abs=1e-4)


def test_temperature_scales_logprobs(client, tokenizer, hf_model):
    prompt = tokenizer("abc")["input_ids"]
    r = client.post(
        "/generate",
        json={
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0.5},
            "return_logprob": True,
        },
    )
    out = r.json()
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt + out["output_ids"]])).logits[0].float()
    expected = torch.log_softmax(logits / 0.5, dim=-1)
    for i, (lp, token_id, _) in enumerate(out["meta_info"]["output_token_logprobs"]):
        assert lp == pytest.approx(float(expected[len(prompt) + i - 1, token_id]), abs=1e-4)


def test_filters_and_seed(client, tokenizer):
    prompt = tokenizer("Filters")["input_ids"]
    greedy = _greedy(client, prompt, n=8)["output_ids"]
    # top_k=1, min_p=1 and a tiny top_p each leave only the most likely token.
    for extra in [{"top_k": 1}, {"min_p": 1.0}, {"top_p": 1e-6}]:
        assert _greedy(client, prompt, n=8, temperature=1.0, **extra)["output_ids"] == greedy, extra
    seeded = [_greedy(client, prompt, n=8, temperature=1.0, sampling_seed=42)["output_ids"] for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_prompt_logprobs(client, tokenizer, hf_model):
    prompt = tokenizer("prompt tokens")["input_ids"]
    r = client.post(
        "/generate",
        json={
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 1},
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 2,
        },
    )
    meta = r.json()["meta_info"]
    with torch.inference_mode():
        logprobs = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    entries = meta["input_token_logprobs"]
    assert [e[1] for e in entries] == prompt and entries[0][0] is None
    for i, (lp, token_id, _) in enumerate(entries[1:], start=1):
        assert lp == pytest.approx(float(logprobs[i - 1, token_id]), abs=1e-4)
    assert len(meta["output_top_logprobs"]) == 1 and len(meta["output_top_logprobs"][0]) == 2


def test_stop_token_ids_and_trim(client, tokenizer):
    prompt = tokenizer("Once upon")["input_ids"]
    # ignore_eos would also ignore stop_token_ids (as in SGLang): keep EOS away with a bias instead.
    no_eos = {"ignore_eos": False, "logit_bias": {str(tokenizer.eos_token_id): -1000.0}}
    base = _greedy(client, prompt, **no_eos)["output_ids"]
    stop_id = base[3]
    cut = base.index(stop_id) + 1
    out = _greedy(client, prompt, stop_token_ids=[stop_id], **no_eos)
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert out["output_ids"] == base[:cut]
    assert out["meta_info"]["completion_tokens"] == cut
    assert out["text"] == tokenizer.decode(base[: cut - 1], skip_special_tokens=True)
    kept = _greedy(client, prompt, stop_token_ids=[stop_id], no_stop_trim=True, **no_eos)
    assert kept["text"] == tokenizer.decode(base[:cut], skip_special_tokens=True)


def test_stop_string(client, tokenizer):
    prompt = tokenizer("Hello there")["input_ids"]
    base = _greedy(client, prompt, n=30)["output_ids"]
    full = tokenizer.decode(base, skip_special_tokens=True)
    assert len(full) >= 6, "the tiny model should produce printable text"
    stop = full[3:5]
    cut = next(k for k in range(1, len(base) + 1) if stop in tokenizer.decode(base[:k], skip_special_tokens=True))
    out = _greedy(client, prompt, n=30, stop=[stop, "@@never@@"])
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["output_ids"] == base[:cut]
    assert out["text"] == full[: full.find(stop)]
    kept = _greedy(client, prompt, n=30, stop=stop, no_stop_trim=True)
    assert kept["text"] == tokenizer.decode(base[:cut], skip_special_tokens=True)


def test_eos_stops_unless_ignored(client, tokenizer):
    prompt = tokenizer("x")["input_ids"]
    eos = tokenizer.eos_token_id
    # logit_bias makes EOS the greedy choice.
    params = {"max_new_tokens": 5, "temperature": 0, "logit_bias": {str(eos): 1000.0}}
    out = client.post("/generate", json={"input_ids": prompt, "sampling_params": params}).json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    assert out["output_ids"] == [eos]
    ignored = client.post(
        "/generate", json={"input_ids": prompt, "sampling_params": {**params, "ignore_eos": True}}
    ).json()
    assert ignored["output_ids"] == [eos] * 5
    assert ignored["meta_info"]["finish_reason"] == {"type": "length", "length": 5}


def test_batch_answers_in_order_and_matches_single_requests(client, tokenizer):
    prompts = [tokenizer(t)["input_ids"] for t in ["a", "a much longer prompt here", "mid length"]]
    singles = [_greedy(client, p, n=10)["output_ids"] for p in prompts]
    r = client.post(
        "/generate",
        json={
            "input_ids": prompts,
            "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True},
            "rid": ["r0", "r1", "r2"],
        },
    )
    assert r.status_code == 200, r.text
    outs = r.json()
    assert isinstance(outs, list) and [o["meta_info"]["id"] for o in outs] == ["r0", "r1", "r2"]
    assert [o["output_ids"] for o in outs] == singles
    texts = client.post("/generate", json={"text": ["x", "yy"], "sampling_params": {"max_new_tokens": 2}}).json()
    assert isinstance(texts, list) and len(texts) == 2
    several = client.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2, "n": 3}}).json()
    assert isinstance(several, list) and len(several) == 3


def test_requests_joining_a_running_batch_are_not_disturbed(client, engine_url, tokenizer):
    short_prompt = tokenizer("short")["input_ids"]
    expected = _greedy(client, short_prompt, n=15)["output_ids"]
    chunks_seen = threading.Event()
    body = {
        "input_ids": tokenizer("a long running one")["input_ids"],
        "sampling_params": {**LONG},
        "stream": True,
        "rid": "runner",
    }
    streaming = in_background(_stream_chunks, engine_url, body, lambda chunks: chunks_seen.set())
    assert chunks_seen.wait(30)
    assert _greedy(client, short_prompt, n=15)["output_ids"] == expected
    client.post("/abort_request", json={"rid": "runner"})
    assert streaming.result(30)[-1]["meta_info"]["finish_reason"]["type"] == "abort"


def test_bad_input_is_400_with_a_message(client):
    r = client.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokenz": 3}})
    assert r.status_code == 400
    assert "max_new_tokenz" in r.json()["error"]["message"]
    for body in [
        {"sampling_params": {}},
        {"text": "x", "input_ids": [1]},
        {"text": "x", "sampling_params": {"top_p": 0}},
        {"text": "x", "sampling_params": {"temperature": "hot"}},
        {"input_ids": [100000]},
        {"text": ["a", "b"], "sampling_params": [{}]},
        {"text": "x", "logprob_start_len": "zero"},
        {"text": "x", "top_logprobs_num": 1.5},
    ]:
        r = client.post("/generate", json=body)
        assert r.status_code == 400, body
        assert r.json()["error"]["message"]
    r = client.post("/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


# -- abort, pause, flush -------------------------------------------------------------


def test_abort_in_flight_request_returns_partial_output(client):
    pending = in_background(client.post, "/generate", json={"text": "go", "sampling_params": LONG, "rid": "a-1"})
    wait_until_in_flight(client)
    duplicate = client.post("/generate", json={"text": "go", "sampling_params": {"max_new_tokens": 1}, "rid": "a-1"})
    assert duplicate.status_code == 400 and "a-1" in duplicate.json()["error"]["message"]
    r = client.post("/abort_request", json={"rid": "a-1"})
    assert r.status_code == 200 and r.content == b""
    response = pending.result(30)
    assert response.status_code == 200
    out = response.json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert out["meta_info"]["completion_tokens"] == len(out["output_ids"]) < LONG["max_new_tokens"]
    assert client.post("/abort_request", json={"rid": "unknown"}).status_code == 200
    assert client.get("/flush_cache").status_code == 200


def test_abort_all_while_streaming_keeps_the_tokens_so_far(client, engine_url):
    body = {"text": "go", "sampling_params": LONG, "stream": True, "return_logprob": True}
    started = threading.Event()
    streaming = in_background(_stream_chunks, engine_url, body, lambda chunks: len(chunks) >= 3 and started.set())
    assert started.wait(30)
    client.post("/abort_request", json={"abort_all": True})
    chunks = streaming.result(30)
    final = chunks[-1]
    assert final["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(final["output_ids"]) >= 3
    assert len(final["meta_info"]["output_token_logprobs"]) == len(final["output_ids"])
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_pause_abort_mode_holds_new_requests_until_continue(client):
    running = in_background(client.post, "/generate", json={"text": "go", "sampling_params": LONG})
    wait_until_in_flight(client)
    assert client.post("/pause_generation", json={"mode": "abort"}).status_code == 200
    assert running.result(30).json()["meta_info"]["finish_reason"]["type"] == "abort"
    held = in_background(client.post, "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    time.sleep(0.3)
    assert not held.done()
    assert client.post("/continue_generation", json={}).status_code == 200
    assert held.result(30).json()["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_keeps_running_requests(client, tokenizer, mode):
    prompt = tokenizer("pause me")["input_ids"]
    expected = _greedy(client, prompt, n=150)["output_ids"]
    running = in_background(_greedy, client, prompt, 150)
    wait_until_in_flight(client)
    assert client.post("/pause_generation", json={"mode": mode}).status_code == 200
    assert client.get("/flush_cache").status_code == 400
    assert client.post("/continue_generation", json={}).status_code == 200
    out = running.result(30)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 150}
    assert out["output_ids"] == expected


def test_pause_rejects_unknown_mode(client):
    assert client.post("/pause_generation", json={"mode": "sleep"}).status_code == 400


# -- info and health -------------------------------------------------------------------


def test_info_and_health(client, tiny_model_dir):
    info = client.get("/get_model_info").json()
    assert info["model_path"] == str(tiny_model_dir)
    assert info["tokenizer_path"] == str(tiny_model_dir)
    assert info["is_generation"] is True
    assert info["weight_version"] == "default"
    assert client.get("/model_info").json() == info
    server = client.get("/get_server_info").json()
    assert server["tp_size"] == 1 and server["max_total_num_tokens"] > 0 and server["version"]
    assert client.get("/server_info").status_code == 200
    assert client.get("/health").status_code == 200
    assert client.get("/health_generate").status_code == 200
    assert client.post("/flush_cache", json={}).status_code == 200


# -- weights: disk and get_weights_by_name -------------------------------------------


def test_update_weights_from_disk(client, tmp_path):
    other = build_tiny_model(tmp_path / "other", seed=7)
    expected = load_file(str(next(other.glob("*.safetensors"))))
    name = "model.layers.0.self_attn.q_proj.weight"
    before = client.post("/get_weights_by_name", json={"name": name, "truncate_size": 1000}).json()
    assert before != expected[name].tolist()
    r = client.post("/update_weights_from_disk", json={"model_path": str(other), "weight_version": "disk-1"})
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    for n in [name, "model.embed_tokens.weight", "model.norm.weight"]:
        got = client.post("/get_weights_by_name", json={"name": n, "truncate_size": 100_000}).json()
        assert got == expected[n].tolist()
    info = client.get("/get_model_info").json()
    assert info["weight_version"] == "disk-1" and info["model_path"] == str(other)
    out = client.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2}}).json()
    assert out["meta_info"]["weight_version"] == "disk-1"
    bad = client.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "missing")})
    assert bad.status_code == 400 and bad.json()["success"] is False and bad.json()["message"]
    unknown = client.post("/get_weights_by_name", json={"name": "nope"})
    assert unknown.status_code == 400 and "nope" in unknown.json()["error"]["message"]


def test_update_weights_from_disk_reads_only_under_the_weight_roots(loop_thread, tiny_model_dir, tmp_path):
    pushes, elsewhere = tmp_path / "pushes", tmp_path / "elsewhere"
    inside, outside = build_tiny_model(pushes / "v1", seed=7), build_tiny_model(elsewhere / "v1", seed=8)
    server, port = loop_thread.run(start(_settings(tiny_model_dir, weight_roots=[str(pushes)])))
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60, headers=client_headers()) as c:
            refusals = {}
            for path in (outside, elsewhere / "missing", pushes / ".." / "elsewhere" / "v1"):
                r = c.post("/update_weights_from_disk", json={"model_path": str(path), "weight_version": "x"})
                assert r.status_code == 400 and r.json()["success"] is False, r.text
                refusals[path] = r.json()["message"].replace(str(path), "<path>")
                assert "weight_roots" in refusals[path] and str(pushes) not in refusals[path]
            # The same answer whether or not the path exists: it tells nothing of the files outside.
            assert len(set(refusals.values())) == 1, refusals
            assert c.get("/get_model_info").json()["weight_version"] != "x"
            for path in (inside, "v1"):  # (a relative path is taken under the roots)
                r = c.post("/update_weights_from_disk", json={"model_path": str(path), "weight_version": "in"})
                assert r.status_code == 200 and r.json()["success"] is True, r.text
            assert c.get("/get_model_info").json()["model_path"] == str(inside)
    finally:
        loop_thread.run(server.stop())


@pytest.mark.parametrize(
    "field,value",
    [
        ("image_data", "data:image/png;base64,AAAA"),
        ("lora_path", "adapter"),
        ("return_hidden_states", True),
        ("return_routed_experts", True),
        ("custom_logit_processor", "{}"),
        ("session_params", {"id": "s"}),
        ("input_embeds", [[0.0]]),
    ],
)
def test_request_fields_the_engine_does_not_implement_are_refused(client, field, value):
    r = client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}, field: value})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert field in message and "does not implement" in message
    # Their SGLang defaults (unset) are fine.
    ok = client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}, field: None})
    assert ok.status_code == 200


# -- /metrics (SGLang's --enable-metrics) --------------------------------------------


def test_metrics_under_sglangs_names_count_tokens_and_show_running_requests(loop_thread, tiny_model_dir):
    from tests.helpers.prometheus import scrape, value

    server, port = loop_thread.run(start(_settings(tiny_model_dir, enable_metrics=True, served_model_name="tiny")))
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=base, timeout=60, headers=client_headers()) as c:
            for prompt in ([1, 2, 3], [4, 5, 6, 7]):
                _greedy(c, prompt, n=5)
            samples = scrape(f"{base}/metrics", headers={})  # open, like SGLang's
            assert value(samples, "sglang:generation_tokens_total", model_name="tiny") == 10
            assert value(samples, "sglang:prompt_tokens_total", model_name="tiny") == 7
            assert value(samples, "sglang:num_running_reqs") == value(samples, "sglang:num_queue_reqs") == 0
            running = in_background(c.post, "/generate", json={"input_ids": [1, 2], "sampling_params": LONG})
            wait_until_in_flight(c)
            samples = scrape(f"{base}/metrics", headers={})
            assert value(samples, "sglang:num_running_reqs") + value(samples, "sglang:num_queue_reqs") == 1
            assert value(samples, "sglang:gen_throughput") >= 0
            c.post("/abort_request", json={"abort_all": True})
            assert running.result(timeout=60).status_code == 200
    finally:
        loop_thread.run(server.stop())


def test_metrics_are_off_unless_enabled(client):
    assert client.get("/metrics").status_code == 404
