"""An OpenAI-compatible endpoint for agents written against any OpenAI client, and the
generate function `openai_agent_generate` that turns what such an agent generated into
trainable samples (what AReaL's and Atropos's proxies do).

Each sample gets its own base URL, `http://HOST:PORT/samples/<token>/v1`, with a fresh
unguessable token: the operator's agent (settings.agents, chosen by the run's option
`agent`) is called as `await agent(base_url, sample)` (a plain function runs in a thread)
and talks to it with an ordinary client (`openai.AsyncOpenAI(base_url=base_url,
api_key="unused")`); its return value and its changes to the sample are not used. Every
/chat/completions or /completions call becomes one /generate call to this sample's engine;
the endpoint records the prompt's token ids (the chat template applied to the messages),
the engine's output ids, log-probs, weight version and finish reason. When the agent
returns, the token is withdrawn and the calls become the sample, never re-tokenised:

- Calls form a chain when a call's prompt ids start with an earlier call's prompt + output
  ids (the conversation went on). A chain is one sample: the first prompt, then per call
  the prompt tokens that are new (tool results, the next user turn: loss mask 0, log-prob
  0.0) and the call's output (loss mask 1, the engine's log-probs). A call that extends no
  chain (a second conversation, a history the agent rewrote, a template that renders the
  model's turn differently from what it generated) starts a new sample: the function then
  returns several samples, one per chain, in the order their first calls were made.
- Every sample of an episode carries the episode's outcome: `response` is the text of the
  agent's last call (what the reward service checks) and `status` comes from that call's
  finish reason, so each sample is scored as the episode. metadata["openai_agent"] says
  which segment a sample is (`segment` of `segments`) and how many `calls` it holds.
- An agent that made no call gives a FAILED sample ("the agent made no model call"); one
  that raises fails its sample with the reason (the rollout manager does that). An engine
  outage is raised as the engine's error even when the agent caught it, so the rollout
  retries it like any generation; an abort (over-sampling, a weight push) answers the
  agent's call with an error and hands the sample back ABORTED, to be started over.

Budgets (the run's options): at most `max_calls` calls and `max_total_tokens` generated
tokens per sample; each call at most the run's max_new_tokens. A call past a budget is
answered at once, without the engine, with no content and finish_reason "length" (the
episode is then TRUNCATED); an agent that keeps calling after that gets errors.

Sampling comes from the run: a request may ask for fewer tokens (max_tokens /
max_completion_tokens) and add stop strings, but its temperature, top_p, seed, penalties
and logit_bias are ignored unless the run sets `honor_agent_sampling` (the trainer
recomputes log-probs at the run's temperature, and one seed shared by a group's samples
makes them identical). Not supported (400): n > 1, stream, top_logprobs, echo, a
response_format other than text, non-text message content.

The endpoint is one HTTP server per rollout process, started on first use in the running
event loop on settings.openai_host / openai_port (`close_shared_endpoint` stops it). The
token is the only credential: keep the endpoint on loopback unless agents run elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import inspect
import json
import logging
import re
import secrets
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from rlmesh.common.errors import FailedPrecondition, InvalidArgument
from rlmesh.common.http_guard import BodyLimit
from rlmesh.common.plugins import load_plugin
from rlmesh.common.sample import Sample, Status
from rlmesh.rollout.agents.tool_parsers import (
    ToolCall,
    ToolParserName,
    parse_tool_calls,
    render_tool_calls_for_template,
    tool_parser_names,
)
from rlmesh.rollout.engine_client import EngineError
from rlmesh.rollout.generation import FINISH_STATUS, GenerateContext, apply_engine_output

log = logging.getLogger(__name__)

MODEL_NAME = "policy"  # what GET /models lists; requests may name any model
MAX_REQUEST_BYTES = 8 * 1024 * 1024
MAX_MESSAGES = 1024
MAX_TOOLS = 256
MAX_REQUEST_STOP_STRINGS = 16
ENGINE_MAX_STOP_STRINGS = 32  # SGLang's limit on sampling_params.stop
MAX_TOKENS = 1 << 20
# Calls answered "length" after a budget was spent before further calls are refused: an
# agent that ignores finish_reason must not spin until the sample times out.
MAX_CALLS_PAST_BUDGET = 4
NO_CALL_REASON = "the agent made no model call"
_NUMBERED_CALL_ID = re.compile(r"call_\d+")


class OpenAIAgentOptions(BaseModel):
    """The options of the 'openai_agent' generate function in a run (`rollout.generate.options`)."""

    model_config = ConfigDict(extra="forbid")

    agent: str = Field(min_length=1, max_length=128, description="Which of the rollout service's agents "
                       "(settings.agents) runs each sample.")
    tool_parser: ToolParserName = Field("hermes", description="How tool calls are read from a chat answer when the request "
                             "offers tools: " + ", ".join(tool_parser_names()))
    max_calls: int = Field(16, ge=1, le=256, description="Model calls one sample's agent may make.")
    max_total_tokens: int = Field(0, ge=0, le=MAX_TOKENS, description="Tokens the model may generate over all of "
                                  "a sample's calls; 0 = max_calls x the run's max_new_tokens.")
    honor_agent_sampling: bool = Field(
        False, description="Let requests set temperature, top_p, seed, penalties and logit_bias; by default the "
        "run's sampling is used (the trainer recomputes log-probs at the run's temperature).")
    tool_arguments_as_dict: bool = Field(
        True, description="Give the chat template the arguments of an assistant message's tool_calls as a dict "
        "(Hugging Face's convention: Qwen, Llama 3); false: as the JSON text the client sent.")

    @field_validator("agent")
    @classmethod
    def _registered_agent(cls, name: str, info: ValidationInfo) -> str:
        settings = (info.context or {}).get("settings")
        if settings is not None and name not in settings.agents:
            raise ValueError(f"unknown agent {name!r}; the rollout service has: "
                             f"{', '.join(sorted(settings.agents)) or 'none'} (settings agents)")
        return name


# ---- request bodies (what OpenAI's clients send; fields we do not use are ignored) ---------------


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_call_id: str | None = Field(None, max_length=256)
    name: str | None = Field(None, max_length=256)


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field("", max_length=256)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(None, max_length=1024)
    n: int | None = None
    stream: bool | None = None


class ChatRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: dict[str, Any] | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool | None = None


class RequestError(Exception):
    """Answered as OpenAI answers errors: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def error_response(status: int, message: str, kind: str = "invalid_request_error",
                   param: str | None = None) -> JSONResponse:
    # x-should-retry: OpenAI's clients would otherwise retry 5xx answers themselves.
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}},
                        status_code=status, headers={"x-should-retry": "false"})


