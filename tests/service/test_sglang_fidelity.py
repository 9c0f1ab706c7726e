"""rlmesh's requests to an engine, checked against SGLang's own declaration of its HTTP API:
the pinned release's source, read without importing it (tests/helpers/sglang_source.py; `make`
downloads the wheel; RLMESH_SGLANG_VERSION or RLMESH_SGLANG_SOURCE try another).

Every request the rollout service sends, on its own behalf or relaying the trainer's weight
pushes, is built by rlmesh's own code (the engine pool, the default and agent generate paths,
the colocated calls, the trainer's SGLang tensor payload) and sent over real HTTP to a
recording engine on loopback that answers as SGLang's handlers do. Then each request is
checked: its route exists with that method; every field it sends exists in the route's body
class with a compatible type, and every required one is sent; a /generate body passes SGLang's
generated JSON contract; every field rlmesh reads from an answer is one SGLang builds on that
route. Whatever differs must be in EXPECTED, with its reason, and in docs/engine-api.md."""

from __future__ import annotations

import asyncio
import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from rlmesh.cli.launcher import http_ready
from rlmesh.common import weight_file
from rlmesh.common.prometheus import ServiceMetrics
from rlmesh.common.run_config import SamplingConfig
from rlmesh.common.sample import Sample
from rlmesh.common.sampling import sampling_to_proto, sampling_to_sglang
from rlmesh.common.weight_group import WEIGHT_DELTA_FORMAT
from rlmesh.rollout import colocated, sglang_client
from rlmesh.rollout.agents.openai_models import ChatRequest, OpenAIAgentOptions
from rlmesh.rollout.agents.openai_session import AgentSession
from rlmesh.rollout.agents.openai_templates import request_sampling
from rlmesh.rollout.engine_client import PAUSE_MODES, EnginePool, TensorMeta, WeightDelta
from rlmesh.rollout.generation import FINISH_STATUS, GenerateContext, default_generate
from rlmesh.rollout.metrics import RolloutMetrics
from rlmesh.rollout.server import DEFAULT_GROUP
from rlmesh.rollout.sglang_client import decode_answer
from rlmesh.trainer.colocated import sglang_payload
from tests.helpers import sglang_source

DOCS = Path(__file__).resolve().parents[2] / "docs" / "engine-api.md"

# Every difference the check finds in the pinned release -> why it is so. Each names a field
# that docs/engine-api.md's "Checked against SGLang's source" lists.
EXPECTED = {
    # rlmesh extensions: sent only to engines that advertise them (the reference engine)
    "delta update (rlmesh engines only): POST /update_weights_from_distributed: body.rlmesh_delta: "
    "no such field (SGLang ignores it)": "rlmesh_delta",
    "weight-file update (rlmesh engines only): POST /update_weights_from_tensor: "
    "body.serialized_named_tensors[0]: '/dev/shm/rlmesh/run.rlmw' is not base64": "rlmesh_weight_file",
    # a missing `success` counts as success (the status code decides): harmless
    "pause and continue: POST /pause_generation: rlmesh reads success, which SGLang does not return": "success",
    "pause and continue: POST /continue_generation: rlmesh reads success, which SGLang does not return": "success",
    "engine states: GET /server_info: rlmesh reads rlmesh_weight_delta, which SGLang does not return": (
        "rlmesh_weight_delta"
    ),
    "engine states: GET /server_info: rlmesh reads rlmesh_weight_file, which SGLang does not return": (
        "rlmesh_weight_file"
    ),
    "engine states: GET /server_info: rlmesh reads rlmesh_gpu_uuid, which SGLang does not return": ("rlmesh_gpu_uuid"),
    # written into the parsed answer by rlmesh's own client, never by an engine
    "generate (default): POST /generate: rlmesh reads meta_info.rlmesh_began_under_weight_version, which SGLang "
    "does not return": "rlmesh_began_under_weight_version",
}

# Routes rlmesh asks and does without when an engine answers 404 (older SGLang): the weight
# update session (0.5.21) and the new names of the info routes (0.5.10).
PROBED = {"/begin_weight_update", "/end_weight_update", "/model_info", "/server_info"}

