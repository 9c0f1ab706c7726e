"""The built-in agent loop against a real engine: turns continue the engine's own tokens,
tool turns are appended as the chat template renders them with loss mask 0, the trainer's
log-probs match the engine's on generated tokens; tools fail as text, never as errors;
runs choose the loop (and its options) through the REST API."""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlmesh.cli.demo import run_metrics
from rlmesh.common.auth import stack_token
from rlmesh.common.model_building import build_hf_model
from rlmesh.common.run_config import TrainerRunConfig
from rlmesh.common.sample import Sample, SampleGroup, Status
from rlmesh.rollout.agents.loop import AgentOptions, agent_generate, tool_turn_text
from rlmesh.rollout.agents.tool_parsers import ParsedTurn, ToolCall, register_tool_parser
from rlmesh.rollout.agents.tools import ToolBox
from rlmesh.rollout.config import HttpTool
from rlmesh.rollout.config import Settings as RolloutSettings
from rlmesh.rollout.engine_client import EnginePool
from rlmesh.rollout.generation import GenerateContext
from rlmesh.trainer.backend import TorchBackend
from tests.helpers.masks import mask_runs
from tests.helpers.stack import start_local_stack, wait_for_run

# ---- the operator's plug-ins for these tests (named by import path in settings) -------------


def echo(text: str = "") -> str:
    """Say the text back."""
    return f"echo:{text[:3]}"


def explode() -> str:
    raise RuntimeError("the tool broke")


async def sleepy() -> str:
    await asyncio.sleep(30)
    return "too late"


@register_tool_parser("test_always_echo")
def _always_echo(text: str, finish_reason: str | None) -> ParsedTurn:
    """The tiny model writes random characters: this parser reads every turn as a call to
    echo, so an episode runs all its turns."""
    return ParsedTurn(content="", calls=[ToolCall(id="call_0", name="echo", arguments={"text": text})])


async def flaky_generate(ctx, sample: Sample, sampling_params: dict) -> Sample:
    """Fails every other sample, the way a buggy custom generate function does."""
    if sample.index % 2 == 0:
        raise RuntimeError("this sample's generation broke")
    from rlmesh.rollout.generation import default_generate

    return await default_generate(ctx, sample, sampling_params)


def stuck() -> str:
    """A plain function that hangs (its thread cannot be stopped; the call is abandoned)."""
    time.sleep(3)
    return "too late"


TOOLS = {
    "echo": "tests.service.test_agent:echo",
    "explode": "tests.service.test_agent:explode",
    "sleepy": "tests.service.test_agent:sleepy",
    "stuck": "tests.service.test_agent:stuck",
}


# ---- tools --------------------------------------------------------------------------------


def test_python_tools_have_schemas_from_their_signatures():
    box = ToolBox(RolloutSettings(tools=TOOLS))
    (schema,) = box.schemas(["echo"])
    assert schema == {
        "type": "function",
        "function": {
            "name": "echo",
            "description": "Say the text back.",
            "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": []},
        },
    }


def test_tool_failures_come_back_as_text():
    box = ToolBox(RolloutSettings(tools=TOOLS))
    allowed = ["echo", "explode", "sleepy"]

    async def calls():
        return await asyncio.gather(
            box.call("echo", {"text": "abcdef"}, allowed, 5),
            box.call("nope", {}, allowed, 5),
            box.call("explode", {}, allowed, 5),
            box.call("sleepy", {}, allowed, 0.2),
            box.call("echo", {"wrong": 1}, allowed, 5),
            box.call("explode", {}, ["echo"], 5),
        )

    ok, unknown, broke, slow, bad_args, not_offered = asyncio.run(calls())
    assert ok.ok and ok.text == "echo:abc"
    assert not unknown.ok and "no tool named 'nope'" in unknown.text and "echo" in unknown.text
    assert "RuntimeError: the tool broke" in broke.text
    assert "did not answer within 0.2 s" in slow.text
    assert "TypeError" in bad_args.text
    assert "no tool named 'explode'" in not_offered.text