# ---- one sample's calls ----------------------------------------------------------------------------


@dataclass
class ModelCall:
    """One /generate call made for the agent: its prompt ids and the engine's answer."""

    seq: int  # the order calls were made in
    prompt_ids: list[int]
    out: dict  # SGLang's /generate answer

    @property
    def output_ids(self) -> list[int]:
        return list(self.out["output_ids"])

    @property
    def finish(self) -> str:
        return (self.out["meta_info"].get("finish_reason") or {}).get("type", "stop")


class AgentSession:
    """What the endpoint keeps for one sample while its agent runs: the engine to call,
    the run's sampling, the budgets, and the calls made."""

    def __init__(self, ctx: GenerateContext, options: OpenAIAgentOptions, sampling_params: dict, rid: str) -> None:
        self.tokenizer = ctx.tokenizer
        self.engine = ctx.engine
        self.options = options
        self.sampling_params = dict(sampling_params)
        self.rid = rid
        self.max_new_tokens = int(sampling_params.get("max_new_tokens") or 128)
        self.token_budget = options.max_total_tokens or options.max_calls * self.max_new_tokens
        self.calls: list[ModelCall] = []
        self.started = 0  # calls sent to the engine
        self.generated = 0  # tokens the engine generated
        self.reserved = 0  # tokens calls in flight may still generate
        self.past_budget = 0
        self.budget_spent = False
        self.aborted = False
        self.failure: BaseException | None = None  # an engine outage, raised when the agent returns
        self.closed = False

    def close(self) -> None:
        """The agent is done: later answers are dropped, calls still in flight are aborted."""
        self.closed = True
        if self.reserved:
            _in_background(self.engine.abort(self.rid))  # every call's rid starts with it

    async def generate(self, prompt_ids: list[int], max_tokens: int | None, request_params: dict) -> dict | None:
        """The engine's answer to one call, recorded; None when a budget is spent (the call
        is answered as cut off by the token limit, without the engine)."""
        if self.aborted:
            raise RequestError(503, "the rollout aborted this sample's generation; it will be started over",
                               kind="server_error")
        if self.failure is not None:
            raise RequestError(503, f"the engine failed: {self.failure}", kind="server_error")
        left = self.token_budget - self.generated - self.reserved
        limit = min(self.max_new_tokens, left, max_tokens or self.max_new_tokens)
        if self.started >= self.options.max_calls or limit <= 0:
            self.budget_spent = True
            self.past_budget += 1
            if self.past_budget > MAX_CALLS_PAST_BUDGET:
                raise RequestError(400, f"this sample's budget ({self.options.max_calls} calls, {self.token_budget} "
                                   "generated tokens) is spent and the agent kept calling after answers with "
                                   "finish_reason 'length'")
            return None
        seq = self.started
        self.started += 1
        params = {**self.sampling_params, **request_params, "max_new_tokens": limit}
        if params.get("min_new_tokens"):
            params["min_new_tokens"] = min(params["min_new_tokens"], limit)
        self.reserved += limit
        try:
            out = await self.engine.generate(prompt_ids, params, rid=f"{self.rid}-{seq}")
        except EngineError as e:
            self.failure = self.failure or e
            raise RequestError(503, f"the engine failed: {e}", kind="server_error") from None
        except InvalidArgument as e:  # what the engine refused: the prompt is too long, a bad parameter
            raise RequestError(400, str(e)) from None
        finally:
            self.reserved -= limit
        if self.closed:
            raise RequestError(404, "this sample's generation has ended")
        call = ModelCall(seq, list(prompt_ids), out)
        self.generated += len(call.output_ids)
        self.calls.append(call)
        if call.finish == "abort":
            self.aborted = True
            raise RequestError(503, "the rollout aborted this sample's generation; it will be started over",
                               kind="server_error")
        return out


