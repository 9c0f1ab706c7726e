"""The correction for samples of older weights (the run config's `off_policy` section),
without torch: which correction, its bounds, and the default each training mode gets.

In `one_step_off` and `fully_async` a sample's tokens come from weights one or more versions
behind the trainer's. The trainer's PPO ratio is taken against log-probs it recomputes with
its current weights (the proximal policy), so without a correction nothing accounts for the
gap to the engine's (behaviour) log-probs. Every method here weighs, masks or scales each
token's policy loss by the behaviour importance ratio rho = pi_prox / pi_behav (the engine's
log-probs); the formulas are in rlmesh.trainer.off_policy. `sync` is on-policy and gets none
unless the run asks."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

OffPolicyMethod = Literal["none", "tis", "mis", "decoupled", "icepop", "m2po", "asymmetric"]

# (lower, upper) of the ratio when the run leaves them unset. tis/mis/asymmetric: verl's
# rollout-correction threshold 2; decoupled: AReaL's behaviour-weight cap; icepop: a
# two-sided band around 1.
DEFAULT_BOUNDS: dict[str, tuple[float, float]] = {
    "tis": (0.0, 2.0),
    "mis": (0.0, 2.0),
    "decoupled": (0.0, 5.0),
    "icepop": (0.5, 2.0),
    "asymmetric": (0.0, 2.0),
}


class OffPolicyCorrection(BaseModel):
    """How the trainer corrects for samples generated with older weights (see
    docs/training-modes.md#off-policy-correction for the formulas and the measurements)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    method: OffPolicyMethod = Field(
        "tis",
        description="'tis': truncated importance weight min(rho, upper); 'mis': the weight rho, masked (0) outside "
        "[lower, upper]; 'decoupled': AReaL's decoupled PPO (the clip against the recomputed proximal policy, "
        "times the behaviour weight rho, tokens with rho above upper masked); 'icepop': tokens with rho outside "
        "the band [lower, upper] masked, rho inside; 'm2po': the tokens with the largest (log rho)^2 masked until "
        "the batch's second moment mean((log rho)^2) is at most m2_threshold, the others weighted 1; "
        "'asymmetric': tis for tokens with advantage >= 0, min(rho, negative_upper) for the others; "
        "'none': no weight (the engine's log-probs only measured).",
    )
    level: Literal["token", "sequence"] = Field(
        "token",
        description="tis and mis: one ratio per token, or per sequence (the product of its token ratios).",
    )
    lower: float | None = Field(
        None, ge=0, le=1e6, description="Lower bound of rho (default: 0; icepop 0.5). Not for m2po."
    )
    upper: float | None = Field(
        None, gt=1, le=1e6, description="Upper bound of rho (default: 2; decoupled 5). Not for m2po."
    )
    negative_upper: float = Field(
        1.0, gt=0, le=1e6, description="asymmetric: the cap of rho for tokens with a negative advantage."
    )
    m2_threshold: float = Field(
        0.04, gt=0, le=1e6, description="m2po: the bound on the batch's second moment mean((log rho)^2)."
    )
    ess_step_scaling: bool = Field(
        False,
        description="VCPO: scale each optimizer step's learning rate by sqrt(ESS) of the batch's sequence "
        "importance ratios, ESS = (sum w)^2 / (n sum w^2) in (0, 1] (any method, also 'none').",
    )
    optimal_baseline: bool = Field(
        False,
        description="VCPO's off-policy baseline (advantage estimators grpo and dr_grpo): each group's baseline is "
        "the mean of its rewards weighted by w^2, w the sequence importance ratio, in place of the plain mean "
        "(VCPO also weighs by each sequence's squared gradient norm; rlmesh takes those as equal).",
    )

    @model_validator(mode="after")
    def _bounds_belong_to_the_method(self):
        if self.method in ("none", "m2po") and (self.lower is not None or self.upper is not None):
            raise ValueError(
                f"lower and upper bound the ratio of tis, mis, decoupled, icepop, asymmetric; not {self.method!r}"
            )
        if self.level == "sequence" and self.method not in ("tis", "mis"):
            raise ValueError(f"level 'sequence' is for tis and mis; {self.method!r} works per token")
        lower, upper = self.bounds
        if lower >= upper:
            raise ValueError(f"lower ({lower:g}) must be below upper ({upper:g})")
        return self

    @property
    def bounds(self) -> tuple[float, float]:
        """(lower, upper) of the ratio, the method's defaults filled in."""
        default_lower, default_upper = DEFAULT_BOUNDS.get(self.method, (0.0, 2.0))
        return (
            default_lower if self.lower is None else self.lower,
            default_upper if self.upper is None else self.upper,
        )


# What one_step_off and fully_async get when the run sets no `off_policy`: of the
# candidates measured (docs/training-modes.md), truncated IS with VCPO's step scaling was
# the one near sync in both modes (IcePop's band, level with it in fully_async, collapsed a
# one_step_off seed).
ASYNC_DEFAULT = OffPolicyCorrection(method="tis", ess_step_scaling=True)


def resolve(config: OffPolicyCorrection | None, mode: str, rollout_is_set: bool) -> OffPolicyCorrection | None:
    """The correction a run trains with: its own, else its mode's default (None in sync,
    and when the run set the older algorithm.rollout_is_* correction instead)."""
    if config is not None:
        return config
    if mode == "sync" or rollout_is_set:
        return None
    return ASYNC_DEFAULT.model_copy()


# The estimators whose advantage is a reward minus its group's mean: the ones optimal_baseline replaces.
GROUP_MEAN_ESTIMATORS = ("grpo", "dr_grpo")


def check_one_correction(config: OffPolicyCorrection | None, rollout_is_set: bool, estimator: str) -> None:
    if config is not None and config.optimal_baseline and estimator not in GROUP_MEAN_ESTIMATORS:
        raise ValueError(
            f"off_policy.optimal_baseline replaces the group mean of {' and '.join(GROUP_MEAN_ESTIMATORS)}; "
            f"advantage_estimator {estimator!r} has none"
        )
    if config is not None and config.method != "none" and rollout_is_set:
        raise ValueError(
            "off_policy and algorithm.rollout_is_upper both weight the loss by the trainer/engine ratio: "
            "set one (off_policy {'method': 'tis', 'upper': ...} is what rollout_is_upper does)"
        )
