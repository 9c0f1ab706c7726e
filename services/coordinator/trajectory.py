"""The logic of the Atropos-compatible trajectory API (trajectory_api.py serves it): the
request bodies of atroposlib 0.4.0's `atroposlib/api/server.py`, field for field, so that an
unmodified environment in `serve` mode talks to rlmesh; the registry of a run's
environments; and a posted `ScoredData` group checked and turned into an ordinary
`SampleGroup` for the buffer. Plain Python values in and out: no HTTP, no gRPC."""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from dataclasses import asdict, dataclass
from typing import Any

from pydantic import BaseModel, field_validator

from rlmesh.common.limits import MAX_ABS_REWARD, MAX_REWARD_WEIGHT, MAX_SAMPLE_TOKENS
from rlmesh.common.sample import Sample, SampleGroup, Status

API_PREFIX = "/atropos"
# Atropos's own floor, so that no connected environment is starved of inference weight.
MIN_ENV_WEIGHT = 0.01
# Atropos's mask value of a token not trained on (prompt, tool output).
IGNORED = -100
# Text kept of one chat message for the samples browser.
MAX_MESSAGE_CHARS = 65_536


def api_path(capability: str) -> str:
    """The trajectory API's path of a run with this capability ("" for a run without one)."""
    return f"{API_PREFIX}/{capability}" if capability else ""


# ---- the bodies, as atroposlib 0.4.0 declares them -----------------------------------------


class Registration(BaseModel):
    wandb_group: str
    wandb_project: str
    batch_size: int
    max_token_len: int
    checkpoint_dir: str
    save_checkpoint_interval: int
    starting_step: int
    num_steps: int


class RegisterEnv(BaseModel):
    max_token_length: int
    desired_name: str | None = None  # (atroposlib sends its wandb_name, None unless set)
    weight: float
    group_size: int
    min_batch_allocation: float | None = None


class EnvIdentifier(BaseModel):
    env_id: int


class ScoredData(BaseModel):
    tokens: list[list[int]]
    masks: list[list[int]]
    scores: list[float]
    advantages: list[list[float]] | None = None
    ref_logprobs: list[list[float]] | None = None
    messages: list[list[dict[str, Any]]] | None = None
    generation_params: dict[str, Any] | None = None
    inference_logprobs: list[list[float]] | None = None
    overrides: list[dict] | None = None
    group_overrides: dict | None = None
    images: Any | None = None
    env_id: int | None = None
    distill_token_ids: list[list[list[int]]] | None = None
    distill_logprobs: list[list[list[float]]] | None = None

    @field_validator("messages", mode="before")
    @classmethod
    def _messages_have_role_and_content(cls, v):
        for message_list in v or []:
            for msg in message_list:
                if not isinstance(msg, dict) or "role" not in msg or "content" not in msg:
                    raise ValueError("Message must have 'role' and 'content' fields")
        return v


# ---- a run's environments --------------------------------------------------------------------


class BadGroup(ValueError):
    """A posted group rlmesh refuses; the message names what is wrong (answered 422)."""


@dataclass
class Environment:
    env_id: int
    desired_name: str
    real_name: str  # desired_name_<n>: Atropos's name of the n-th environment of that name
    weight: float
    group_size: int
    max_token_length: int
    min_batch_allocation: float | None
    connected: bool = True
    registered_at: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str | bytes) -> Environment:
        return cls(**json.loads(raw))


