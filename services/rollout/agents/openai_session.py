"""One sample's side of the OpenAI-compatible endpoint: the session that holds its engine,
sampling and budgets and records each model call, and the stitching of those calls into
samples (one per chain of calls; see rlmesh.rollout.agents.openai_agent)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from rlmesh.common.errors import InvalidArgument
from rlmesh.common.sample import Sample, Status
from rlmesh.rollout.agents.openai_models import OpenAIAgentOptions, RequestError
from rlmesh.rollout.engine_client import EngineError
from rlmesh.rollout.generation import FINISH_STATUS, GenerateContext, apply_engine_output

log = logging.getLogger(__name__)

# Calls answered "length" after a budget was spent before further calls are refused: an
# agent that ignores finish_reason must not spin until the sample times out.
MAX_CALLS_PAST_BUDGET = 4
NO_CALL_REASON = "the agent made no model call"


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
            raise RequestError(
                503, "the rollout aborted this sample's generation; it will be started over", kind="server_error"
            )
        if self.failure is not None:
            raise RequestError(503, f"the engine failed: {self.failure}", kind="server_error")
        left = self.token_budget - self.generated - self.reserved
        limit = min(self.max_new_tokens, left, max_tokens or self.max_new_tokens)
        if self.started >= self.options.max_calls or limit <= 0:
            self.budget_spent = True
            self.past_budget += 1
            if self.past_budget > MAX_CALLS_PAST_BUDGET:
                raise RequestError(
                    400,
                    f"this sample's budget ({self.options.max_calls} calls, {self.token_budget} "
                    "generated tokens) is spent and the agent kept calling after answers with "
                    "finish_reason 'length'",
                )
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
            raise RequestError(
                503, "the rollout aborted this sample's generation; it will be started over", kind="server_error"
            )
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


def cleared_copy(sample: Sample) -> Sample:
    """A copy of the sample with nothing generated yet."""
    s = sample.copy()
    s.tokens, s.response, s.response_length = [], "", 0
    s.loss_mask, s.rollout_log_probs, s.weight_versions = [], [], []
    return s


def samples_from_calls(sample: Sample, calls: list[ModelCall], truncated: bool = False) -> list[Sample]:
    """One sample per chain of calls (see rlmesh.rollout.agents.openai_agent); `truncated`: a budget
    cut the episode short. No calls: the sample, FAILED."""
    if not calls:
        failed = cleared_copy(sample)
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
        s = cleared_copy(sample)
        s.tokens = list(chain[0].prompt_ids)
        for call in chain:
            between = call.prompt_ids[len(s.tokens) :]  # tool results, the next user turn: not the model's
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
