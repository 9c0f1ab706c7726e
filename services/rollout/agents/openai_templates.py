"""From an OpenAI request to an engine call and back: messages rendered for the chat
template, the prompt's token ids, the sampling a request may add to the run's, and the
engine's output as OpenAI's chat.completion and text_completion answers."""

from __future__ import annotations

import re
import time
import uuid
from typing import Any

from rlmesh.common import safe_json
from rlmesh.rollout.agents.openai_models import (
    MODEL_NAME,
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    RequestError,
    SamplingFields,
)
from rlmesh.rollout.agents.openai_session import AgentSession
from rlmesh.rollout.agents.tool_parsers import ToolCall, parse_tool_calls, render_tool_calls_for_template

MAX_REQUEST_STOP_STRINGS = 16
ENGINE_MAX_STOP_STRINGS = 32  # SGLang's limit on sampling_params.stop
_NUMBERED_CALL_ID = re.compile(r"call_\d+")


def _text(content: str | list[dict[str, Any]] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise RequestError(400, f"{where}: only text content is supported, not {str(part.get('type'))[:40]!r}")
        parts.append(part["text"])
    return "".join(parts)


def _template_tool_calls(calls: list[dict[str, Any]], where: str, as_dict: bool) -> list[dict]:
    parsed = []
    for k, call in enumerate(calls):
        function = call.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError(400, f"{where}.tool_calls[{k}] needs a function with a name")
        arguments = function.get("arguments") or {}
        if isinstance(arguments, str):
            try:
                arguments = safe_json.loads(arguments) if arguments.strip() else {}
            except (ValueError, RecursionError) as e:
                raise RequestError(400, f"{where}.tool_calls[{k}].function.arguments is not valid JSON: {e}") from None
        if not isinstance(arguments, dict):
            raise RequestError(400, f"{where}.tool_calls[{k}].function.arguments must be a JSON object")
        parsed.append(ToolCall(id=str(call.get("id") or f"call_{k}"), name=function["name"], arguments=arguments))
    return render_tool_calls_for_template(parsed, arguments_as_dict=as_dict)


def template_messages(messages: list[ChatMessage], arguments_as_dict: bool) -> list[dict[str, Any]]:
    """OpenAI messages as chat templates take them: text content, tool_calls with their
    arguments as the template wants, and tool messages named after the call they answer."""
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # tool_call_id -> function name
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        message: dict[str, Any] = {
            "role": "system" if m.role == "developer" else m.role,
            "content": _text(m.content, where),
        }
        if m.tool_calls:
            if m.role != "assistant":
                raise RequestError(400, f"{where}: only assistant messages carry tool_calls")
            message["tool_calls"] = _template_tool_calls(m.tool_calls, where, arguments_as_dict)
            names.update({c["id"]: c["function"]["name"] for c in message["tool_calls"]})
        if m.role == "tool":
            if m.tool_call_id:
                message["tool_call_id"] = m.tool_call_id
            name = m.name or names.get(m.tool_call_id or "")
            if name:
                message["name"] = name
        elif m.name:
            message["name"] = m.name
        out.append(message)
    return out


def check_tools(tools: list[dict[str, Any]]) -> None:
    for k, tool in enumerate(tools):
        function = tool.get("function")
        if (
            tool.get("type") != "function"
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
        ):
            raise RequestError(
                400, f'tools[{k}] must be {{"type": "function", "function": {{"name": ..., ...}}}}', param=f"tools[{k}]"
            )


def refuse_unsupported(req: SamplingFields) -> None:
    if req.n not in (None, 1):
        raise RequestError(
            400, "n must be 1: each call generates one answer (make several calls for several)", param="n"
        )
    if req.stream:
        raise RequestError(400, "stream is not supported: ask without stream", param="stream")


def request_sampling(req: SamplingFields, session: AgentSession) -> dict[str, Any]:
    """SGLang sampling params a request adds to the run's: stop strings always; the rest
    only when the run honors the agent's sampling."""
    params: dict[str, Any] = {}
    asked = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if asked:
        if len(asked) > MAX_REQUEST_STOP_STRINGS or not all(asked):
            raise RequestError(400, f"stop must be 1 to {MAX_REQUEST_STOP_STRINGS} non-empty strings", param="stop")
        run_stop = session.sampling_params.get("stop") or []
        run_stop = [run_stop] if isinstance(run_stop, str) else list(run_stop)
        stop = list(dict.fromkeys([*run_stop, *asked]))
        if len(stop) > ENGINE_MAX_STOP_STRINGS:
            raise RequestError(
                400,
                f"with the run's own stop strings this makes {len(stop)}; the engine takes at "
                f"most {ENGINE_MAX_STOP_STRINGS}",
                param="stop",
            )
        params["stop"] = stop
    if not session.options.honor_agent_sampling:
        return params
    for name in ("temperature", "top_p", "frequency_penalty", "presence_penalty"):
        if getattr(req, name) is not None:
            params[name] = getattr(req, name)
    if req.seed is not None:
        params["sampling_seed"] = req.seed
    if req.logit_bias:
        try:
            params["logit_bias"] = {str(int(k)): max(-100.0, min(100.0, float(v))) for k, v in req.logit_bias.items()}
        except ValueError:
            raise RequestError(400, "logit_bias keys must be token ids", param="logit_bias") from None
    return params


def _usage(prompt_ids: list[int], out: dict | None) -> dict[str, int]:
    completion = len(out["output_ids"]) if out else 0
    return {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": completion,
        "total_tokens": len(prompt_ids) + completion,
    }


def _token_logprobs(tokenizer: Any, out: dict | None) -> list[tuple[str, float]]:
    if not out:
        return []
    pairs = out["meta_info"].get("output_token_logprobs") or []
    return [(tokenizer.decode([token_id], skip_special_tokens=False), float(lp)) for lp, token_id, *_ in pairs]


def _openai_tool_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    rendered = render_tool_calls_for_template(calls)
    for call in rendered:
        # The parser numbers calls it found without an id from 0 in every turn; clients
        # match tool results to calls by id across the conversation.
        if _NUMBERED_CALL_ID.fullmatch(call["id"]):
            call["id"] = f"call_{uuid.uuid4().hex[:24]}"
    return rendered


def _openai_finish(out: dict | None) -> str:
    """OpenAI's finish_reason: "length" for a call cut by a token limit (or not made), else "stop"."""
    if out is None:
        return "length"
    return "length" if (out["meta_info"].get("finish_reason") or {}).get("type") == "length" else "stop"


def chat_answer(
    session: AgentSession, req: ChatRequest, prompt_ids: list[int], out: dict | None, parse_tools: bool
) -> dict[str, Any]:
    text = out.get("text", "") if out else ""
    finish = _openai_finish(out)
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if parse_tools and out is not None:
        parsed = parse_tool_calls(session.options.tool_parser, text, finish)
        if parsed.calls:
            message = {
                "role": "assistant",
                "content": parsed.content or None,
                "tool_calls": _openai_tool_calls(parsed.calls),
            }
            if finish == "stop":
                finish = "tool_calls"
    logprobs = None
    if req.logprobs:
        logprobs = {
            "content": [
                {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                for t, lp in _token_logprobs(session.tokenizer, out)
            ],
            "refusal": None,
        }
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": req.model or MODEL_NAME,
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": logprobs}],
        "usage": _usage(prompt_ids, out),
    }


def completion_answer(
    session: AgentSession, req: CompletionRequest, prompt_ids: list[int], out: dict | None
) -> dict[str, Any]:
    finish = _openai_finish(out)
    logprobs = None
    if req.logprobs is not None:
        pairs = _token_logprobs(session.tokenizer, out)
        offsets, at = [], 0
        for t, _ in pairs:
            offsets.append(at)
            at += len(t)
        logprobs = {
            "tokens": [t for t, _ in pairs],
            "token_logprobs": [lp for _, lp in pairs],
            "top_logprobs": None,
            "text_offset": offsets,
        }
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": req.model or MODEL_NAME,
        "choices": [
            {"index": 0, "text": out.get("text", "") if out else "", "finish_reason": finish, "logprobs": logprobs}
        ],
        "usage": _usage(prompt_ids, out),
    }


def completion_prompt_ids(tokenizer: Any, prompt: str | list[int] | list[str] | list[list[int]]) -> list[int]:
    """A prompt as text (tokenised without special tokens, as rlmesh tokenises prompts) or
    as token ids; a batch of one is taken, a larger batch is refused."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise RequestError(400, "prompt must be one prompt: each call generates one answer", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError(400, "prompt is empty", param="prompt")
        return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    if not prompt:
        raise RequestError(400, "prompt is empty", param="prompt")
    return list(prompt)


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
    try:
        return list(
            tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
    except Exception as e:  # a template refuses a conversation (roles out of order, ...) by raising
        raise RequestError(
            400, f"the chat template cannot render these messages: {type(e).__name__}: {e}", param="messages"
        ) from None