def test_a_hanging_plain_function_tool_times_out():
    box = ToolBox(RolloutSettings(tools=TOOLS))
    result = asyncio.run(box.call("stuck", {}, ["stuck"], 0.3))
    # The call gave up at its deadline (the sample goes on); the thread finished later, unheard.
    assert not result.ok and result.text == "error: tool 'stuck' did not answer within 0.3 s"


@pytest.fixture
def http_tool_url():
    """An HTTP tool that fails its first call with a 503, then adds a and b."""
    calls = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            calls.append(body)
            status, text = (503, "busy") if len(calls) == 1 else (200, str(body["a"] + body["b"]))
            self.send_response(status)
            self.send_header("Content-Length", str(len(text)))
            self.end_headers()
            self.wfile.write(text.encode())

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/add", calls
    server.shutdown()


def test_http_tools_are_retried_and_answer_with_their_body(http_tool_url):
    url, calls = http_tool_url
    box = ToolBox(RolloutSettings(http_tools=[HttpTool(name="add", url=url, retries=2, timeout_seconds=5)]))
    result = asyncio.run(box.call("add", {"a": 2, "b": 3}, ["add"], 5))
    assert result.ok and result.text == "5" and len(calls) == 2


def test_an_http_tool_that_never_answers_fails_as_text_after_its_retries():
    hung = []
    stop = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            hung.append(1)
            stop.wait(30)  # never answers within the tool's timeout

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/slow"
        box = ToolBox(RolloutSettings(http_tools=[HttpTool(name="slow", url=url, retries=1, timeout_seconds=0.3)]))
        result = asyncio.run(box.call("slow", {}, ["slow"], 5))
    finally:
        stop.set()
        server.shutdown()
    assert not result.ok and "ReadTimeout" in result.text and "after 2 tries" in result.text
    assert len(hung) == 2


def test_options_are_checked_against_the_service():
    settings = RolloutSettings(tools=TOOLS)
    with pytest.raises(ValueError, match="unknown tools 'grep'"):
        AgentOptions.model_validate({"tools": ["grep"]}, context={"settings": settings})
    with pytest.raises(ValueError, match="unknown tool parser 'xml'"):
        AgentOptions.model_validate({"tool_parser": "xml"})


# ---- the loop against a real engine ----------------------------------------------------------


def test_a_tool_turn_is_what_the_chat_template_puts_between_turns(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    history = [{"role": "user", "content": "hi"}]
    text = tool_turn_text(
        tokenizer,
        history,
        [],
        "<tool_call>x</tool_call>",
        tokenizer.eos_token_id,
        [{"role": "tool", "content": "42", "tool_call_id": "call_0", "name": "echo"}],
    )
    # The tiny template: "U: hi\nA: <turn>\nT: 42\nA: "; the model ended its turn with EOS.
    assert text == "\nT: 42\nA: "


# The tiny model is untrained and seldom ends a turn by itself: here every character ends
# it (finish "stop"), as an end-of-turn token would: one-token turns.
ONE_TOKEN_TURNS = {"stop_token_ids": list(range(3, 99))}


def run_episode(
    tiny_model_dir, engine_url, options: dict, sample: Sample, max_new_tokens: int = 6, sampling: dict = ONE_TOKEN_TURNS
) -> Sample:
    settings = RolloutSettings(tools=TOOLS, engine_urls=[engine_url])
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)

    async def go():
        pool = EnginePool([engine_url], "", 30, 30, stack_token() or "", 60)
        try:
            ctx = GenerateContext(
                tokenizer=tokenizer,
                engine=pool.for_generation(),
                settings=settings,
                options=AgentOptions.model_validate(options, context={"settings": settings}),
                tools=ToolBox(settings),
            )
            return await agent_generate(ctx, sample, {"max_new_tokens": max_new_tokens, "temperature": 1.0, **sampling})
        finally:
            await pool.close()

    return asyncio.run(go())


