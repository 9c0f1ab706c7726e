"""The OpenAI-compatible endpoint's request bodies and errors: the 'openai_agent' generate
function's options, what OpenAI's clients send to /chat/completions and /completions, and
the error answer in OpenAI's shape."""

from __future__ import annotations

from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from rlmesh.rollout.agents.tool_parsers import ToolParserName, tool_parser_names

MODEL_NAME = "policy"  # what GET /models lists; requests may name any model
MAX_MESSAGES = 1024
MAX_TOOLS = 256
MAX_TOKENS = 1 << 20


class OpenAIAgentOptions(BaseModel):
    """The options of the 'openai_agent' generate function in a run (`rollout.generate.options`)."""

    model_config = ConfigDict(extra="forbid")

    agent: str = Field(
        min_length=1,
        max_length=128,
        description="Which of the rollout service's agents (settings.agents) runs each sample.",
    )
    tool_parser: ToolParserName = Field(
        "hermes",
        description="How tool calls are read from a chat answer when the request "
        "offers tools: " + ", ".join(tool_parser_names()),
    )
    max_calls: int = Field(16, ge=1, le=256, description="Model calls one sample's agent may make.")
    max_total_tokens: int = Field(
        0,
        ge=0,
        le=MAX_TOKENS,
        description="Tokens the model may generate over all of "
        "a sample's calls; 0 = max_calls x the run's max_new_tokens.",
    )
    honor_agent_sampling: bool = Field(
        False,
        description="Let requests set temperature, top_p, seed, penalties and logit_bias; by default the "
        "run's sampling is used (the trainer recomputes log-probs at the run's temperature).",
    )
    tool_arguments_as_dict: bool = Field(
        True,
        description="Give the chat template the arguments of an assistant message's tool_calls as a dict "
        "(Hugging Face's convention: Qwen, Llama 3); false: as the JSON text the client sent.",
    )

    @field_validator("agent")
    @classmethod
    def _registered_agent(cls, name: str, info: ValidationInfo) -> str:
        settings = (info.context or {}).get("settings")
        if settings is not None and name not in settings.agents:
            raise ValueError(
                f"unknown agent {name!r}; the rollout service has: "
                f"{', '.join(sorted(settings.agents)) or 'none'} (settings agents)"
            )
        return name


# ---- request bodies (what OpenAI's clients send; fields we do not use are ignored) ---------------


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_call_id: str | None = Field(None, max_length=256)
    name: str | None = Field(None, max_length=256)


class SamplingFields(BaseModel):
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


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool | None = None


class RequestError(Exception):
    """Answered as OpenAI answers errors: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def error_response(
    status: int, message: str, kind: str = "invalid_request_error", param: str | None = None
) -> JSONResponse:
    # x-should-retry: OpenAI's clients would otherwise retry 5xx answers themselves.
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": None}},
        status_code=status,
        headers={"x-should-retry": "false"},
    )
