"""The reference engine's bounds on one request (rlmesh.engine.protocol, sampling_params) and
on a weight group's parameters (rlmesh.engine.weights): what a caller asks for beyond them is a
400 naming the bound, before the engine holds anything (an n of 10**9 once took it out of memory)."""

from __future__ import annotations

import pytest

from rlmesh.engine.errors import RequestError
from rlmesh.engine.protocol import parse_generate_body
from rlmesh.engine.weights import WeightUpdateError, check_group_endpoint

VOCAB = 100


def body(**fields) -> dict:
    return {"input_ids": [1, 2, 3], **fields}


@pytest.mark.parametrize(
    "fields, says",
    [
        ({"sampling_params": {"n": 10**9}}, "n must be in [1, 1024]"),
        ({"input_ids": [[1]] * 4097}, "4097 prompts"),
        ({"input_ids": [[1]] * 100, "sampling_params": {"n": 1000}}, "100000 sequences"),
        ({"rid": "r" * 300}, "rid"),
        ({"sampling_params": {"stop": [""]}}, "non-empty"),
        ({"sampling_params": {"stop": ["x" * 5000]}}, "1..4096 characters"),
        ({"sampling_params": {"stop_regex": ["a"] * 33}}, "at most 32 patterns"),
        ({"sampling_params": {"stop_token_ids": [1] * 1025}}, "at most 1024"),
        ({"top_logprobs_num": 10**9}, "top_logprobs_num must be an integer in [0, 100]"),
        ({"logprob_start_len": -100}, "logprob_start_len must be an integer in [-1,"),
    ],
)
def test_requests_beyond_the_engines_bounds_are_refused_naming_them(fields, says):
    with pytest.raises(RequestError) as refused:
        parse_generate_body(body(**fields), tokenizer=None, vocab_size=VOCAB)
    assert says in str(refused.value)


def test_a_request_within_the_bounds_is_taken():
    requests, is_batch = parse_generate_body(
        body(sampling_params={"n": 4, "stop": ["\n"]}, top_logprobs_num=5), tokenizer=None, vocab_size=VOCAB
    )
    assert len(requests) == 4 and is_batch


@pytest.mark.parametrize(
    "address, port, world_size, name, backend, says",
    [
        ("169.254.169.254", 29500, 2, "g", "gloo", "link-local"),
        ("metadata.google.internal", 29500, 2, "g", "gloo", "metadata"),
        ("0.0.0.0", 29500, 2, "g", "gloo", "unspecified"),
        ("not a host!!", 29500, 2, "g", "gloo", "neither an IP address nor a host name"),
        ("h" * 300, 29500, 2, "g", "gloo", "neither an IP address nor a host name"),
        ("trainer", 70000, 2, "g", "gloo", "master_port"),
        ("trainer", 29500, 2, "g", "mpi", "backend"),
        ("trainer", 29500, 2, "g" * 200, "gloo", "group_name"),
        ("trainer", 29500, 10**9, "g", "gloo", "world_size"),
    ],
)
def test_a_weight_group_no_trainer_could_be_at_is_refused_before_any_wait(
    address, port, world_size, name, backend, says
):
    with pytest.raises(WeightUpdateError, match=says):
        check_group_endpoint(address, port, world_size, name, backend)


def test_a_weight_group_a_trainer_could_be_at_passes():
    for address in ("127.0.0.1", "trainer", "trainer.rlmesh.svc.cluster.local", "10.0.3.7", "::1", "[fd00::1]"):
        check_group_endpoint(address, 29500, 3, "rlmesh-r1-0a1b2c3d", "gloo")