def test_multi_turn_episode_keeps_the_engines_tokens_and_masks_tool_turns(tiny_model_dir, engine_url):
    sample = run_episode(
        tiny_model_dir,
        engine_url,
        {"tool_parser": "test_always_echo", "max_turns": 3, "max_response_tokens": 200},
        Sample(prompt="rev ab="),
        max_new_tokens=6,
    )
    turns = sample.metadata["agent_turns"]
    assert [t["role"] for t in turns] == ["assistant", "tool", "assistant", "tool", "assistant", "tool"]
    # Still calling tools after the last turn: the episode was cut, not finished.
    assert sample.status == Status.TRUNCATED
    assert sample.response == turns[4]["content"]
    assert len(sample.loss_mask) == len(sample.rollout_log_probs) == sample.response_length
    runs = mask_runs(sample.loss_mask)
    assert [m for m, _ in runs] == [1, 0, 1, 0, 1]  # model, tool, model, tool, model
    assert all(lp == 0.0 for lp, m in zip(sample.rollout_log_probs, sample.loss_mask) if m == 0)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    first_tool = sample.response_tokens[runs[0][1] : runs[0][1] + runs[1][1]]
    assert (
        tokenizer.decode(first_tool) == f"\nT: {turns[1]['content']}\nA: "
        or tokenizer.decode(first_tool) == f"T: {turns[1]['content']}\nA: "
    )

    # The trainer's log-probs of the model's own tokens are the engine's.
    model = build_hf_model(AutoModelForCausalLM.from_pretrained, tiny_model_dir).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([sample.tokens])).logits[0].float(), dim=-1)
    start = len(sample.tokens) - sample.response_length
    for j, (m, engine_lp) in enumerate(zip(sample.loss_mask, sample.rollout_log_probs)):
        if m:
            assert float(logp[start + j - 1, sample.tokens[start + j]]) == pytest.approx(engine_lp, abs=1e-4)

    # ... and so are the trainer's own: its first step recomputes the log-probs of the
    # masked-in tokens (padded, micro-batched) and compares them with the engine's.
    other = copy.deepcopy(sample)
    sample.reward, other.reward = 1.0, 0.0
    backend = TorchBackend(
        TrainerRunConfig.model_validate(
            {"model_path": str(tiny_model_dir), "micro_batch_size": 2, "optimizer": {"lr": 1e-3}, "device": "cpu"}
        ),
        torch.device("cpu"),
    )
    metrics = backend.train_step([SampleGroup("g0", 0, [sample, other])])
    assert metrics["train_rollout_logprob_abs_diff"] < 1e-4
    assert metrics["trained_tokens"] == 2 * sum(sample.loss_mask)  # the tool turns are not trained


def test_a_turn_without_calls_ends_the_episode(tiny_model_dir, engine_url):
    sample = run_episode(tiny_model_dir, engine_url, {"tool_parser": "none"}, Sample(prompt="hi"))
    assert [t["role"] for t in sample.metadata["agent_turns"]] == ["assistant"]
    assert sample.status in (Status.COMPLETED, Status.TRUNCATED)
    assert set(sample.loss_mask) == {1}


def test_the_turn_limit_cuts_a_turn_and_its_calls_are_not_run(tiny_model_dir, engine_url):
    # No stop tokens and no EOS (a sampled EOS would end the turn before its limit, and its
    # call would run): the turn runs to its own limit (2), not to the run's max_new_tokens (6).
    sample = run_episode(
        tiny_model_dir,
        engine_url,
        {"tool_parser": "test_always_echo", "max_turns": 3, "max_tokens_per_turn": 2},
        Sample(prompt="hi"),
        sampling={"ignore_eos": True},
    )
    assert [t["role"] for t in sample.metadata["agent_turns"]] == ["assistant"]
    assert sample.response_length == 2 and sample.status == Status.TRUNCATED


def test_the_response_budget_bounds_the_episode(tiny_model_dir, engine_url):
    sample = run_episode(
        tiny_model_dir,
        engine_url,
        {"tool_parser": "test_always_echo", "max_turns": 10, "max_response_tokens": 12},
        Sample(prompt="hi"),
        max_new_tokens=5,
    )
    assert sample.response_length <= 12 and sample.status == Status.TRUNCATED


# ---- chosen per run through the REST API --------------------------------------------------


