"""The OpenAI-compatible endpoint and the 'openai_agent' generate function, driven by agents
written with the official `openai` client against the real reference engine: a
conversation's calls become one sample with the engine's own tokens and log-probs (the
trainer's log-probs match them), tool turns are masked, other conversations become their
own samples, budgets cut an episode short, and what OpenAI refuses is refused the same way."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlmesh.cli.tiny_model import build_char_tokenizer
from rlmesh.common.auth import stack_token
from rlmesh.common.model_building import build_hf_model
from rlmesh.common.net import free_port
from rlmesh.common.sample import Sample, SampleGroup, Status
from rlmesh.rollout.agents.openai_agent import openai_agent_generate
from rlmesh.rollout.agents.openai_models import OpenAIAgentOptions
from rlmesh.rollout.agents.openai_server import close_shared_endpoint
from rlmesh.rollout.agents.openai_session import NO_CALL_REASON, ModelCall, samples_from_calls
from rlmesh.rollout.agents.tool_parsers import ParsedTurn, ToolCall, register_tool_parser
from rlmesh.rollout.config import Settings as RolloutSettings
from rlmesh.rollout.engine_client import EngineError, EnginePool
from rlmesh.rollout.generation import GenerateContext
from rlmesh.rollout.rollout import GenerateChoice, RolloutManager
from tests.helpers.masks import mask_runs

# What the agents below saw, for the tests to compare with the samples (tests run one at a time).
SEEN: dict[str, Any] = {}

LOOKUP_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a word up.",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
    },
}


@register_tool_parser("test_openai_every_turn_calls")
def _every_turn_calls(text: str, finish_reason: str | None) -> ParsedTurn:
    """The tiny model writes random characters: read every turn as a call to lookup, and keep
    the text as the content (the tiny chat template renders only content)."""
    return ParsedTurn(content=text, calls=[ToolCall(id="call_0", name="lookup", arguments={"q": text[:3]})])


# ---- the operator's agents for these tests (named by import path in settings.agents) -----------------


def client(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)


async def tool_agent(base_url: str, sample: Sample) -> None:
    """Ask, run the tool the model called, ask again with the tool's answer."""
    llm = client(base_url)
    messages: list[dict] = [{"role": "user", "content": sample.prompt}]
    first = await llm.chat.completions.create(model="policy", messages=messages, tools=[LOOKUP_TOOL], logprobs=True)
    reply = first.choices[0].message
    messages += [
        reply.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": "42"},
    ]
    second = await llm.chat.completions.create(model="policy", messages=messages, tools=[LOOKUP_TOOL], logprobs=True)
    SEEN["answers"] = [first, second]


async def two_conversations_agent(base_url: str, sample: Sample) -> None:
    llm = client(base_url)
    for question in ("first question", "second question"):
        answer = await llm.chat.completions.create(model="policy", messages=[{"role": "user", "content": question}])
        SEEN.setdefault("answers", []).append(answer)


def completions_agent(base_url: str, sample: Sample) -> None:
    """Plain code with the synchronous client: it continues its own text."""
    llm = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
    first = llm.completions.create(model="policy", prompt=sample.prompt, max_tokens=3, logprobs=1)
    second = llm.completions.create(
        model="policy", prompt=sample.prompt + first.choices[0].text + "!", max_tokens=4, logprobs=1
    )
    SEEN["answers"] = [first, second]


async def looping_agent(base_url: str, sample: Sample) -> None:
    """Calls until the endpoint says the tokens ran out."""
    llm = client(base_url)
    messages: list[dict] = [{"role": "user", "content": sample.prompt}]
    for _ in range(10):
        answer = await llm.chat.completions.create(model="policy", messages=messages, max_tokens=4)
        SEEN.setdefault("answers", []).append(answer)
        if answer.usage.completion_tokens == 0:
            return
        messages += [
            {"role": "assistant", "content": answer.choices[0].message.content},
            {"role": "user", "content": "more"},
        ]


