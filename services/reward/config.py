"""Reward service settings (flags, RLMESH_REWARD_* environment variables, or YAML).

Custom reward functions are named here, by the operator, and only here: a request
can pick a component by name but can never make the service import anything."""

from __future__ import annotations

import os

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from rlmesh.common.limits import MAX_REWARD_WEIGHT
from rlmesh.common.plugins import PluginPath
from rlmesh.common.settings import GrpcServiceSettings
from rlmesh.reward.url_policy import UrlPolicy
from rlmesh.reward.verifiers import DEFAULT_MAX_ANSWER_CHARS, VERIFIERS


class Settings(GrpcServiceSettings):
    model_config = SettingsConfigDict(env_prefix="RLMESH_REWARD_", extra="forbid")

    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(50053, ge=0, le=65535, description="gRPC port (0 = any free port).")
    redis_url: str = Field(
        "",
        description=(
            "Redis that holds the registered remote reward services (they survive restarts and are shared by "
            "replicas). Empty = keep registrations in memory only."
        ),
    )
    default_components: dict[str, float] = Field(
        default_factory=lambda: {"exact_match": 1.0},
        description="Components used when a request's spec names none: component name -> weight.",
    )
    custom_functions: dict[str, PluginPath] = Field(
        default_factory=dict,
        description=(
            "Per-sample reward functions: component name -> 'module:function'. The function takes a "
            "Sample and returns a float, or a dict (the spec's reward_key picks one entry); sync or async."
        ),
    )
    group_functions: dict[str, PluginPath] = Field(
        default_factory=dict,
        description=(
            "Group reward functions: component name -> 'module:function'. The function takes a group's "
            "list of Samples and returns one float (or dict) per sample; sync or async. Used by ScoreGroups."
        ),
    )

    # Remote reward services: defaults for what a registration leaves at 0 ...
    remote_timeout_seconds: float = Field(30.0, gt=0, description="Timeout of one call to a remote reward service.")
    remote_max_concurrency: int = Field(8, ge=1, description="Calls in flight at once per remote service.")
    remote_max_batch_size: int = Field(
        32, ge=1, description="Samples per call to a remote service (groups kept whole)."
    )
    # ... and how every remote is called.
    remote_max_retries: int = Field(2, ge=0, description="Retries of a call that timed out or met an outage.")
    remote_backoff_seconds: float = Field(
        0.1, gt=0, description="First retry delay; doubles per retry, with jitter, up to remote_backoff_max_seconds."
    )
    remote_backoff_max_seconds: float = Field(5.0, gt=0, description="Longest delay between retries.")
    breaker_failure_threshold: int = Field(
        5, ge=1, description="Consecutive failed calls after which a remote's circuit breaker opens (calls fail fast)."
    )
    breaker_cooldown_seconds: float = Field(
        10.0, gt=0, description="How long an open breaker waits before letting one trial call through."
    )
    max_reply_bytes: int = Field(
        16 * 1024 * 1024, ge=1024, description="Largest reply accepted from a remote service; larger ones fail."
    )

    # Built-in verifiers: worker processes, a time budget per sample, and how much text they read.
    verifier_workers: int = Field(
        default_factory=lambda: min(4, os.cpu_count() or 1),
        ge=1,
        description="Worker processes that run the built-in verifiers (default: the CPU count, at most 4).",
    )
    verifier_timeout_seconds: float = Field(
        5.0,
        gt=0,
        description=(
            "Time budget of one built-in verifier call on one sample: past it the worker is killed and replaced, "
            "and the sample is FAILED with 'verifier timeout' in metadata['reward_error']."
        ),
    )
    verifier_overload_seconds: float = Field(
        2.0,
        gt=0,
        description=(
            "Overload rule: gRPC health reports NOT_SERVING while a verifier call has waited longer than this "
            "for a free worker, and SERVING again once none has."
        ),
    )
    max_answer_chars: int = Field(
        DEFAULT_MAX_ANSWER_CHARS,
        ge=1,
        description=(
            "Built-in verifiers read only the last this-many characters of a response and of a label, where "
            "the final answer is; what comes before is ignored."
        ),
    )
    remote_allowed_networks: list[str] = Field(
        default_factory=list,
        description=(
            "Where remote reward services may live besides public addresses: CIDRs or addresses (e.g. "
            '"10.0.0.0/8", "127.0.0.1", "::1") and host names (e.g. "judge.internal": any loopback or '
            "private address it resolves to). Empty = public addresses only. Link-local and cloud metadata "
            "addresses are never called, whatever this says. `rlmesh up` allows loopback."
        ),
    )

    @field_validator("remote_allowed_networks")
    @classmethod
    def _check_networks(cls, entries: list[str]) -> list[str]:
        UrlPolicy(entries)  # raises ValueError naming a bad entry
        return entries

    @model_validator(mode="after")
    def _check_components(self) -> Settings:
        for field_name, functions in (
            ("custom_functions", self.custom_functions),
            ("group_functions", self.group_functions),
        ):
            for name in functions:
                if name in VERIFIERS:
                    raise ValueError(f"{field_name}: '{name}' is a built-in verifier; give the function another name")
        both = set(self.custom_functions) & set(self.group_functions)
        if both:
            raise ValueError(f"names used in both custom_functions and group_functions: {', '.join(sorted(both))}")
        known = set(VERIFIERS) | set(self.custom_functions) | set(self.group_functions)
        for name, weight in self.default_components.items():
            if name not in known:
                raise ValueError(f"default_components: unknown component '{name}'; known: {', '.join(sorted(known))}")
            if not abs(weight) <= MAX_REWARD_WEIGHT:  # (NaN too)
                raise ValueError(
                    f"default_components: weight of '{name}' must be a number within ±{MAX_REWARD_WEIGHT:g}"
                )
        return self