class Environments:
    """The environments registered with one run (at most `limit`); ids are their order. The
    run's registry is kept in Redis with the run (RunStore); this is its logic on a copy."""

    def __init__(self, run_id: str, limit: int, envs: list[Environment] | None = None) -> None:
        self.run_id = run_id
        self.limit = limit
        self.envs: list[Environment] = list(envs or [])

    def register(self, body: RegisterEnv, max_group_size: int) -> Environment:
        if len(self.envs) >= self.limit:
            raise BadGroup(
                f"the run already has {self.limit} registered environments (its environments.max_environments)"
            )
        if not 1 <= body.group_size <= max_group_size:
            raise BadGroup(f"group_size is {body.group_size}; it must be 1..{max_group_size} (limits)")
        if not 0 <= body.weight <= MAX_REWARD_WEIGHT:  # (NaN too)
            raise BadGroup(f"weight is {body.weight}; it must be within 0..{MAX_REWARD_WEIGHT:g}")
        if not 1 <= body.max_token_length <= MAX_SAMPLE_TOKENS:
            raise BadGroup(f"max_token_length is {body.max_token_length}; it must be 1..{MAX_SAMPLE_TOKENS}")
        allocation = body.min_batch_allocation
        if allocation is not None and not (math.isfinite(allocation) and 0 <= allocation <= 1):
            raise BadGroup(f"min_batch_allocation is {allocation}; it must be within 0..1")
        # (a name the buffer's metrics can carry)
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", body.desired_name or "environment")[:100]
        same = sum(e.desired_name == name for e in self.envs)
        env = Environment(
            env_id=len(self.envs),
            desired_name=name,
            real_name=f"{name}_{same}",
            weight=body.weight,
            group_size=body.group_size,
            max_token_length=body.max_token_length,
            min_batch_allocation=allocation,
            registered_at=time.time(),
        )
        self.envs.append(env)
        return env

    def get(self, env_id: int | None) -> Environment | None:
        return self.envs[env_id] if env_id is not None and 0 <= env_id < len(self.envs) else None

    def poster(self, env_id: int | None) -> Environment | None:
        """The environment a scored group names (None: it names none); one it names that is not
        registered is refused, rather than its groups taken unchecked."""
        env = self.get(env_id)
        if env_id is not None and env is None:
            raise BadGroup(f"env_id {env_id} is not registered with this run ({len(self.envs)} are)")
        return env

    def status(self, env_id: int, step: int, queued_samples: int) -> dict:
        """/status-env's answer. The buffer's queue is one FIFO for all environments, so an
        environment's own share of it is not known: each is told the whole queue, in groups
        of its size (which holds back every environment alike when the trainer falls behind)."""
        env = self.get(env_id)
        if env is None:
            raise BadGroup(f"env_id {env_id} is not registered with this run ({len(self.envs)} are)")
        connected = [e for e in self.envs if e.connected]
        total = sum(e.max_token_length * max(0.0, e.weight) for e in connected)
        share = env.max_token_length * env.weight / total if total > 0 else 1.0
        allocated = sum(e.min_batch_allocation or 0.0 for e in connected)
        queue = queued_samples // env.group_size
        return {
            "current_step": step,
            "queue_size": queue,
            "unallocated_fraction": 1.0 - min(allocated, 1.0),
            "self_queue_size": queue,
            "max_group_size": max(e.group_size for e in self.envs),
            "env_weight": max(MIN_ENV_WEIGHT, share),
        }


def heard_from(env: Environment, seen: dict[int, float], now: float, silent_after: float) -> bool:
    """Whether the environment registered, posted a group or asked /status-env within the last
    `silent_after` seconds (`seen`: env_id -> when it was last heard from)."""
    return max(env.registered_at, seen.get(env.env_id, 0.0)) >= now - silent_after