async def refused_requests_agent(base_url: str, sample: Sample) -> None:
    """What the endpoint refuses, as OpenAI would; then it gives up without a model call."""
    llm = client(base_url)
    messages = [{"role": "user", "content": sample.prompt}]
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        await llm.chat.completions.create(model="policy", messages=messages, n=2)
    with pytest.raises(openai.BadRequestError, match="stream is not supported"):
        await llm.chat.completions.create(model="policy", messages=messages, stream=True)
    with pytest.raises(openai.BadRequestError, match="only text content"):
        await llm.chat.completions.create(
            model="policy",
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
        )
    elsewhere = client(base_url.split("/samples/")[0] + "/samples/not-a-token/v1")
    with pytest.raises(openai.NotFoundError, match="no sample is generating under this URL"):
        await elsewhere.chat.completions.create(model="policy", messages=messages)
    assert [m.id for m in (await llm.models.list()).data] == ["policy"]
    async with httpx.AsyncClient(timeout=30) as http:
        broken = await http.post(base_url + "/chat/completions", content=b"{not json")
        too_many = await http.post(base_url + "/chat/completions", json={"messages": messages * 1025})
    for r in (broken, too_many):
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert "messages" in too_many.json()["error"]["message"]
    SEEN["done"] = True


async def raising_agent(base_url: str, sample: Sample) -> None:
    await client(base_url).chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    raise RuntimeError("the agent's own bug")


AGENTS = {
    name: f"tests.service.test_openai_endpoint:{name}"
    for name in (
        "tool_agent",
        "two_conversations_agent",
        "completions_agent",
        "looping_agent",
        "refused_requests_agent",
        "raising_agent",
    )
}

# What the agents send back must tokenise to the engine's ids for their calls to chain. The
# tiny model is random: it emits </s>, <pad>, <unk> (so the text spells special tokens out) and
# newlines, which its tokenizer reads as <unk> next to another newline (so none is generated).
NEWLINE = build_char_tokenizer().get_vocab()["\n"]
ROUND_TRIPS = {"temperature": 1.0, "skip_special_tokens": False, "logit_bias": {str(NEWLINE): -100.0}}
# Every call generates its full max_new_tokens (finish "length").
LONG_TURNS = {**ROUND_TRIPS, "max_new_tokens": 6, "ignore_eos": True}
# Every token ends its turn (finish "stop"), kept in the text.
ONE_TOKEN_TURNS = {**ROUND_TRIPS, "max_new_tokens": 4, "stop_token_ids": list(range(99)), "no_stop_trim": True}


def generate(tiny_model_dir, engine_url, options: dict, sampling: dict, prompt: str = "rev ab=") -> Any:
    SEEN.clear()
    settings = RolloutSettings(agents=AGENTS, engine_urls=[engine_url])
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)

    async def go():
        pool = EnginePool([engine_url], "", 30, 30, stack_token() or "", 60)
        try:
            ctx = GenerateContext(
                tokenizer=tokenizer,
                engine=pool.for_generation(),
                settings=settings,
                options=OpenAIAgentOptions.model_validate(options, context={"settings": settings}),
            )
            return await openai_agent_generate(ctx, Sample(index=3, prompt=prompt, label="ba"), sampling)
        finally:
            await close_shared_endpoint()
            await pool.close()

    return asyncio.run(go())


def trainer_log_probs(tiny_model_dir, s: Sample) -> list[float]:
    """Response-token log-probs of the tiny model from one forward over the sample's tokens
    (with the logit bias the engine sampled with)."""
    model = build_hf_model(AutoModelForCausalLM.from_pretrained, tiny_model_dir).eval()
    with torch.no_grad():
        logits = model(torch.tensor([s.tokens])).logits[0].float()
        logits[:, NEWLINE] -= 100.0
        logp = logits.log_softmax(-1)
    first = len(s.tokens) - s.response_length
    return [float(logp[first + j - 1, s.tokens[first + j]]) for j in range(s.response_length)]


# ---- a conversation becomes one sample ------------------------------------------------------------