def run_config(tmp_path, tiny_model_dir, generate: dict) -> dict:
    dataset = tmp_path / "train.jsonl"
    if not dataset.exists():
        dataset.write_text(
            "".join(json.dumps({"prompt": f"rev {a}{b}=", "label": f"{b}{a}"}) + "\n" for a in "abcd" for b in "abcd")
        )
    return {
        "model_path": str(tiny_model_dir),
        "datasets": [{"name": "train", "path": str(dataset)}],
        "num_rollouts": 2,
        "rollout": {
            "rollout_batch_size": 2,
            "n_samples_per_prompt": 2,
            "sampling": {"max_new_tokens": 4},
            "generate": generate,
        },
        "optimizer": {"lr": 1e-3},
    }


@pytest.fixture
def agent_stack(redis_url, start_in_loop, engine_url, tmp_path):
    return start_local_stack(
        start_in_loop,
        redis_url,
        engine_url,
        tmp_path,
        rollout_settings={"tools": TOOLS, "generate_functions": {"flaky": "tests.service.test_agent:flaky_generate"}},
    )


@pytest.mark.slow
def test_a_run_trains_on_multi_turn_episodes(agent_stack, tmp_path, tiny_model_dir):
    api = agent_stack.api
    config = run_config(
        tmp_path,
        tiny_model_dir,
        {
            "name": "agent",
            "options": {
                "tools": ["echo"],
                "tool_parser": "test_always_echo",
                "max_turns": 2,
                "max_response_tokens": 64,
            },
        },
    )
    # A third of the characters end a turn (see ONE_TOKEN_TURNS): most first turns end within 8.
    config["rollout"]["sampling"] = {"max_new_tokens": 8, "stop_token_ids": list(range(3, 35))}
    r = api.post("/runs", json=config)
    assert r.status_code == 201, r.text
    run = wait_for_run(api, r.json()["id"])
    assert run["status"] == "completed", run["error"]
    rl = [m for m in run_metrics(api, run["id"]) if "rollout/reward_mean" in m]
    # longer than one turn can be: a tool turn and a second turn followed the first
    assert len(rl) == 2 and max(m["rollout/response_length_mean"] for m in rl) > 8
    assert all(m["train/trained_tokens"] > 0 for m in rl)


@pytest.mark.slow
def test_a_failing_sample_does_not_fail_the_run(agent_stack, tmp_path, tiny_model_dir):
    api = agent_stack.api
    r = api.post("/runs", json=run_config(tmp_path, tiny_model_dir, {"name": "flaky"}))
    run = wait_for_run(api, r.json()["id"])
    assert run["status"] == "completed", run["error"]
    assert all(m["rollout/failed_ratio"] == 0.5 for m in run_metrics(api, run["id"]) if "rollout/failed_ratio" in m)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("generate", "message"),
    [
        ({"name": "no_such_loop"}, "unknown generate function 'no_such_loop'"),
        ({"name": "agent", "options": {"tools": ["grep"]}}, "unknown tools 'grep'"),
        ({"name": "agent", "options": {"max_turns": 0}}, "max_turns"),
        ({"name": "flaky", "options": {"x": 1}}, "takes no options"),
        ({"name": "rlmesh.rollout.agents.loop:agent_generate"}, "String should match pattern"),
    ],
)
def test_a_bad_generate_choice_is_refused_when_the_run_is_created(
    agent_stack, tmp_path, tiny_model_dir, generate, message
):
    r = agent_stack.api.post("/runs", json=run_config(tmp_path, tiny_model_dir, generate))
    assert r.status_code == 422 and message in r.text, r.text
    assert agent_stack.api.get("/runs").json() == []


def test_the_agent_demo_warm_start_teaches_what_the_loop_builds(tiny_model_dir):
    from rlmesh.cli import agent_demo

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    call = agent_demo.call_text("abc")
    between = tool_turn_text(
        tokenizer,
        [{"role": "user", "content": "code abc="}],
        [],
        call,
        tokenizer.convert_tokens_to_ids(">"),
        [{"role": "tool", "content": agent_demo.code("abc"), "tool_call_id": "call_0"}],
    )
    assert agent_demo.episode_text("abc") == call + between + agent_demo.code("abc")
    config = agent_demo.agent_demo_config(str(tiny_model_dir), *(tiny_model_dir / n for n in "abc"), 1, 1)
    assert config.rollout.generate.name == "agent"