_background: set[asyncio.Task] = set()


def _in_background(coro) -> None:
    async def quietly():
        try:
            await coro
        except Exception as e:
            log.debug("a background engine call failed: %s", e)

    task = asyncio.ensure_future(quietly())
    _background.add(task)
    task.add_done_callback(_background.discard)


# ---- calls -> samples ------------------------------------------------------------------------------


def chain_calls(calls: list[ModelCall]) -> list[list[ModelCall]]:
    """The calls grouped into chains, each call after the latest call of a chain whose
    prompt + output its prompt starts with (the longest such, when several are)."""
    chains: list[list[ModelCall]] = []
    for call in sorted(calls, key=lambda c: c.seq):
        best, best_len = None, -1
        for chain in chains:
            tail = chain[-1]
            n = len(tail.prompt_ids) + len(tail.out["output_ids"])
            if n > best_len and len(call.prompt_ids) >= n and call.prompt_ids[:n] == tail.prompt_ids + tail.output_ids:
                best, best_len = chain, n
        if best is None:
            chains.append([call])
        else:
            best.append(call)
    return chains


def _cleared(sample: Sample) -> Sample:
    s = copy.deepcopy(sample)
    s.tokens, s.response, s.response_length = [], "", 0
    s.loss_mask, s.rollout_log_probs, s.weight_versions = [], [], []
    return s


def samples_from_calls(sample: Sample, calls: list[ModelCall], truncated: bool = False) -> list[Sample]:
    """One sample per chain of calls (see the module's docstring); `truncated`: a budget
    cut the episode short. No calls: the sample, FAILED."""
    if not calls:
        failed = _cleared(sample)
        failed.status = Status.FAILED
        failed.metadata["failure"] = NO_CALL_REASON
        failed.metadata.pop("rid", None)
        return [failed]
    last = max(calls, key=lambda c: c.seq)
    status = FINISH_STATUS.get(last.finish, Status.COMPLETED)
    if truncated and status == Status.COMPLETED:
        status = Status.TRUNCATED
    chains = chain_calls(calls)
    samples = []
    for segment, chain in enumerate(chains):
        s = _cleared(sample)
        s.tokens = list(chain[0].prompt_ids)
        for call in chain:
            between = call.prompt_ids[len(s.tokens):]  # tool results, the next user turn: not the model's
            s.tokens += between
            s.response_length += len(between)
            s.loss_mask += [0] * len(between)
            s.rollout_log_probs += [0.0] * len(between)
            apply_engine_output(s, call.out)
        s.response = last.out.get("text", "")
        s.status = status
        s.metadata["openai_agent"] = {"segment": segment, "segments": len(chains), "calls": len(chain)}
        samples.append(s)
    return samples