def batch_minimums(
    envs: list[Environment], batch_groups: int, seen: dict[int, float] | None = None, silent_after: float = 0.0
) -> dict[str, int]:
    """Each connected environment's min_batch_allocation as its least groups in a training
    batch of `batch_groups` groups, keyed by its groups' dataset (its real name), as Atropos's
    grab_batch_with_minimum_allocations counts them: the fraction of the batch, rounded down;
    minimums adding up to more than the batch are scaled down, each to at least one group
    (and, past the batch still, the later registrations' dropped). The minimum of an
    environment that disconnected, or (`silent_after` > 0) that has not been heard from for
    that long (`seen`, see heard_from: it died without disconnecting, and may have registered
    again under a new env_id), no longer applies: batches would wait for it forever."""
    now = time.time()
    wanted = {
        e.real_name: int(batch_groups * e.min_batch_allocation)
        for e in envs
        if e.connected and e.min_batch_allocation and (not silent_after or heard_from(e, seen or {}, now, silent_after))
    }
    wanted = {name: n for name, n in wanted.items() if n > 0}
    total = sum(wanted.values())
    if total > batch_groups:
        wanted = {name: max(1, int(n * batch_groups / total)) for name, n in wanted.items()}
    out, room = {}, batch_groups
    for name, n in wanted.items():
        if room <= 0:
            break
        out[name] = min(n, room)
        room -= out[name]
    return out


# ---- a posted group -> a SampleGroup ------------------------------------------------------


@dataclass
class RunView:
    """What checking and converting a posted group needs to know of the run."""

    vocab_size: int  # 0 = not known yet (token ids are then only checked to be non-negative)
    max_token_length: int
    max_group_size: int
    weight_version: int  # the run's version when the group arrived: its samples' version


def _refuse_unused(data: ScoredData) -> None:
    """Fields rlmesh would silently ignore if it took them: refused, so that nobody trains on
    something other than what they sent."""
    if data.advantages is not None:
        raise BadGroup(
            "advantages: rlmesh does not take environment-supplied advantages; the run's estimator "
            "(advantage_estimator) computes them from the scores. Send advantages: null"
        )
    if data.distill_token_ids is not None or data.distill_logprobs is not None:
        raise BadGroup("distill_token_ids / distill_logprobs: on-policy distillation is not supported by rlmesh")
    if data.images is not None:
        raise BadGroup("images: multimodal groups are not supported by the trajectory API yet")


def _expected_size(data: ScoredData, env: Environment | None) -> int | None:
    override = (data.group_overrides or {}).get("group_size")
    if override is not None and (not isinstance(override, int) or isinstance(override, bool)):
        raise BadGroup(f"group_overrides' group_size is {override!r}, not a whole number")
    if override is not None:
        return override
    return env.group_size if env is not None else None


def _check_lengths(data: ScoredData, run: RunView, env: Environment | None) -> int:
    n = len(data.tokens)
    if not 1 <= n <= run.max_group_size:
        raise BadGroup(f"tokens holds {n} sequences; a group has 1..{run.max_group_size} (limits)")
    override = _expected_size(data, None)
    if override is not None and n != override:
        raise BadGroup(f"tokens holds {n} sequences but group_overrides say group_size {override}")
    # A group smaller than registered (some of its rollouts failed) is taken as it is: batches
    # count groups, and the advantage estimator normalizes within each group, so it trains like
    # any other. (Atropos holds such pieces back until several add up to the group size, then
    # queues each as its own group: the same groups trained, later.) A larger one would never
    # fit Atropos's batch either, and is refused.
    if override is None and env is not None and n > env.group_size:
        raise BadGroup(
            f"tokens holds {n} sequences but environment {env.real_name!r} registered group_size {env.group_size}"
        )
    arrays = {"masks": data.masks, "scores": data.scores}
    arrays.update(
        {k: v for k, v in (("messages", data.messages), ("inference_logprobs", data.inference_logprobs)) if v}
    )
    for name, values in arrays.items():
        if len(values) != n:
            raise BadGroup(f"{name} holds {len(values)} entries but tokens holds {n} sequences")
    return n


# A log-probability is at most 0; a little above it is an engine's rounding.
_MOST_LOG_PROB = 1e-3


