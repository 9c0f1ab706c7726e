"""Corrections for samples of older weights, as pure tensor functions (shapes and masks as in
algorithms.py), and the off-policy metrics every RL step reports.

With old_logp the trainer's log-probs before the update (the proximal policy: PPO's ratio
is taken against it) and behav_logp the engine's (the weights that sampled the token), the
behaviour importance ratio of a trained token is

    rho_t = exp(old_logp_t - behav_logp_t)

Each method turns rho into a per-token weight w_t that multiplies the token's policy loss
(a constant: no gradient), so the PPO clip still acts on pi_theta / pi_prox: AReaL's
decoupled objective, whatever the weight. Every formula is checked against hand
computations in tests/unit/test_off_policy.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from rlmesh.common.off_policy import OffPolicyCorrection
from rlmesh.trainer import loss_terms as terms

# exp of a larger log ratio overflows float32; a weight this large is cut by every method anyway.
MAX_LOG_RATIO = 20.0


@dataclass
class Correction:
    weights: Tensor | None  # [B, T] per-token loss weight (1 where the engine sent no log-probs); None: none
    lr_scale: float = 1.0  # multiplies the learning rate of this batch's optimizer steps
    metrics: dict[str, float] = field(default_factory=dict)


def log_ratio(old_log_probs: Tensor, behaviour_log_probs: Tensor, mask: Tensor) -> Tensor:
    """log rho_t = old_logp_t - behav_logp_t at trained tokens, 0 elsewhere."""
    return torch.where(mask > 0, old_log_probs - behaviour_log_probs, 0.0)


def m2po_mask(log_rho: Tensor, mask: Tensor, threshold: float) -> Tensor:
    """M2PO's second-moment mask, [B, T] of 0/1: with M2 = mean over the batch's trained
    tokens of (log rho_t)^2, the tokens with the largest (log rho)^2 are masked, one by one
    from the largest, until the mean over the tokens left is at most `threshold`. A batch
    already within the bound masks nothing."""
    keep = (mask > 0).to(log_rho.dtype)
    flat = (log_rho**2)[mask > 0]
    n = flat.numel()
    if n == 0:
        return keep
    order = torch.argsort(flat, descending=True, stable=True)
    ranked = flat[order]
    # mean of ranked[k:] for every k: what is left after masking the k largest
    left = torch.flip(torch.cumsum(torch.flip(ranked, [0]), 0), [0]) / torch.arange(n, 0, -1, device=flat.device)
    within = torch.nonzero(left <= threshold)
    k = int(within[0]) if within.numel() else n
    kept = torch.ones(n, dtype=log_rho.dtype, device=log_rho.device)
    kept[order[:k]] = 0.0
    keep[mask > 0] = kept
    return keep


def asymmetric_weights(
    log_rho: Tensor, advantages: Tensor, mask: Tensor, lower: float, upper: float, negative_upper: float
) -> Tensor:
    """Truncated weights with a tighter cap where the advantage is negative:

        w_t = clamp(rho_t, lower, upper)            A_t >= 0
        w_t = clamp(rho_t, lower, negative_upper)   A_t <  0

    A token the engine sampled less likely than the trainer now finds it (rho > 1) and
    that was bad (A < 0) is pushed down with at most negative_upper times its gradient."""
    rho = torch.exp(torch.clamp(log_rho, max=MAX_LOG_RATIO))
    positive = torch.clamp(rho, min=lower, max=upper)
    negative = torch.clamp(rho, min=lower, max=negative_upper)
    return torch.where(advantages < 0, negative, positive) * (mask > 0)


def sequence_ess(log_rho: Tensor, mask: Tensor) -> float:
    """Normalized effective sample size of the sequence ratios w_i = exp(sum_t log rho_t) of
    the sequences with a trained token:

        ESS = (sum_i w_i)^2 / (n * sum_i w_i^2)       in (0, 1]; 1 when every w_i is equal

    computed on w_i / max_j w_j (ESS does not change with a common scale), so no weight
    overflows. 1.0 for an empty batch."""
    rows = mask.sum(dim=1) > 0
    s = log_rho.sum(dim=1)[rows].double()
    if s.numel() == 0:
        return 1.0
    w = torch.exp(s - s.max())
    return float(w.sum() ** 2 / (s.numel() * (w * w).sum()))


def baseline_weights(
    config: OffPolicyCorrection | None,
    old_log_probs: Tensor,
    behaviour_log_probs: Tensor,
    scored: Tensor,
    group_sizes: Sequence[int],
) -> Tensor | None:
    """VCPO's off-policy baseline weights [B] when the run asks for them (optimal_baseline),
    for a batch laid out group after group: w_i^2, with w_i = exp(sum_t log rho_t) the
    sequence ratio of sample i over its `scored` tokens, scaled within each group so that
    its largest is 1 (the baseline sum_i w_i^2 r_i / sum_i w_i^2 does not see a common
    factor, and no weight overflows). VCPO's minimum-variance baseline also weighs each
    sample by its squared gradient norm; rlmesh takes those as equal (knowing them would
    take one backward pass per sample)."""
    if config is None or not config.optimal_baseline:
        return None
    sequence_log_w = log_ratio(old_log_probs, behaviour_log_probs, scored).sum(dim=1)
    groups = torch.split(sequence_log_w, list(group_sizes))
    return torch.cat([torch.exp(2 * (s - s.max())) if s.numel() else s for s in groups] or [sequence_log_w[:0]])


def correction_weights(
    config: OffPolicyCorrection, log_rho: Tensor, mask: Tensor, advantages: Tensor
) -> tuple[Tensor, Tensor]:
    """(weights [B, T], cut [B, T]) of `config.method` at the trained tokens in `mask`; cut
    is 1 where the weight was truncated or masked (it is not the ratio itself)."""
    lower, upper = config.bounds
    rho = torch.exp(torch.clamp(log_rho, max=MAX_LOG_RATIO)) * (mask > 0)
    method = config.method
    if method in ("tis", "mis"):
        weights = terms.rollout_is_weights(
            log_rho,
            torch.zeros_like(log_rho),
            mask,
            level=config.level,
            mode="truncate" if method == "tis" else "mask",
            lower=lower,
            upper=upper,
        )
        if config.level == "sequence":
            rho = torch.exp(torch.clamp(log_rho.sum(dim=1, keepdim=True), max=MAX_LOG_RATIO)).expand_as(mask) * (
                mask > 0
            )
    elif method in ("decoupled", "icepop"):
        weights = terms.rollout_is_weights(
            log_rho, torch.zeros_like(log_rho), mask, level="token", mode="mask", lower=lower, upper=upper
        )
    elif method == "m2po":
        weights = m2po_mask(log_rho, mask, config.m2_threshold)
        return weights, (mask > 0) & (weights == 0)
    elif method == "asymmetric":
        weights = asymmetric_weights(log_rho, advantages, mask, lower, upper, config.negative_upper)
    else:
        raise ValueError(f"unknown off-policy correction {method!r}")
    cut = (mask > 0) & ~torch.isclose(weights, rho, rtol=1e-6, atol=0.0)
    return weights, cut


def correct(
    config: OffPolicyCorrection | None,
    old_log_probs: Tensor,
    behaviour_log_probs: Tensor,
    mask: Tensor,
    present: Tensor,
    advantages: Tensor,
) -> Correction:
    """The run's correction for a batch (`present` [B, T] is 1 where the engine sent
    log-probs), with its metrics; measured even when no correction is applied:

        is_weight_mean, is_weight_max    the weights w_t (rho_t with no correction) over
                                         trained tokens with engine log-probs
        is_truncated_masked_fraction     the share of those tokens whose weight is not rho_t
        is_ess                           sequence_ess of rho
        off_policy_lr_scale              the learning-rate multiplier (VCPO: sqrt(is_ess))
    """
    scored = mask * present
    if not bool(scored.any()):
        return Correction(None)
    log_rho = log_ratio(old_log_probs, behaviour_log_probs, scored)
    ess = sequence_ess(log_rho, scored)
    weights = None
    if config is None or config.method == "none":
        shown = torch.exp(torch.clamp(log_rho, max=MAX_LOG_RATIO))
        cut = torch.zeros_like(scored, dtype=torch.bool)
    else:
        shown, cut = correction_weights(config, log_rho, scored, advantages)
        weights = torch.where(present > 0, shown, 1.0).detach()
    lr_scale = math.sqrt(ess) if config is not None and config.ess_step_scaling else 1.0
    inside = scored > 0
    n = float(scored.sum())
    metrics = {
        "is_weight_mean": float(shown[inside].sum()) / n,
        "is_weight_max": float(shown[inside].max()),
        "is_truncated_masked_fraction": float(cut.sum()) / n,
        "is_ess": ess,
        "off_policy_lr_scale": lr_scale,
    }
    return Correction(weights, lr_scale, metrics)
