"""The built-in agent loop: the model acts, tools run, their output comes back, and only
the model's own tokens are trained.

One sample is one episode. Each turn the engine continues the sample's token ids (its
tokens and log-probs are kept as the engine returned them, never re-tokenised); the run's
tool parser reads the turn's calls; the tools run concurrently; their results are
appended as the chat template renders a tool turn, with loss mask 0 and log-prob 0. The
episode ends when a turn calls nothing (COMPLETED), when a turn or the response budget is
cut by the token limits (TRUNCATED), after max_turns turns that still call tools
(TRUNCATED), or on an engine abort (ABORTED). Errors of tools and unparseable calls go back
to the model as text.

Chosen per run: `"rollout": {"generate": {"name": "agent", "options": {...}}}` (AgentOptions).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from rlmesh.common.sample import Sample, Status
from rlmesh.rollout.agents.tool_parsers import ToolCall, ToolParserName, parse_tool_calls, tool_parser_names
from rlmesh.rollout.generation import FINISH_STATUS, GenerateContext, apply_engine_output

MAX_RESPONSE_TOKENS = 1 << 20


class AgentOptions(BaseModel):
    """The agent loop's options in a run (`rollout.generate.options`)."""

    model_config = ConfigDict(extra="forbid")

    tools: list[str] | None = Field(
        None,
        max_length=256,
        description="Names of the rollout service's tools the model may call (settings "
        "tools / http_tools); default all of them. A dataset's own `tools` are shown to the model too.",
    )
    tool_parser: ToolParserName = Field(
        "hermes", description="How calls are read from a turn: " + ", ".join(tool_parser_names())
    )
    max_turns: int = Field(4, ge=1, le=64, description="Model turns per episode.")
    max_tokens_per_turn: int = Field(
        0, ge=0, le=MAX_RESPONSE_TOKENS, description="Tokens one turn may generate; 0 = the run's max_new_tokens."
    )
    max_response_tokens: int = Field(
        0,
        ge=0,
        le=MAX_RESPONSE_TOKENS,
        description="Tokens of the whole response, the model's and the tools' "
        "(the trainer's sequence length); 0 = max_turns x the turn limit.",
    )
    tool_timeout_seconds: float = Field(
        10.0, gt=0, le=600, description="Longest one Python tool call may take (an HTTP tool has its own timeout)."
    )
    max_tool_output_chars: int = Field(4096, ge=1, le=1 << 20, description="Longer tool outputs are cut.")

    @field_validator("tools")
    @classmethod
    def _registered_tools(cls, names: list[str] | None, info: ValidationInfo) -> list[str] | None:
        settings = (info.context or {}).get("settings")
        if names is None or settings is None:
            return names
        registered = {*settings.tools, *(t.name for t in settings.http_tools)}
        unknown = [n for n in names if n not in registered]
        if unknown:
            raise ValueError(
                f"unknown tools {', '.join(map(repr, unknown))}; the rollout service has: "
                f"{', '.join(sorted(registered)) or 'none'} (settings tools / http_tools)"
            )
        return names


