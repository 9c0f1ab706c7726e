"""Tools from a dataset's `tools` key reach the chat template (apply_chat_template(tools=...))
on every path a prompt takes: templated by the buffer, by the default generate function
(chat messages, or apply_chat_template on a text prompt) and by the agent loop (beside
the rollout service's own tools). The tiny model's template ignores tools, so these tests
give its tokenizer a template that lists them."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
from transformers import AutoTokenizer

from rlmesh.cli.tiny_model import CHAT_TEMPLATE
from rlmesh.common.auth import stack_token
from rlmesh.common.run_config import DatasetConfig
from rlmesh.common.sample import Sample
from rlmesh.rollout.agents.loop import AgentOptions, agent_generate
from rlmesh.rollout.agents.tools import ToolBox
from rlmesh.rollout.config import Settings as RolloutSettings
from rlmesh.rollout.engine_client import EnginePool
from rlmesh.rollout.generation import GenerateContext, default_generate
from rlmesh.v1 import buffer_pb2
from tests.helpers.buffer import prompts

TOOLS_TEMPLATE = (
    "{% if tools %}Tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}{{ '\\n' }}{% endif %}"
    + CHAT_TEMPLATE
)
CALC = {"type": "function", "function": {"name": "calc", "description": "Adds.", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def tools_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model, its tokenizer's template showing tools."""
    out = tmp_path_factory.mktemp("tools-model") / "model"
    shutil.copytree(tiny_model_dir, out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.chat_template = TOOLS_TEMPLATE
    tokenizer.save_pretrained(out)
    return out


def test_a_runs_datasets_read_the_tools_key_by_default():
    assert DatasetConfig(name="train", path="rows.jsonl").tools_key == "tools"


def test_the_buffer_templates_a_prompt_with_its_rows_tools(buffer, tmp_path, tools_model_dir):
    stub = buffer()
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "What is 1+1?", "tools": [CALC]}) + "\n")
    stub.CreateRun(
        buffer_pb2.CreateRunRequest(
            run_id="r1",
            n_samples_per_prompt=1,
            tokenizer_path=str(tools_model_dir),
            datasets=[
                buffer_pb2.DatasetSpec(name="train", path=str(path), tools_key="tools", apply_chat_template=True)
            ],
        )
    )
    (group,) = prompts(stub, 1)
    assert group.samples[0].prompt == "Tools: calc\nU: What is 1+1?\nA: "


def generate(engine_url: str, tokenizer, sample: Sample, fn, options=None, chat: bool = False) -> Sample:
    settings = RolloutSettings(tools={"echo": "tests.service.test_agent:echo"}, engine_urls=[engine_url])

    async def go():
        pool = EnginePool([engine_url], "", 30, 30, stack_token() or "", 60)
        try:
            ctx = GenerateContext(
                tokenizer=tokenizer,
                engine=pool.for_generation(),
                apply_chat_template=chat,
                options=options,
                settings=settings,
                tools=ToolBox(settings),
            )
            return await fn(ctx, sample, {"max_new_tokens": 2, "temperature": 1.0})
        finally:
            await pool.close()

    return asyncio.run(go())


def prompt_text(tokenizer, sample: Sample) -> str:
    return tokenizer.decode(sample.tokens[: len(sample.tokens) - sample.response_length])


@pytest.mark.parametrize("chat", ["messages", "apply_chat_template"])
def test_the_default_generate_function_shows_the_samples_tools(engine_url, tools_model_dir, chat):
    tokenizer = AutoTokenizer.from_pretrained(tools_model_dir)
    sample = Sample(prompt="What is 1+1?", metadata={"tools": [CALC]})
    if chat == "messages":
        sample.prompt, sample.messages = "", [{"role": "user", "content": "What is 1+1?"}]
    out = generate(engine_url, tokenizer, sample, default_generate, chat=chat == "apply_chat_template")
    assert prompt_text(tokenizer, out) == "Tools: calc\nU: What is 1+1?\nA: "
    assert out.response_length > 0


def test_the_agent_loop_shows_the_samples_tools_beside_the_services(engine_url, tools_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tools_model_dir)
    options = AgentOptions(tools=["echo"], tool_parser="none", max_turns=1)
    out = generate(engine_url, tokenizer, Sample(prompt="hi", metadata={"tools": [CALC]}), agent_generate, options)
    assert prompt_text(tokenizer, out) == "Tools: echo calc\nU: hi\nA: "


def test_a_buffer_templated_sample_keeps_its_prompt_in_the_rollout(engine_url, tools_model_dir):
    """What the buffer templated (with the tools) is sent as it is, never templated twice."""
    tokenizer = AutoTokenizer.from_pretrained(tools_model_dir)
    text = "Tools: calc\nU: What is 1+1?\nA: "
    sample = Sample(prompt=text, metadata={"tools": [CALC], "chat_template_applied": True})
    out = generate(engine_url, tokenizer, sample, default_generate, chat=True)
    assert prompt_text(tokenizer, out) == text