def test_a_tool_using_conversation_is_one_sample_of_the_engines_tokens(tiny_model_dir, engine_url):
    sample = generate(
        tiny_model_dir, engine_url, {"agent": "tool_agent", "tool_parser": "test_openai_every_turn_calls"}, LONG_TURNS
    )
    first, second = SEEN["answers"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)

    # The model's turns reached the agent as OpenAI answers, tool calls included.
    for answer in (first, second):
        (choice,) = answer.choices
        assert choice.finish_reason == "length"  # LONG_TURNS: every turn runs to max_new_tokens
        assert [c.function.name for c in choice.message.tool_calls] == ["lookup"]
        assert answer.usage.completion_tokens == 6 == len(choice.logprobs.content)
    assert first.choices[0].message.tool_calls[0].id != second.choices[0].message.tool_calls[0].id
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 6

    assert isinstance(sample, Sample) and sample.index == 3 and sample.label == "ba"
    assert sample.prompt_tokens == tokenizer.apply_chat_template(
        [{"role": "user", "content": "rev ab="}], tokenize=True, add_generation_prompt=True, return_dict=False
    )
    # model turn, the tool turn the template put between, model turn
    assert mask_runs(sample.loss_mask) == [(1, 6), (0, len(tokenizer("\nT: 42\nA: ")["input_ids"])), (1, 6)]
    assert tokenizer.decode(sample.response_tokens[6:-6]) == "\nT: 42\nA: "
    generated = [t for t, m in zip(sample.response_tokens, sample.loss_mask) if m]
    assert tokenizer.decode(generated) == first.choices[0].message.content + second.choices[0].message.content
    recorded = [lp for lp, m in zip(sample.rollout_log_probs, sample.loss_mask) if m]
    assert recorded == pytest.approx([t.logprob for a in (first, second) for t in a.choices[0].logprobs.content])
    assert all(lp == 0.0 for lp, m in zip(sample.rollout_log_probs, sample.loss_mask) if not m)
    assert sample.response == second.choices[0].message.content
    assert sample.status == Status.TRUNCATED and sample.weight_versions == [0]
    assert sample.metadata["openai_agent"] == {"segment": 0, "segments": 1, "calls": 2}

    # The trainer's log-probs of the model's own tokens are the engine's.
    trainer = trainer_log_probs(tiny_model_dir, sample)
    for mine, engine, m in zip(trainer, sample.rollout_log_probs, sample.loss_mask):
        if m:
            assert mine == pytest.approx(engine, abs=1e-4)


def test_a_turn_that_ends_with_tool_calls_says_so(tiny_model_dir, engine_url):
    sample = generate(
        tiny_model_dir,
        engine_url,
        {"agent": "tool_agent", "tool_parser": "test_openai_every_turn_calls"},
        ONE_TOKEN_TURNS,
    )
    first, second = SEEN["answers"]
    assert first.choices[0].finish_reason == second.choices[0].finish_reason == "tool_calls"
    assert mask_runs(sample.loss_mask)[0] == (1, 1) and mask_runs(sample.loss_mask)[-1] == (1, 1)
    assert sample.status == Status.COMPLETED