def render(tokenizer: Any, messages: list[dict], tools: list[dict], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def tool_turn_text(
    tokenizer: Any,
    history: list[dict],
    tools: list[dict],
    turn_text: str,
    last_token: int | None,
    tool_messages: list[dict],
) -> str:
    """The text the chat template puts between the end of the model's turn and the start of
    its next one: what closes the assistant turn (less the end-of-turn token the model
    generated itself), the tool turn(s), and the next generation prompt."""
    turn = {"role": "assistant", "content": turn_text}
    opened = render(tokenizer, history, tools, True)
    closed = render(tokenizer, [*history, turn], tools, False)
    after = render(tokenizer, [*history, turn, *tool_messages], tools, True)
    if not after.startswith(closed):
        raise ValueError(
            "the chat template renders the conversation differently once a tool turn follows, so a "
            "tool turn cannot be appended to the generated tokens"
        )
    close = ""
    if closed.startswith(opened):
        whole_turn = closed[len(opened) :]
        at = whole_turn.rfind(turn_text) if turn_text else -1
        close = whole_turn[at + len(turn_text) :] if at >= 0 else ""
    if last_token is not None and last_token in tokenizer.all_special_ids:
        generated_end = tokenizer.decode([last_token], skip_special_tokens=False)
        if close.startswith(generated_end):
            close = close[len(generated_end) :]
    return close + after[len(closed) :]


def _tool_message(call: ToolCall, content: str) -> dict:
    return {"role": "tool", "content": content, "tool_call_id": call.id, "name": call.name}


def _first_turn(tokenizer: Any, sample: Sample, tools: list[dict]) -> tuple[list[dict], list[int]]:
    """The conversation so far and its token ids, ending with the generation prompt."""
    if sample.metadata.get("chat_template_applied") and not sample.messages:
        # The buffer templated the text prompt (with the dataset's tools): its ids are used as
        # they are; a stand-in first turn is enough to render what follows each model turn.
        return [{"role": "user", "content": sample.prompt}], tokenizer(sample.prompt, add_special_tokens=False)[
            "input_ids"
        ]
    history = [dict(m) for m in sample.messages] or [{"role": "user", "content": sample.prompt}]
    return history, tokenizer(render(tokenizer, history, tools, True), add_special_tokens=False)["input_ids"]


async def agent_generate(ctx: GenerateContext, sample: Sample, sampling_params: dict) -> Sample:
    opts: AgentOptions = ctx.options or AgentOptions()
    tokenizer = ctx.tokenizer
    allowed = ctx.tools.names if opts.tools is None else list(opts.tools)
    tools = [*ctx.tools.schemas(allowed), *(sample.metadata.get("tools") or [])]
    turn_limit = opts.max_tokens_per_turn or sampling_params.get("max_new_tokens", 128)
    budget = opts.max_response_tokens or opts.max_turns * turn_limit

    # An episode cut short (an abort) starts over: tools may have had effects, and the
    # conversation is rebuilt only from the start.
    history, prompt = _first_turn(tokenizer, sample, tools)
    sample.tokens = list(prompt)
    sample.response, sample.response_length = "", 0
    sample.loss_mask, sample.rollout_log_probs, sample.weight_versions = [], [], []
    turns: list[dict] = []
    sample.metadata["agent_turns"] = turns
    rid = sample.metadata.setdefault("rid", uuid.uuid4().hex)

    for turn_index in range(opts.max_turns):
        params = {**sampling_params, "max_new_tokens": min(turn_limit, budget - sample.response_length)}
        if params.get("min_new_tokens"):
            params["min_new_tokens"] = min(params["min_new_tokens"], params["max_new_tokens"])
        before = len(sample.tokens)
        out = await ctx.engine.generate(sample.tokens, params, rid=f"{rid}-{turn_index}")
        apply_engine_output(sample, out)
        turn_text = out.get("text", "")
        finish = (out["meta_info"].get("finish_reason") or {}).get("type", "stop")
        turns.append({"role": "assistant", "content": turn_text})
        if FINISH_STATUS.get(finish) != Status.COMPLETED:
            break  # cut by the token limit (TRUNCATED) or aborted (ABORTED): as the engine said
        parsed = parse_tool_calls(opts.tool_parser, turn_text, finish)
        if not parsed.calls and not parsed.errors:
            sample.status = Status.COMPLETED
            break
        results = await asyncio.gather(
            *(ctx.tools.call(c.name, c.arguments, allowed, opts.tool_timeout_seconds) for c in parsed.calls)
        )
        tool_messages = [_tool_message(c, r.text[: opts.max_tool_output_chars]) for c, r in zip(parsed.calls, results)]
        if parsed.errors:
            tool_messages.append({"role": "tool", "content": "error: " + "\n".join(parsed.errors)})
        text = tool_turn_text(
            tokenizer,
            history,
            tools,
            turn_text,
            sample.tokens[-1] if len(sample.tokens) > before else None,
            tool_messages,
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        history = [*history, {"role": "assistant", "content": turn_text}, *tool_messages]
        turns.extend(tool_messages)
        if sample.response_length + len(ids) >= budget or turn_index == opts.max_turns - 1:
            sample.status = Status.TRUNCATED  # still calling tools when the budget or the turns ran out
            break
        sample.tokens += ids
        sample.response_length += len(ids)
        sample.loss_mask += [0] * len(ids)
        sample.rollout_log_probs += [0.0] * len(ids)
    # What a verifier checks: the model's last word (the whole episode is in agent_turns).
    sample.response = next((t["content"] for t in reversed(turns) if t["role"] == "assistant"), "")
    return sample


agent_generate.options_model = AgentOptions
