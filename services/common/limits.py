"""Upper bounds on every count and size a caller can ask for: one table, the same for the
run config (checked by the coordinator, 422) and for every RPC (checked by each service,
INVALID_ARGUMENT). Operators raise or lower them per service with the `limits` setting
(e.g. RLMESH_BUFFER_LIMITS='{"max_groups_per_call": 8192}'); keep the services' tables
equal, or the smallest one decides.

Structural bounds that do not depend on the hardware (name lengths, list lengths, integer
widths of the wire format) are field constraints of the run config instead."""

from __future__ import annotations

import math
from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict, Field

from rlmesh.common.errors import InvalidArgument

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
MAX_DATASETS = 64  # datasets of one run (a fixed bound: the run config's schema says so too)
# A remote reward service's registration (rlmesh.common.reward_service declares it with these).
MAX_REMOTE_TIMEOUT_SECONDS = 3600
MAX_REMOTE_CONCURRENCY = 1024
MAX_REMOTE_BATCH_SIZE = 100_000
MAX_TOKEN_CHARS = 4096
# A reward component's weight, in a run config or a reward service's registration.
MAX_REWARD_WEIGHT = 1e6
# A sample's reward and each of its components: larger ones are a reward function's bug (scale
# it down), and their squares and sums would overflow the trainer's float32 statistics.
MAX_ABS_REWARD = 1e9
# A stored sample: tokens (prompt and response; beyond any model's context today), the weight
# versions that generated it (one more per weight push it spanned), and its group's id.
MAX_SAMPLE_TOKENS = 1 << 22
MAX_WEIGHT_VERSIONS = 4096
MAX_GROUP_ID_CHARS = 512


class Limits(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_groups_per_call: int = Field(
        4096,
        ge=1,
        le=INT32_MAX,
        description="Groups (prompts) one call may ask for or carry: a rollout "
        "(rollout_batch_size + over_sampling_groups), an SFT step, GetPrompts, PutGroups, LeaseBatch, TrainStep, "
        "ScoreGroups, DropGroups.",
    )
    max_samples_per_prompt: int = Field(
        1024, ge=1, le=INT32_MAX, description="Samples per prompt (the group size), in training and in evaluation."
    )
    max_samples_per_call: int = Field(
        65536,
        ge=1,
        le=INT32_MAX,
        description="Samples one call may produce or carry: groups x samples per prompt "
        "of a rollout, a lease or a scoring call; prompts x samples per prompt of an evaluation (an evaluation of "
        "a whole dataset, eval.limit 0, takes its first max_samples_per_call / n_samples_per_prompt prompts).",
    )
    max_new_tokens: int = Field(131072, ge=1, le=INT32_MAX, description="Tokens generated per response.")
    max_num_rollouts: int = Field(10_000_000, ge=1, le=INT32_MAX, description="Rollouts (RL iterations) of one run.")
    max_steps: int = Field(
        1_000_000, ge=1, le=INT32_MAX, description="sft_warmup.steps and num_steps_per_rollout of one run."
    )
    max_micro_batch_size: int = Field(65536, ge=1, le=INT32_MAX, description="Samples per forward/backward pass.")
    max_concurrency: int = Field(65536, ge=1, le=INT32_MAX, description="In-flight engine requests of a rollout.")


def at_most(value: int, limit: int, what: str, setting: str) -> None:
    """Raise InvalidArgument when a requested count is above its limit (for RPC handlers)."""
    if value > limit:
        source = f"limits.{setting} of this service; an operator can raise it" if setting else "a fixed bound"
        raise InvalidArgument(f"{what} is {value}, more than the limit of {limit} ({source})")


MAX_DURATION_SECONDS = 7 * 24 * 3600  # leases and waits: a week is already absurd


def seconds(value: float, what: str, most: float = MAX_DURATION_SECONDS) -> float:
    """A duration a caller gave: finite, not negative, at most `most` (NaN would never compare
    true and make a wait endless; infinity a lease that never expires)."""
    if not (math.isfinite(value) and 0 <= value <= most):
        raise InvalidArgument(f"{what} must be a number of seconds between 0 and {most:g}, got {value}")
    return value


def within(checks: Iterable[tuple[int, int, str, str]]) -> None:
    for value, limit, what, setting in checks:
        at_most(value, limit, what, setting)