# SGLang's answers, as its handlers build them (each key is checked against its source below).
SERVER_INFO = {"tp_size": 1, "model_path": "/models/m", "version": sglang_source.PINNED_VERSION}
MODEL_INFO = {"model_path": "/models/m", "tokenizer_path": "/models/m", "weight_version": "7", "is_generation": True}
DONE = {"success": True, "message": "Succeeded."}
PAUSED = {"message": "Generation paused successfully.", "status": "ok"}
CONTINUED = {"message": "Generation continued successfully.", "status": "ok"}
EMPTY = object()  # an answer with no body (FastAPI's Response(status_code=200))
ANSWERS: dict[str, Any] = {
    "/get_model_info": MODEL_INFO,
    "/model_info": MODEL_INFO,
    "/get_server_info": SERVER_INFO,
    "/server_info": SERVER_INFO,
    "/pause_generation": PAUSED,
    "/continue_generation": CONTINUED,
    "/abort_request": EMPTY,
    "/health": EMPTY,
    "/release_memory_occupation": None,  # the handler returns nothing: `null`
    "/resume_memory_occupation": None,
    "/update_weights_from_disk": {**DONE, "num_paused_requests": 0},
}


def generate_answer(body: dict) -> dict | list[dict]:
    if isinstance(body["rid"], list):  # a batch: each field a list, one answer per request
        return [generate_answer({k: v[i] for k, v in body.items()}) for i in range(len(body["rid"]))]
    n = body["sampling_params"]["max_new_tokens"]
    return {
        "text": "x" * n,
        "output_ids": list(range(5, 5 + n)),
        "meta_info": {
            "id": body["rid"],
            "finish_reason": {"type": "length", "length": n},
            "prompt_tokens": len(body["input_ids"]),
            "weight_version": "7",
            "num_retractions": 0,
            "reasoning_tokens": 0,
            "completion_tokens": n,
            "cached_tokens": 0,
            "input_token_logprobs": [[None, body["input_ids"][-1], None]],
            "output_token_logprobs": [[-0.5, 5 + i, None] for i in range(n)],
            "output_token_logprobs_length": n,
            "e2e_latency": 0.01,
        },
    }


class RecordingEngine:
    """An HTTP server on loopback that records every request (with the phase of the
    scenario that sent it) and answers as SGLang does."""

    def __init__(self) -> None:
        self.phase = ""
        self.requests: list[tuple[str, str, str, Any]] = []  # phase, method, path, body
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        method, target = head.split(b" ")[:2]
        length = next(
            (int(x.split(b":")[1]) for x in head.split(b"\r\n") if x.lower().startswith(b"content-length")), 0
        )
        body = json.loads(await reader.readexactly(length)) if length else None
        path = target.decode().split("?")[0]
        self.requests.append((self.phase, method.decode(), path, body))
        answer = generate_answer(body) if path == "/generate" else ANSWERS.get(path, DONE)
        payload = b"" if answer is EMPTY else json.dumps(answer).encode()
        writer.write(
            b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (len(payload), payload)
        )
        await writer.drain()
        writer.close()


class Reads:
    """The answer fields rlmesh's code reads, per route: answers are handed to it as dicts
    that note every key asked for (httpx.Response.json and, for /generate, decode_answer
    are wrapped)."""

    def __init__(self) -> None:
        self.by_route: dict[str, set[str]] = defaultdict(set)

    def wrap(self, value: Any, route: str, prefix: str = "") -> Any:
        if isinstance(value, dict):
            return _Noting({k: self.wrap(v, route, f"{prefix}{k}.") for k, v in value.items()}, self, route, prefix)
        if isinstance(value, list):
            return [self.wrap(v, route, prefix) for v in value]
        return value


