"""What each RL algorithm is, without torch: the advantage estimators and policy losses a
run may name (with what each one needs and the defaults its paper sets), and
AlgorithmConfig, the run config's `algorithm` section, which accepts exactly those names.

The trainer implements every name declared here: rlmesh.trainer.algorithms registers a
tensor function under each, and tests/unit/test_algorithms.py checks that the two lists
match. Adding an algorithm is one `declare_*` call here and one `register_*` function
there; services that never train validate run configs without importing torch."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# Before policy losses were chosen on their own, GSPO was asked for as an advantage
# estimator; that spelling still means GRPO's advantages with GSPO's loss.
LEGACY_GSPO_ESTIMATOR = "gspo"
# Before the rollout importance-sampling correction had levels and modes, its only
# setting was the cap of the token-level truncated weight; that spelling still means it.
LEGACY_TIS_CAP = "tis_cap"


@dataclass(frozen=True)
class EstimatorSpec:
    """What an advantage estimator needs from the trainer."""

    name: str
    # Shapes each token's reward with its KL to the reference (kl_coef): the only estimators
    # that take kl_coef at kl_reward_level 'token'; any estimator takes it at 'sequence'.
    kl_reward_shaping: bool = False
    # Uses a learned value function: the trainer adds a value head and trains it on the
    # estimator's returns.
    needs_critic: bool = False
    # AlgorithmConfig fields the estimator's paper sets, applied unless the run sets them.
    defaults: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PolicyLossSpec:
    name: str
    sequence_level: bool = False  # one importance ratio per sequence (GSPO), not per token
    defaults: Mapping[str, Any] = field(default_factory=dict)


ADVANTAGE_ESTIMATORS: dict[str, EstimatorSpec] = {}
POLICY_LOSSES: dict[str, PolicyLossSpec] = {}


def declare_advantage_estimator(
    name: str, *, kl_reward_shaping: bool = False, needs_critic: bool = False, defaults: Mapping[str, Any] | None = None
) -> EstimatorSpec:
    return _declare(
        ADVANTAGE_ESTIMATORS,
        EstimatorSpec(name, kl_reward_shaping, needs_critic, MappingProxyType(dict(defaults or {}))),
    )


def declare_policy_loss(
    name: str, *, sequence_level: bool = False, defaults: Mapping[str, Any] | None = None
) -> PolicyLossSpec:
    return _declare(POLICY_LOSSES, PolicyLossSpec(name, sequence_level, MappingProxyType(dict(defaults or {}))))


def _declare(table: dict, spec):
    # Both checks catch a mistake at import rather than in the middle of a run.
    if spec.name in table:
        raise ValueError(f"{spec.name!r} is already declared")
    unknown = set(spec.defaults) - set(AlgorithmConfig.model_fields)
    if unknown:
        raise ValueError(f"{spec.name!r}: defaults for fields AlgorithmConfig does not have: {sorted(unknown)}")
    table[spec.name] = spec
    return spec


def _lookup(table: dict, setting: str, name: str):
    if name not in table:
        raise ValueError(f"{setting} must be one of {', '.join(table)}; got {name!r}")
    return table[name]


def _declared_names(table: dict):
    """json_schema_extra: list the names declared when the schema is built (the /docs enum)."""

    def add_enum(schema: dict[str, Any]) -> None:
        schema["enum"] = list(table)

    return add_enum


class AlgorithmConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, str_max_length=128)

    advantage_estimator: str = Field(
        "grpo",
        description="How advantages are computed from rewards: a name declared in rlmesh.common.algorithm "
        "('gspo' is still accepted and means grpo with policy_loss 'gspo').",
        json_schema_extra=_declared_names(ADVANTAGE_ESTIMATORS),
    )
    policy_loss: str = Field(
        "ppo_clip",
        description="The policy-gradient loss: a name declared in rlmesh.common.algorithm "
        "(ppo_clip: per-token ratio; gspo: sequence-level ratio; cispo: clipped, detached importance weight "
        "on the log-prob).",
        json_schema_extra=_declared_names(POLICY_LOSSES),
    )
    normalize_advantage_std: bool = Field(True, description="GRPO: divide by the group's reward std.")
    eps_clip: float = Field(
        0.2,
        gt=0,
        le=100,
        description="Lower clip range of the ratio (1 - eps_clip); for cispo, of its importance weight "
        "(default 1: no lower bound).",
    )
    eps_clip_high: float | None = Field(
        None,
        gt=0,
        le=100,
        description="Upper clip range (DAPO clip-higher; for cispo, of its importance weight, "
        "default 3); default eps_clip.",
    )
    dual_clip_c: float | None = Field(None, gt=1, le=1e3, description="Dual clip for negative advantages (c > 1).")
    loss_aggregation: Literal["seq_mean_token_mean", "token_mean", "seq_mean_token_sum"] = Field(
        "seq_mean_token_mean",
        description="How per-token losses are averaged: per sequence then over the batch, "
        "over all tokens of the batch, or summed per sequence (Dr. GRPO).",
    )
    kl_loss_coef: float = Field(0.0, ge=0, le=1e3, description="KL-to-reference loss term (needs a reference model).")
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = Field(
        "low_var_kl", description="Estimator of the per-token KL (Schulman's k1/k2/k3; low_var_kl = k3 clipped)."
    )
    kl_coef: float = Field(
        0.0,
        ge=0,
        le=1e3,
        description="KL to the reference as a reward penalty (see kl_reward_level); not with kl_loss_coef.",
    )
    kl_reward_level: Literal["token", "sequence"] = Field(
        "token",
        description="How kl_coef penalizes rewards: 'token' shapes each token's reward with its KL "
        "(REINFORCE++ only); 'sequence' subtracts kl_coef * the sample's KL summed over its trained tokens from "
        "its reward before the advantage estimator runs (any estimator).",
    )
    entropy_coef: float = Field(0.0, ge=-1e3, le=1e3, description="Weight of an entropy bonus in the loss (0 = off).")
    gamma: float = Field(
        1.0, ge=0, le=1, description="Discount of REINFORCE++ returns and of GAE (advantage_estimator 'gae')."
    )
    gae_lambda: float = Field(
        1.0,
        ge=0,
        le=1,
        description="GAE's lambda (advantage_estimator 'gae'): 1 = Monte Carlo returns minus the "
        "value, 0 = one-step TD errors.",
    )
    value_loss_coef: float = Field(
        0.5, ge=0, le=1e3, description="Weight of the critic's value loss in the loss (advantage_estimator 'gae')."
    )
    value_clip: float | None = Field(
        0.2,
        gt=0,
        le=1e6,
        description="PPO's value clipping: the new value is kept within this distance of the old one in "
        "the loss (None = plain squared error; advantage_estimator 'gae').",
    )
    rollout_is_upper: float | None = Field(
        None,
        ge=1,
        le=1e6,
        description="Importance sampling against the engine's log-probs (trainer / engine ratio), "
        "on when set: the upper bound of the ratio (formerly tis_cap).",
    )
    rollout_is_lower: float = Field(
        0.0, ge=0, le=1, description="Lower bound of the rollout importance ratio (0 = none)."
    )
    rollout_is_level: Literal["token", "sequence"] = Field(
        "token", description="One ratio per token, or per sequence (the product over its trained tokens)."
    )
    rollout_is_mode: Literal["truncate", "mask"] = Field(
        "truncate",
        description="'truncate' clamps the ratio into [lower, upper] (TIS); 'mask' drops tokens or "
        "sequences whose ratio falls outside it from the loss (MIS).",
    )

    @model_validator(mode="before")
    @classmethod
    def _legacy_gspo_estimator(cls, data: Any) -> Any:
        if not (isinstance(data, dict) and data.get("advantage_estimator") == LEGACY_GSPO_ESTIMATOR):
            return data
        if data.get("policy_loss", "gspo") != "gspo":
            raise ValueError(
                f"advantage_estimator 'gspo' means advantage_estimator 'grpo' with policy_loss 'gspo', "
                f"not policy_loss {data['policy_loss']!r}"
            )
        return {**data, "advantage_estimator": "grpo", "policy_loss": "gspo"}

    @model_validator(mode="before")
    @classmethod
    def _legacy_tis_cap(cls, data: Any) -> Any:
        if not (isinstance(data, dict) and LEGACY_TIS_CAP in data):
            return data
        data = dict(data)
        cap = data.pop(LEGACY_TIS_CAP)
        if "rollout_is_upper" in data:
            raise ValueError("tis_cap is the old name of rollout_is_upper: set only rollout_is_upper")
        return {**data, "rollout_is_upper": cap}

    @field_validator("advantage_estimator")
    @classmethod
    def _registered_estimator(cls, value: str) -> str:
        return _lookup(ADVANTAGE_ESTIMATORS, "advantage_estimator", value).name

    @field_validator("policy_loss")
    @classmethod
    def _registered_policy_loss(cls, value: str) -> str:
        return _lookup(POLICY_LOSSES, "policy_loss", value).name

    @model_validator(mode="after")
    def _algorithm_defaults(self):
        """What the estimator's and the loss's papers mean unless the run sets it (say Dr.
        GRPO's loss aggregation, GSPO's clip range): their specs' `defaults`."""
        explicit = set(self.model_fields_set)
        for spec in (ADVANTAGE_ESTIMATORS[self.advantage_estimator], POLICY_LOSSES[self.policy_loss]):
            for name, value in spec.defaults.items():
                if name not in explicit:
                    setattr(self, name, value)
        return self

    @model_validator(mode="after")
    def _one_kl(self):
        if self.kl_loss_coef > 0 and self.kl_coef > 0:
            raise ValueError("use KL either as a loss term (kl_loss_coef) or as a reward penalty (kl_coef), not both")
        if (
            self.kl_coef > 0
            and self.kl_reward_level == "token"
            and not ADVANTAGE_ESTIMATORS[self.advantage_estimator].kl_reward_shaping
        ):
            users = ", ".join(name for name, spec in ADVANTAGE_ESTIMATORS.items() if spec.kl_reward_shaping)
            raise ValueError(
                f"kl_coef at kl_reward_level 'token' (each token's reward shaped by its KL) is only used by {users}, "
                f"not {self.advantage_estimator!r}; set kl_reward_level 'sequence' to subtract kl_coef * the sample's "
                "KL from its reward (any estimator), or use kl_loss_coef for a KL loss term"
            )
        return self

    @model_validator(mode="after")
    def _dual_clip_needs_the_clipped_surrogate(self):
        if self.dual_clip_c is not None and self.policy_loss == "cispo":
            raise ValueError(
                "dual_clip_c caps PPO's clipped surrogate; cispo has none (its weight is clipped): "
                "leave dual_clip_c unset"
            )
        return self

    @property
    def needs_critic(self) -> bool:
        """Whether the advantage estimator needs a critic (a value head the trainer trains)."""
        return ADVANTAGE_ESTIMATORS[self.advantage_estimator].needs_critic

    @model_validator(mode="after")
    def _critic_settings_need_a_critic(self):
        if self.needs_critic:
            return self
        # Only values that differ from the defaults: a dumped config lists every field.
        inert = [
            name
            for name, default in (("gae_lambda", 1.0), ("value_loss_coef", 0.5), ("value_clip", 0.2))
            if getattr(self, name) != default
        ]
        if inert:
            critics = ", ".join(n for n, e in ADVANTAGE_ESTIMATORS.items() if e.needs_critic)
            raise ValueError(
                f"{', '.join(inert)} set, but only an estimator with a critic uses them ({critics}), "
                f"not {self.advantage_estimator!r}"
            )
        return self

    @model_validator(mode="after")
    def _rollout_is_bounds(self):
        if self.rollout_is_upper is None:
            # Only values that differ from the defaults: a dumped config lists every field.
            inert = [
                name
                for name, default in (
                    ("rollout_is_lower", 0.0),
                    ("rollout_is_level", "token"),
                    ("rollout_is_mode", "truncate"),
                )
                if getattr(self, name) != default
            ]
            if inert:
                raise ValueError(
                    f"{', '.join(inert)} set, but the rollout importance-sampling correction is off "
                    "until rollout_is_upper is set"
                )
        elif self.rollout_is_lower >= self.rollout_is_upper:
            raise ValueError(
                f"rollout_is_lower ({self.rollout_is_lower:g}) must be below rollout_is_upper "
                f"({self.rollout_is_upper:g})"
            )
        return self


declare_advantage_estimator("grpo")
declare_advantage_estimator("dr_grpo", defaults={"loss_aggregation": "seq_mean_token_sum"})
declare_advantage_estimator("rloo")
declare_advantage_estimator("reinforce_plus_plus", kl_reward_shaping=True)
declare_advantage_estimator("reinforce_plus_plus_baseline")
declare_advantage_estimator("gae", kl_reward_shaping=True, needs_critic=True)

declare_policy_loss("ppo_clip")
declare_policy_loss("gspo", sequence_level=True, defaults={"eps_clip": 3e-4, "eps_clip_high": 4e-4})
declare_policy_loss("cispo", defaults={"eps_clip": 1.0, "eps_clip_high": 3.0, "loss_aggregation": "token_mean"})