def _sample(data: ScoredData, i: int, run: RunView, env_name: str) -> Sample:
    tokens, masks, score = data.tokens[i], data.masks[i], data.scores[i]
    if not 1 <= len(tokens) <= run.max_token_length:
        raise BadGroup(
            f"tokens[{i}] has {len(tokens)} tokens; 1..{run.max_token_length} (the run's environments.max_token_length)"
        )
    if len(masks) != len(tokens):
        raise BadGroup(f"masks[{i}] has {len(masks)} entries but tokens[{i}] has {len(tokens)}")
    low, high = min(tokens), max(tokens)
    if low < 0 or (run.vocab_size and high >= run.vocab_size):
        bad = low if low < 0 else high
        bound = f"[0, {run.vocab_size - 1}] (the model's vocabulary)" if run.vocab_size else "0.."
        raise BadGroup(f"tokens[{i}] holds id {bad} at position {tokens.index(bad)}, outside {bound}")
    if not math.isfinite(score):
        raise BadGroup(f"scores[{i}] is {score}, not a finite number")
    if abs(score) > MAX_ABS_REWARD:
        raise BadGroup(f"scores[{i}] is {score:g}, outside ±{MAX_ABS_REWARD:g} (scale the scores down)")
    # The response starts at the first trained token; later -100s (tool output) stay untrained.
    prompt = next((j for j, m in enumerate(masks) if m != IGNORED), len(masks))
    if prompt == len(masks):
        raise BadGroup(f"masks[{i}] marks no token to train on (all -100)")
    response = len(tokens) - prompt
    log_probs: list[float] = []
    if data.inference_logprobs:
        given = data.inference_logprobs[i]
        if len(given) == len(tokens):
            log_probs = given[prompt:]
        elif len(given) == response:
            log_probs = given
        else:
            raise BadGroup(
                f"inference_logprobs[{i}] has {len(given)} entries; one per token ({len(tokens)}) or per "
                f"response token ({response}) is needed"
            )
        where = next((j for j, v in enumerate(log_probs) if not (math.isfinite(v) and v <= _MOST_LOG_PROB)), None)
        if where is not None:
            raise BadGroup(
                f"inference_logprobs[{i}] holds {log_probs[where]} at position {prompt + where}: a log-probability "
                "is a finite number at most 0"
            )
    messages = [_message(m) for m in data.messages[i]] if data.messages else []
    return Sample(
        index=i,
        tokens=list(tokens),
        response=next((m["content"] for m in reversed(messages) if m["role"] == "assistant"), ""),
        response_length=response,
        reward=float(score),
        loss_mask=[0 if m == IGNORED else 1 for m in masks[prompt:]],
        status=Status.COMPLETED,
        messages=messages,
        metadata={"environment": env_name},
        rollout_log_probs=[float(v) for v in log_probs],
        weight_versions=[run.weight_version],
    )


def _message(msg: dict[str, Any]) -> dict[str, str]:
    """A chat message as the samples browser shows it: role and text (other content as JSON)."""
    content = msg.get("content")
    text = content if isinstance(content, str) else json.dumps(content)
    return {"role": str(msg.get("role"))[:64], "content": text[:MAX_MESSAGE_CHARS]}


def group_id(data: ScoredData, env_name: str) -> str:
    """A posted group's id, from its content: an environment that posts the same group again
    (it retries after a lost answer) writes it once (the buffer is idempotent on ids)."""
    digest = hashlib.sha256(json.dumps([env_name, data.tokens, data.masks, data.scores]).encode()).hexdigest()
    return f"env-{digest[:32]}"


def scored_group(data: ScoredData, run: RunView, env: Environment | None) -> SampleGroup:
    """The posted group as an ordinary SampleGroup (BadGroup names what is wrong with it):
    tokens as they are, loss mask 1 where Atropos's mask is not -100 past the prompt, rewards
    = scores, the inference log-probs of the response tokens as rollout log-probs."""
    _refuse_unused(data)
    n = _check_lengths(data, run, env)
    name = env.real_name if env is not None else "environment"
    samples = [_sample(data, i, run, name) for i in range(n)]
    return SampleGroup(group_id=group_id(data, name), group_index=0, samples=samples, dataset=name)