# ---- requests -> engine calls -> answers -----------------------------------------------------------


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
                arguments = json.loads(arguments) if arguments.strip() else {}
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
        message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                                   "content": _text(m.content, where)}
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


def _check_tools(tools: list[dict[str, Any]]) -> None:
    for k, tool in enumerate(tools):
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError(400, f'tools[{k}] must be {{"type": "function", "function": {{"name": ..., ...}}}}',
                               param=f"tools[{k}]")


def _refuse_unsupported(req: _SamplingFields) -> None:
    if req.n not in (None, 1):
        raise RequestError(400, "n must be 1: each call generates one answer (make several calls for several)",
                           param="n")
    if req.stream:
        raise RequestError(400, "stream is not supported: ask without stream", param="stream")


def request_sampling(req: _SamplingFields, session: AgentSession) -> dict[str, Any]:
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
            raise RequestError(400, f"with the run's own stop strings this makes {len(stop)}; the engine takes at "
                               f"most {ENGINE_MAX_STOP_STRINGS}", param="stop")
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
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": completion,
            "total_tokens": len(prompt_ids) + completion}


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


def chat_answer(session: AgentSession, req: ChatRequest, prompt_ids: list[int], out: dict | None,
                parse_tools: bool) -> dict[str, Any]:
    text = out.get("text", "") if out else ""
    finish = _openai_finish(out)
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if parse_tools and out is not None:
        parsed = parse_tool_calls(session.options.tool_parser, text, finish)
        if parsed.calls:
            message = {"role": "assistant", "content": parsed.content or None,
                       "tool_calls": _openai_tool_calls(parsed.calls)}
            if finish == "stop":
                finish = "tool_calls"
    logprobs = None
    if req.logprobs:
        logprobs = {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                                for t, lp in _token_logprobs(session.tokenizer, out)], "refusal": None}
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": req.model or MODEL_NAME,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": logprobs}],
            "usage": _usage(prompt_ids, out)}