def test_completions_continue_the_same_sample(tiny_model_dir, engine_url):
    sample = generate(tiny_model_dir, engine_url, {"agent": "completions_agent"}, LONG_TURNS)
    first, second = SEEN["answers"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert sample.prompt_tokens == tokenizer("rev ab=")["input_ids"]
    assert mask_runs(sample.loss_mask) == [(1, 3), (0, 1), (1, 4)]  # the agent's "!" between the calls
    assert tokenizer.decode(sample.response_tokens) == first.choices[0].text + "!" + second.choices[0].text
    assert [lp for lp, m in zip(sample.rollout_log_probs, sample.loss_mask) if m] == pytest.approx(
        first.choices[0].logprobs.token_logprobs + second.choices[0].logprobs.token_logprobs
    )
    assert first.choices[0].finish_reason == "length" and sample.response == second.choices[0].text


def test_separate_conversations_are_separate_samples(tiny_model_dir, engine_url):
    samples = generate(tiny_model_dir, engine_url, {"agent": "two_conversations_agent"}, LONG_TURNS)
    answers = SEEN["answers"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert [s.metadata["openai_agent"] for s in samples] == [
        {"segment": 0, "segments": 2, "calls": 1},
        {"segment": 1, "segments": 2, "calls": 1},
    ]
    for s, question, answer in zip(samples, ("first question", "second question"), answers):
        assert tokenizer.decode(s.prompt_tokens) == f"U: {question}\nA: "
        assert tokenizer.decode(s.response_tokens) == answer.choices[0].message.content
        assert s.loss_mask == [1] * 6 and s.index == 3
        # each is scored as the episode: by the agent's last word
        assert s.response == answers[-1].choices[0].message.content


def test_calls_past_the_budget_are_cut_off_without_the_engine(tiny_model_dir, engine_url):
    sample = generate(tiny_model_dir, engine_url, {"agent": "looping_agent", "max_total_tokens": 10}, LONG_TURNS)
    answers = SEEN["answers"]
    # 4 + 4 tokens, then 2 left of the 10, then none: answered "length" with nothing
    assert [a.usage.completion_tokens for a in answers] == [4, 4, 2, 0]
    assert answers[-1].choices[0].finish_reason == "length" and answers[-1].choices[0].message.content == ""
    assert sample.metadata["openai_agent"]["calls"] == 3 and sum(sample.loss_mask) == 10
    assert sample.status == Status.TRUNCATED

    sample = generate(tiny_model_dir, engine_url, {"agent": "looping_agent", "max_calls": 2}, ONE_TOKEN_TURNS)
    assert [a.usage.completion_tokens for a in SEEN["answers"]] == [1, 1, 0]
    assert sample.metadata["openai_agent"]["calls"] == 2 and sample.status == Status.TRUNCATED


# ---- refusals and failures ------------------------------------------------------------------------


def test_requests_openai_would_refuse_are_refused_alike(tiny_model_dir, engine_url):
    sample = generate(tiny_model_dir, engine_url, {"agent": "refused_requests_agent"}, LONG_TURNS)
    assert SEEN["done"]
    assert sample.status == Status.FAILED and sample.metadata["failure"] == NO_CALL_REASON
    assert sample.tokens == [] and sample.response_length == 0


def test_an_agents_exception_fails_its_sample(tiny_model_dir, engine_url):
    with pytest.raises(RuntimeError, match="the agent's own bug"):
        generate(tiny_model_dir, engine_url, {"agent": "raising_agent"}, LONG_TURNS)


def test_in_a_rollout_a_raising_agent_fails_its_sample_and_conversations_add_samples(tiny_model_dir, engine_url):
    settings = RolloutSettings(agents=AGENTS, engine_urls=[engine_url], tokenizer_path=str(tiny_model_dir))

    async def go():
        pool = EnginePool([engine_url], "", 30, 30, stack_token() or "", 60)
        manager = RolloutManager(settings, pool, buffer=None, reward=None)
        try:
            groups = []
            for name in ("raising_agent", "two_conversations_agent"):
                group = SampleGroup("g", 0, [Sample(index=0, prompt="a"), Sample(index=1, prompt="b")])
                generator = manager.generator(GenerateChoice("openai_agent", {"agent": name}))
                groups.append(
                    await manager._generate_group(group, LONG_TURNS, asyncio.Semaphore(4), False, generator, {})
                )
            return groups
        finally:
            await close_shared_endpoint()
            await pool.close()

    failed, split = asyncio.run(go())
    assert [s.status for s in failed.samples] == [Status.FAILED, Status.FAILED]
    assert failed.samples[0].metadata["failure"] == "RuntimeError: the agent's own bug"
    # two samples of two conversations each: four in the group
    assert [(s.index, s.metadata["openai_agent"]["segment"]) for s in split.samples] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_an_engine_outage_is_raised_for_the_rollout_to_retry(tiny_model_dir):
    # The agent sees an error answer (and may swallow it); the engine's error is what is raised.
    with pytest.raises(EngineError, match="/generate failed"):
        generate(tiny_model_dir, f"http://127.0.0.1:{free_port()}", {"agent": "tool_agent"}, LONG_TURNS)


def test_options_name_a_registered_agent():
    settings = RolloutSettings(agents=AGENTS)
    with pytest.raises(ValueError, match="unknown agent 'nope'"):
        OpenAIAgentOptions.model_validate({"agent": "nope"}, context={"settings": settings})
    with pytest.raises(ValueError, match="unknown tool parser 'xml'"):
        OpenAIAgentOptions.model_validate({"agent": "tool_agent", "tool_parser": "xml"})
    with pytest.raises(ValueError, match="max_calls"):
        OpenAIAgentOptions.model_validate({"agent": "tool_agent", "max_calls": 257})


def test_a_call_extends_the_conversation_it_continues():
    """Chains by token prefix: a retry from an earlier point starts its own sample."""

    def call(seq: int, prompt: list[int], output: list[int]) -> ModelCall:
        return ModelCall(
            seq,
            prompt,
            {
                "output_ids": output,
                "text": f"t{seq}",
                "meta_info": {
                    "finish_reason": {"type": "stop"},
                    "weight_version": str(seq),
                    "output_token_logprobs": [[-0.5, t, None] for t in output],
                },
            },
        )

    calls = [call(0, [1, 2], [3]), call(1, [1, 2, 3, 4], [5, 6]), call(2, [1, 2], [7])]
    whole, retry = samples_from_calls(Sample(prompt="p"), calls)
    assert whole.tokens == [1, 2, 3, 4, 5, 6] and whole.response_length == 4
    assert whole.loss_mask == [1, 0, 1, 1] and whole.rollout_log_probs == [-0.5, 0.0, -0.5, -0.5]
    assert whole.weight_versions == [0, 1] and whole.response == retry.response == "t2"
    assert retry.tokens == [1, 2, 7] and retry.loss_mask == [1]
