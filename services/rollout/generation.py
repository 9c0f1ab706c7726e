"""Turning one sample into a generated one through an engine. This is the default
generate function; a custom one (multi-turn, tool use) has the same signature and is
named by import path in the rollout service's own settings:

    async def generate(ctx: GenerateContext, sample: Sample, sampling_params: dict) -> Sample | list[Sample]
"""

from __future__ import annotations

import functools
import uuid
from dataclasses import dataclass
from typing import Any

from rlmesh.common.sample import Sample, Status
from rlmesh.rollout.engine_client import SGLangClient
from rlmesh.rollout.sglang_client import BEGAN_UNDER_VERSION

FINISH_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


@dataclass
class GenerateContext:
    """What a generate function may use: the tokenizer, an engine to call, the run's options
    for this function (an instance of its `options_model`, else None), the rollout
    service's settings (the operator's registries of tools and agents) and its tools."""

    tokenizer: Any
    engine: SGLangClient
    apply_chat_template: bool = False
    options: Any = None
    settings: Any = None
    tools: Any = None  # rlmesh.rollout.agents.tools.ToolBox


def prompt_ids(tokenizer: Any, sample: Sample, apply_chat_template: bool) -> list[int]:
    templated = bool(sample.metadata.get("chat_template_applied"))  # the buffer templated it (with any tools)
    tools = sample.metadata.get("tools") or None
    if not sample.messages and tools is None:
        # The samples of a group share their prompt: tokenized once (it was 7% of the
        # rollout service's CPU in a profile). A copy: the caller may extend it.
        return list(_text_prompt_ids(tokenizer, sample.prompt, templated, apply_chat_template))
    return _tokenize(tokenizer, sample.prompt, sample.messages, tools, templated, apply_chat_template)


@functools.lru_cache(maxsize=1024)
def _text_prompt_ids(tokenizer: Any, prompt: str, templated: bool, apply_chat_template: bool) -> tuple[int, ...]:
    return tuple(_tokenize(tokenizer, prompt, None, None, templated, apply_chat_template))


def _tokenize(
    tokenizer: Any, prompt: str, messages: Any, tools: Any, templated: bool, apply_chat_template: bool
) -> list[int]:
    if templated:
        return tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if messages or apply_chat_template:
        # The dataset's tool definitions (its `tools` key) are shown to the model as its template shows tools.
        return list(
            tokenizer.apply_chat_template(
                messages or [{"role": "user", "content": prompt}],
                tools=tools,
                tokenize=True,
                add_generation_prompt=True,
                return_dict=False,
            )
        )
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]


def weight_version_number(version: str) -> int:
    """SGLang reports versions as strings ("default" before any update)."""
    try:
        return int(version)
    except (TypeError, ValueError):
        return 0


def apply_engine_output(sample: Sample, out: dict) -> Sample:
    """Append an engine response to the sample (a resumed sample keeps what it had:
    tokens come from the engine, never re-tokenised)."""
    meta = out["meta_info"]
    new_ids = list(out["output_ids"])
    new_logprobs = [lp for lp, *_ in meta.get("output_token_logprobs", [])]
    if new_logprobs and len(new_logprobs) != len(new_ids):
        raise ValueError(f"engine returned {len(new_logprobs)} log-probs for {len(new_ids)} tokens")
    sample.tokens = sample.tokens + new_ids
    sample.response = sample.response + out.get("text", "")
    sample.response_length += len(new_ids)
    sample.rollout_log_probs = sample.rollout_log_probs + new_logprobs
    sample.loss_mask = sample.loss_mask + [1] * len(new_ids)
    sample.status = FINISH_STATUS.get((meta.get("finish_reason") or {}).get("type", "stop"), Status.COMPLETED)
    versions = [weight_version_number(meta.get("weight_version", "default"))]
    if BEGAN_UNDER_VERSION in meta:  # the weights changed while it ran
        versions.insert(0, weight_version_number(meta[BEGAN_UNDER_VERSION]))
    for version in versions:
        if not sample.weight_versions or sample.weight_versions[-1] != version:
            sample.weight_versions = sample.weight_versions + [version]
    return sample


async def default_generate(ctx: GenerateContext, sample: Sample, sampling_params: dict) -> Sample:
    if not sample.tokens:
        sample.tokens = prompt_ids(ctx.tokenizer, sample, ctx.apply_chat_template)
        sample.response_length = 0
    params = dict(sampling_params)
    # Resuming a partial sample: continue from what it has, within the same token budget.
    params["max_new_tokens"] = max(params.get("max_new_tokens", 128) - sample.response_length, 0)
    if params["max_new_tokens"] == 0:
        sample.status = Status.TRUNCATED
        return sample
    if params.get("min_new_tokens"):
        # What it generated counts toward the minimum; SGLang refuses a minimum above the maximum.
        left = max(params["min_new_tokens"] - sample.response_length, 0)
        params["min_new_tokens"] = min(left, params["max_new_tokens"])
    rid = sample.metadata.get("rid") or uuid.uuid4().hex
    sample.metadata["rid"] = rid
    # A prompt's samples (a GRPO group, started together) go to the engine as one batch.
    out = await ctx.engine.generate(sample.tokens, params, rid=rid, batch_key=(sample.group_index, sample.prompt))
    return apply_engine_output(sample, out)


def sft_sample(tokenizer: Any, sample: Sample, apply_chat_template: bool) -> Sample:
    """A supervised sample: the record's metadata `sft_response` (say, a whole agent
    episode), else its label, is the response; every response token trained."""
    target = sample.metadata.get("sft_response") or sample.label
    prompt = prompt_ids(tokenizer, sample, apply_chat_template)
    answer = tokenizer(target, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    sample.tokens = prompt + answer
    sample.response = target
    sample.response_length = len(answer)
    sample.loss_mask = [1] * len(answer)
    sample.rollout_log_probs = []
    sample.status = Status.COMPLETED
    return sample
