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

The code: openai_models (options, request bodies, errors), openai_session (one sample's
calls and their stitching into samples), openai_templates (requests to engine calls and
answers), openai_server (the HTTP server), and here the generate function.
"""

from __future__ import annotations

import asyncio
import inspect
import uuid
from typing import Any

from rlmesh.common.plugins import load_plugin
from rlmesh.common.sample import Sample, Status
from rlmesh.rollout.agents.openai_models import OpenAIAgentOptions
from rlmesh.rollout.agents.openai_server import shared_endpoint
from rlmesh.rollout.agents.openai_session import AgentSession, cleared_copy, samples_from_calls
from rlmesh.rollout.generation import GenerateContext


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
        raise ValueError(
            "the 'openai_agent' generate function needs options naming the agent to run "
            '(rollout.generate.options: {"agent": ...})'
        )
    agents = getattr(ctx.settings, "agents", None) or {}
    if opts.agent not in agents:
        raise ValueError(
            f"unknown agent {opts.agent!r}; the rollout service has: {', '.join(sorted(agents)) or 'none'}"
            " (settings agents)"
        )
    agent = load_plugin(agents[opts.agent])
    endpoint = await shared_endpoint(ctx.settings)
    # A fresh rid per attempt: the rollout aborts a sample's calls by it (they all start with it).
    rid = sample.metadata["rid"] = uuid.uuid4().hex
    session = AgentSession(ctx, opts, sampling_params, rid)
    token = endpoint.register(session)
    agent_error: Exception | None = None
    try:
        await _run_agent(agent, endpoint.url_for(token), cleared_copy(sample))
    except Exception as e:
        agent_error = e
    finally:
        endpoint.unregister(token)
    if session.failure is not None:  # the engines are down: the rollout retries, whatever the agent made of it
        raise session.failure from agent_error
    if session.aborted:
        aborted = cleared_copy(sample)
        aborted.status = Status.ABORTED
        return aborted
    if agent_error is not None:
        raise agent_error
    samples = samples_from_calls(sample, session.calls, truncated=session.budget_spent)
    return samples[0] if len(samples) == 1 else samples


openai_agent_generate.options_model = OpenAIAgentOptions