def completion_answer(session: AgentSession, req: CompletionRequest, prompt_ids: list[int],
                      out: dict | None) -> dict[str, Any]:
    finish = _openai_finish(out)
    logprobs = None
    if req.logprobs is not None:
        pairs = _token_logprobs(session.tokenizer, out)
        offsets, at = [], 0
        for t, _ in pairs:
            offsets.append(at)
            at += len(t)
        logprobs = {"tokens": [t for t, _ in pairs], "token_logprobs": [lp for _, lp in pairs],
                    "top_logprobs": None, "text_offset": offsets}
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": req.model or MODEL_NAME,
            "choices": [{"index": 0, "text": out.get("text", "") if out else "", "finish_reason": finish,
                         "logprobs": logprobs}],
            "usage": _usage(prompt_ids, out)}


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
        return list(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    except Exception as e:  # a template refuses a conversation (roles out of order, ...) by raising
        raise RequestError(400, f"the chat template cannot render these messages: {type(e).__name__}: {e}",
                           param="messages") from None


def _parse(model: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        # Where and what, without echoing the input back.
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']}" for err in e.errors()[:10])
        raise RequestError(400, f"invalid request: {problems}") from None


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        raise RequestError(400, "the request body is not valid JSON") from None


class _OpenAIBodyLimit(BodyLimit):
    """The body limit, answering in OpenAI's error shape."""

    async def _refuse(self, send) -> None:
        response = error_response(413, f"the request body is larger than the limit of {self.max_bytes} bytes")
        headers = [*response.raw_headers, (b"connection", b"close")]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": response.body})


# ---- the server --------------------------------------------------------------------------------


class _Server(uvicorn.Server):
    def capture_signals(self):  # type: ignore[override]
        # The rollout service handles its process's signals; uvicorn would take them over.
        return contextlib.nullcontext()


class OpenAIEndpoint:
    """The HTTP server agents call, and the samples registered with it by token."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.port = port
        self.sessions: dict[str, AgentSession] = {}
        self.app = self._build_app()
        self._server: _Server | None = None
        self._task: asyncio.Task | None = None

    @property
    def base_url(self) -> str:
        host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    def url_for(self, token: str) -> str:
        return f"{self.base_url}/samples/{token}/v1"

    def register(self, session: AgentSession) -> str:
        token = secrets.token_urlsafe(32)
        self.sessions[token] = session
        return token

    def unregister(self, token: str) -> None:
        session = self.sessions.pop(token, None)
        if session is not None:
            session.close()

    async def start(self) -> None:
        """Serve in the running loop; returns once connections are accepted."""
        # Bound here, not by uvicorn, which exits the process when it cannot bind.
        try:
            family, kind, proto, _, address = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)[0]
            sock = socket.socket(family, kind, proto)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
        except OSError as e:
            raise FailedPrecondition(f"the OpenAI-compatible endpoint for agents cannot listen on "
                                     f"{self.host}:{self.port} (settings openai_host / openai_port): {e}") from None
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, host=self.host, port=self.port, log_config=None, log_level="warning",
                                access_log=False, lifespan="off", timeout_graceful_shutdown=5,
                                # longer than clients keep idle connections (httpx: 5 s)
                                timeout_keep_alive=30)
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                sock.close()
                await self._task  # raises what stopped it
                raise RuntimeError(f"the OpenAI-compatible endpoint on {self.host}:{self.port} stopped while starting")
            await asyncio.sleep(0.01)
        log.info("OpenAI-compatible endpoint for agents on %s", self.base_url)

    async def close(self) -> None:
        for token in list(self.sessions):
            self.unregister(token)
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task

    def _session(self, token: str) -> AgentSession:
        session = self.sessions.get(token)
        if session is None:
            raise RequestError(404, "no sample is generating under this URL: its agent has returned, or the URL "
                               "is wrong", kind="not_found_error")
        return session

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="rlmesh OpenAI-compatible endpoint", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_middleware(_OpenAIBodyLimit, max_bytes=MAX_REQUEST_BYTES)

        @app.exception_handler(RequestError)
        async def request_error(request: Request, e: RequestError):
            return error_response(e.status, e.message, e.kind, e.param)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request: Request, e: StarletteHTTPException):
            return error_response(e.status_code, str(e.detail))

        @app.exception_handler(Exception)
        async def unexpected(request: Request, e: Exception):  # (uvicorn logs the traceback)
            return error_response(500, f"internal error: {type(e).__name__}: {e}", kind="server_error")

        @app.get("/samples/{token}/v1/models")
        async def models(token: str):
            self._session(token)
            return {"object": "list", "data": [_model_card()]}

        @app.get("/samples/{token}/v1/models/{model:path}")
        async def model(token: str, model: str):
            self._session(token)
            return _model_card(model)

        @app.post("/samples/{token}/v1/chat/completions")
        async def chat_completions(token: str, request: Request):
            session = self._session(token)
            req: ChatRequest = _parse(ChatRequest, await _json_body(request))
            _refuse_unsupported(req)
            if req.top_logprobs:
                raise RequestError(400, "top_logprobs is not supported (logprobs of the chosen tokens are)",
                                   param="top_logprobs")
            if (req.response_format or {}).get("type", "text") != "text":
                raise RequestError(400, "response_format: only text is supported (no constrained decoding)",
                                   param="response_format")
            messages = template_messages(req.messages, session.options.tool_arguments_as_dict)
            use_tools = bool(req.tools) and req.tool_choice != "none"
            if use_tools:
                _check_tools(req.tools or [])
            prompt_ids = chat_prompt_ids(session.tokenizer, messages, req.tools if use_tools else None)
            out = await session.generate(prompt_ids, req.max_completion_tokens or req.max_tokens,
                                         request_sampling(req, session))
            return chat_answer(session, req, prompt_ids, out, parse_tools=use_tools)

        @app.post("/samples/{token}/v1/completions")
        async def completions(token: str, request: Request):
            session = self._session(token)
            req: CompletionRequest = _parse(CompletionRequest, await _json_body(request))
            _refuse_unsupported(req)
            if req.echo:
                raise RequestError(400, "echo is not supported", param="echo")
            prompt_ids = completion_prompt_ids(session.tokenizer, req.prompt)
            out = await session.generate(prompt_ids, req.max_tokens, request_sampling(req, session))
            return completion_answer(session, req, prompt_ids, out)

        return app


def _model_card(name: str = MODEL_NAME) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "rlmesh"}


# One endpoint per event loop (a rollout process has one loop; tests start several).
_endpoints: dict[asyncio.AbstractEventLoop, asyncio.Task] = {}


async def shared_endpoint(settings: Any) -> OpenAIEndpoint:
    """This process's endpoint, started on first use on settings.openai_host/openai_port."""
    for closed in [loop for loop in _endpoints if loop.is_closed()]:
        del _endpoints[closed]
    loop = asyncio.get_running_loop()
    starting = _endpoints.get(loop)
    if starting is None or (starting.done() and (starting.cancelled() or starting.exception() is not None)):

        async def start() -> OpenAIEndpoint:
            endpoint = OpenAIEndpoint(settings.openai_host, settings.openai_port)
            await endpoint.start()
            return endpoint

        starting = _endpoints[loop] = loop.create_task(start())
    return await asyncio.shield(starting)


async def close_shared_endpoint() -> None:
    """Stop this loop's endpoint, if one was started (at the rollout service's shutdown)."""
    starting = _endpoints.pop(asyncio.get_running_loop(), None)
    if starting is not None and starting.done() and not starting.cancelled() and starting.exception() is None:
        await starting.result().close()


# ---- the generate function ---------------------------------------------------------------------


async def _run_agent(agent: Any, base_url: str, sample: Sample) -> None:
    if inspect.iscoroutinefunction(agent) or inspect.iscoroutinefunction(type(agent).__call__):
        await agent(base_url, sample)
    else:  # plain code (a synchronous client) must not block the loop that serves its calls
        result = await asyncio.to_thread(agent, base_url, sample)
        if inspect.isawaitable(result):
            await result


async def openai_agent_generate(ctx: GenerateContext, sample: Sample, sampling_params: dict) -> Sample | list[Sample]:
    """Run the run's agent against this sample's own OpenAI-compatible URL; what it
    generated there becomes the sample, or several (see the module's docstring)."""
    opts: OpenAIAgentOptions | None = ctx.options
    if opts is None:
        raise ValueError("the 'openai_agent' generate function needs options naming the agent to run "
                         '(rollout.generate.options: {"agent": ...})')
    agents = getattr(ctx.settings, "agents", None) or {}
    if opts.agent not in agents:
        raise ValueError(f"unknown agent {opts.agent!r}; the rollout service has: {', '.join(sorted(agents)) or 'none'}"
                         " (settings agents)")
    agent = load_plugin(agents[opts.agent])
    endpoint = await shared_endpoint(ctx.settings)
    # A fresh rid per attempt: the rollout aborts a sample's calls by it (they all start with it).
    rid = sample.metadata["rid"] = uuid.uuid4().hex
    session = AgentSession(ctx, opts, sampling_params, rid)
    token = endpoint.register(session)
    agent_error: Exception | None = None
    try:
        await _run_agent(agent, endpoint.url_for(token), _cleared(sample))
    except Exception as e:
        agent_error = e
    finally:
        endpoint.unregister(token)
    if session.failure is not None:  # the engines are down: the rollout retries, whatever the agent made of it
        raise session.failure from agent_error
    if session.aborted:
        aborted = _cleared(sample)
        aborted.status = Status.ABORTED
        return aborted
    if agent_error is not None:
        raise agent_error
    samples = samples_from_calls(sample, session.calls, truncated=session.budget_spent)
    return samples[0] if len(samples) == 1 else samples


openai_agent_generate.options_model = OpenAIAgentOptions