class _Noting(dict):
    def __init__(self, items: dict, reads: Reads, route: str, prefix: str) -> None:
        super().__init__(items)
        self.noted = (reads, route, prefix)

    def note(self, key: object) -> None:
        reads, route, prefix = self.noted
        reads.by_route[route].add(f"{prefix}{key}")

    def __getitem__(self, key):
        self.note(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.note(key)
        return super().get(key, default)

    def __contains__(self, key) -> bool:
        self.note(key)
        return super().__contains__(key)


# Every sampling option a run config has, set away from its default, so each is sent.
EVERY_OPTION = SamplingConfig(
    max_new_tokens=3,
    temperature=0.7,
    top_p=0.9,
    top_k=20,
    min_p=0.05,
    stop=["</answer>"],
    stop_token_ids=[2],
    ignore_eos=True,
    no_stop_trim=True,
    repetition_penalty=1.1,
    frequency_penalty=0.2,
    presence_penalty=0.3,
    min_new_tokens=2,
)
VOCAB_SIZE = 32  # the token ids above are in it
TENSORS = [TensorMeta("model.embed_tokens.weight", "bfloat16", (8, 4)), TensorMeta("lm_head.weight", "float32", (8, 4))]


async def send_everything(engine: RecordingEngine, url: str) -> None:
    """Every request rlmesh sends to an engine, each built by rlmesh's own code."""
    pool = EnginePool([url], "", 5, 5, metrics=RolloutMetrics(ServiceMetrics()))
    try:
        engine.phase = "engine states"
        await pool.states()
        client = pool.for_generation()

        engine.phase = "generate (default)"
        params = sampling_to_sglang(sampling_to_proto(EVERY_OPTION))
        await default_generate(GenerateContext(tokenizer=None, engine=client), Sample(tokens=[1, 2, 3]), params)
        engine.phase = "generate (a partial sample resumed)"
        partial = Sample(tokens=[1, 2, 3, 5, 6], response_length=2, metadata={"rid": "partial"})
        await default_generate(GenerateContext(tokenizer=None, engine=client), partial, params)
        engine.phase = "generate (a prompt's samples, one batch)"
        group = [Sample(tokens=[1, 2, 3], prompt="p"), Sample(tokens=[1, 2, 3], prompt="p")]
        await asyncio.gather(
            *(default_generate(GenerateContext(tokenizer=None, engine=client), s, params) for s in group)
        )
        engine.phase = "generate (openai agent)"
        options = OpenAIAgentOptions(agent="a", honor_agent_sampling=True)
        session = AgentSession(GenerateContext(tokenizer=None, engine=client), options, params, "agent-rid")
        asked = ChatRequest(
            messages=[{"role": "user", "content": "hi"}],
            stop=["</tool>"],
            temperature=0.5,
            top_p=0.8,
            frequency_penalty=0.1,
            presence_penalty=0.1,
            seed=3,
            logit_bias={"5": 1.5},
        )
        await session.generate([1, 2, 3], 2, request_sampling(asked, session))

        engine.phase = "abort"
        await client.abort("some-rid")
        await pool.abort_all()
        engine.phase = "pause and continue"
        for mode in PAUSE_MODES:
            await pool.pause(mode)
        await pool.resume()

        engine.phase = "distributed update"
        for backend in ("nccl", "gloo"):
            await pool.init_weight_group("10.0.0.1", 29500, 2, DEFAULT_GROUP, backend)
        await pool.update_weights(TENSORS, DEFAULT_GROUP, "", False, "flattened_bucket")  # a first bucket
        await pool.update_weights(TENSORS, DEFAULT_GROUP, "7", True, "")  # the last one
        engine.phase = "delta update (rlmesh engines only)"
        client.weight_delta_format = WEIGHT_DELTA_FORMAT  # as an engine that advertises deltas
        await pool.update_weights(TENSORS[:1], DEFAULT_GROUP, "8", True, "", WeightDelta(3, "int32", "7"))
        engine.phase = "distributed update"
        await pool.destroy_weight_group(DEFAULT_GROUP)

        engine.phase = "disk update"
        await pool.update_weights_from_disk("/checkpoints/step-9", "9")

        engine.phase = "memory release and resume"
        for tags in ([], ["weights", "kv_cache"], ["cuda_graph"]):
            await colocated.release_memory(pool, tags)
            await colocated.resume_memory(pool, tags)
        engine.phase = "tensor update (SGLang's payload)"
        named = [("model.embed_tokens.weight", torch.ones(8, 4, dtype=torch.bfloat16))]
        await colocated.update_weights_from_tensor(pool, sglang_payload(named, 1), "", "10", True)
        engine.phase = "weight-file update (rlmesh engines only)"
        await colocated.update_weights_from_tensor(
            pool, ["/dev/shm/rlmesh/run.rlmw"], weight_file.LOAD_FORMAT, "11", True
        )

        engine.phase = "launcher readiness"
        await asyncio.to_thread(http_ready, url)
    finally:
        await pool.close()


@pytest.fixture(scope="module")
def sglang():
    try:
        source = sglang_source.locate()
    except sglang_source.SourceMissing as e:
        pytest.fail(str(e))
    decls = sglang_source.declarations(source.tree(sglang_source.IO_STRUCT))
    contract = sglang_source.contract_module(source)
    return {
        "source": source,
        "decls": decls,
        "routes": sglang_source.routes(source, decls.classes),
        "sampling": sglang_source.sampling_params(source),
        "verify_sampling": sglang_source.sampling_verifier(source),
        "contract": contract,
        "generate": sglang_source.generate_answer(source, contract),
    }


@pytest.fixture(scope="module")
def sent():
    """(phase, method, path, body) of every request, and the answer fields read per route."""
    reads = Reads()
    original = httpx.Response.json

    def noting_json(self, **kwargs):
        return reads.wrap(original(self, **kwargs), self.request.url.path)

    def noting_decode(answer: bytes, path: str):
        return reads.wrap(decode_answer(answer, path), path)

    engine = RecordingEngine()

    async def scenario():
        url = await engine.start()
        async with engine.server:
            await send_everything(engine, url)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(httpx.Response, "json", noting_json)
        patch.setattr(sglang_client, "decode_answer", noting_decode)
        asyncio.run(scenario())
    return engine.requests, reads.by_route


def request_differences(sglang, requests) -> list[str]:
    found = []
    check = sglang_source.TypeCheck(sglang["decls"])
    for phase, method, path, body in requests:
        where = f"{phase}: {method} {path}"
        route = sglang["routes"].get(path)
        if route is None:
            if path not in PROBED:
                found.append(f"{where}: SGLang has no such route")
            continue
        if method not in route.methods:
            found.append(f"{where}: SGLang serves it with {sorted(route.methods)} only")
        if route.deprecated:
            found.append(f"{where}: SGLang deprecates this route")
        if route.body_class is None:
            if body:
                found.append(f"{where}: SGLang reads no body here")
            continue
        fields = sglang["decls"].classes[route.body_class]
        found += [f"{where}: {p}" for p in sglang_source.body_problems(body or {}, fields, check, "body")]
        if path == "/generate":
            batch = body.get("sampling_params")
            for params in batch if isinstance(batch, list) else [batch or {}]:
                sampling = sglang_source.body_problems(params, sglang["sampling"], check, "body.sampling_params")
                found += [f"{where}: {p}" for p in sampling]
                refused = sglang["verify_sampling"] and sglang["verify_sampling"](params, VOCAB_SIZE)
                if refused:
                    found.append(f"{where}: SGLang's SamplingParams.verify refuses it: {refused}")
            if sglang["contract"] is not None:
                try:
                    sglang["contract"].GenerateRequest.from_json_value(body)
                except sglang["contract"].JsonContractError as e:
                    found.append(f"{where}: SGLang's JSON contract refuses it: {e}")
    return found


def answer_keys(sglang, path: str) -> set[str]:
    routes = sglang["routes"]
    if path in ("/get_server_info", "/server_info"):
        return sglang_source.server_info_keys(sglang["source"], routes[path], routes)
    return sglang_source.route_answer_keys(routes[path], routes)


def read_differences(sglang, requests, reads) -> list[str]:
    """Fields rlmesh reads that SGLang's handler for that route never builds."""
    generate = sglang["generate"]
    phases = {path: (phase, method) for phase, method, path, _ in reversed(requests)}
    found = []
    for path, keys in sorted(reads.items()):
        if path not in sglang["routes"]:
            continue  # (a probed route this release lacks: reported above)
        phase, method = phases[path]
        for key in sorted(keys):
            parts = key.split(".")
            if path == "/generate":
                known = [generate.top, generate.meta_info, generate.finish_reason]
                ok = all(p in k for p, k in zip(parts, known)) and len(parts) <= 3
            else:
                ok = len(parts) == 1 and parts[0] in answer_keys(sglang, path)
            if not ok:
                found.append(f"{phase}: {method} {path}: rlmesh reads {key}, which SGLang does not return")
    return found


def test_the_pinned_sglang_is_the_one_checked(sglang):
    if not (os.environ.get("RLMESH_SGLANG_VERSION") or os.environ.get("RLMESH_SGLANG_SOURCE")):
        assert sglang["source"].version == sglang_source.PINNED_VERSION


def test_every_route_rlmesh_calls_is_one_sglang_serves_with_that_method(sglang, sent):
    requests, _ = sent
    called = {(m, p) for _, m, p, _ in requests}
    # What the scenario covers: every engine route rlmesh calls (the router's /workers is
    # the SGLang router's, a separate package, and is not checked here).
    assert {p for _, p in called} == {
        "/model_info", "/server_info", "/generate", "/abort_request", "/pause_generation",
        "/continue_generation", "/init_weights_update_group", "/begin_weight_update",
        "/update_weights_from_distributed", "/end_weight_update", "/destroy_weights_update_group",
        "/update_weights_from_disk", "/release_memory_occupation", "/resume_memory_occupation",
        "/update_weights_from_tensor", "/health",
    }  # fmt: skip
    served = sglang["routes"]
    missing = [
        f"{m} {p}" for m, p in sorted(called) if m not in getattr(served.get(p), "methods", ()) and p not in PROBED
    ]
    assert not missing, f"SGLang {sglang['source'].version} does not serve: {missing}"


def test_rlmesh_requests_and_reads_match_sglangs_declarations(sglang, sent):
    requests, reads = sent
    found = request_differences(sglang, requests) + read_differences(sglang, requests, reads)
    found = list(dict.fromkeys(found))
    new = [d for d in found if d not in EXPECTED]
    gone = [d for d in EXPECTED if d not in found]
    assert not new and not gone, (
        f"against SGLang {sglang['source'].version}:\n new differences (fix the request, or list them in EXPECTED "
        "and docs/engine-api.md):\n  " + "\n  ".join(new) + "\n differences no longer found:\n  " + "\n  ".join(gone)
    )


def test_what_rlmesh_reads_of_a_generate_answer_is_what_sglang_answers(sglang, sent):
    _, reads = sent
    generate = sglang["generate"]
    # rlmesh maps every finish reason SGLang gives to a sample status
    assert generate.finish_types and generate.finish_types <= set(FINISH_STATUS)
    # it takes an output log-prob entry as [logprob, token_id, ...]
    if generate.logprob_entry:
        assert generate.logprob_entry[:2] == ["logprob", "token_id"]
    # the fields a rollout depends on are among those read (and, above, declared by SGLang)
    assert {
        "output_ids", "text", "meta_info.output_token_logprobs", "meta_info.finish_reason.type",
        "meta_info.weight_version", "meta_info.completion_tokens", "meta_info.prompt_tokens",
    } <= reads["/generate"]  # fmt: skip


def test_the_recording_engine_answers_only_what_sglang_answers(sglang):
    """The fake engine must not invent fields, or the read check above would prove nothing."""
    if sglang["source"].version != sglang_source.PINNED_VERSION:
        pytest.skip(f"the recording engine answers as SGLang {sglang_source.PINNED_VERSION} does")
    routes = sglang["routes"]
    for path, answer in ANSWERS.items():
        if path not in routes:
            continue
        if answer is None:
            assert sglang_source.answer_is_none(routes[path]), path
        elif answer is not EMPTY:
            assert set(answer) <= answer_keys(sglang, path), path
    assert set(DONE) <= answer_keys(sglang, "/update_weights_from_distributed")
    out = generate_answer({"sampling_params": {"max_new_tokens": 2}, "rid": "r", "input_ids": [1]})
    assert set(out) <= sglang["generate"].top and set(out["meta_info"]) <= sglang["generate"].meta_info
    assert set(out["meta_info"]["finish_reason"]) <= sglang["generate"].finish_reason
    if sglang["contract"] is not None:
        sglang["contract"].GenerateResponse.from_json_value(out)


def test_the_docs_list_every_difference():
    text = DOCS.read_text()
    section = text[text.index("## Checked against SGLang's source") :]
    section = section[: section.index("\n## ", 3)]
    assert all(f"`{field}`" in section for field in EXPECTED.values()), [
        f for f in EXPECTED.values() if f"`{f}`" not in section
    ]


def test_a_resumed_sample_counts_what_it_generated_toward_min_new_tokens(sent):
    """The run asks 3 new tokens at least 2; the sample already has 2: 1 more, at least 0
    (the run's 2 were SGLang's 400: a minimum above the maximum)."""
    requests, _ = sent
    resumed = [b["sampling_params"] for phase, _, _, b in requests if phase == "generate (a partial sample resumed)"]
    assert [(p["max_new_tokens"], p["min_new_tokens"]) for p in resumed] == [(1, 0)]
