"""The per-token terms and reductions every RL algorithm of the trainer shares, as pure
tensor functions (the shapes and the mask as in algorithms.py): masked sums and means,
whitening, the loss aggregation, KL estimators, entropy, the rollout importance weights,
the critic's value loss and explained variance, and the SFT loss. Every formula is in
the docstring and checked by tests/unit/test_algorithms.py.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

WHITEN_EPS = 1e-8
KL_CLAMP = 10.0


def masked_sum(values: Tensor, mask: Tensor) -> Tensor:
    return (values * mask).sum()


def masked_sum_rows(values: Tensor, mask: Tensor) -> Tensor:
    """Per-sequence sum_t v * m, shape [B]."""
    return (values * mask).sum(dim=1)


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """sum(v * m) / sum(m); 0 when the mask is empty."""
    return (values * mask).sum() / mask.sum().clamp(min=1)


def masked_whiten(values: Tensor, mask: Tensor, eps: float = WHITEN_EPS) -> Tensor:
    """Batch whitening over the masked tokens:

    mu  = sum(v * m) / sum(m)
    var = sum((v - mu)^2 * m) / sum(m)          (population variance, no n-1)
    w   = (v - mu) / sqrt(var + eps)            masked-out positions are 0
    """
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    return (values - mean) * torch.rsqrt(var + eps) * mask


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """Metric of the critic, over the trained tokens (population variances):

        EV = 1 - Var(R - V) / Var(R)

    1: the values predict the returns exactly; 0: no better than their mean; negative:
    worse. 0 when the returns have no variance (nothing to explain)."""
    var_returns = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
    residual = returns - values
    var_residual = masked_mean((residual - masked_mean(residual, mask)) ** 2, mask)
    if float(var_returns) <= WHITEN_EPS:
        return torch.zeros((), dtype=values.dtype, device=values.device)
    return 1 - var_residual / var_returns


def aggregate_loss(
    values: Tensor,
    mask: Tensor,
    mode: str,
    num_sequences: float | None = None,
    num_tokens: float | None = None,
) -> Tensor:
    """Reduce per-token losses to a scalar:

        token_mean:           sum_{i,t} v * m / N_tokens
        seq_mean_token_mean:  sum_i [ sum_t v * m / sum_t m ] / N_seqs
        seq_mean_token_sum:   sum_{i,t} v * m / N_seqs           (Dr. GRPO: no length division)

    N_tokens defaults to sum(m) and N_seqs to the number of sequences with at least one
    trained token. With gradient accumulation pass the whole mini-batch's counts, so the
    micro-batch losses add up to the mini-batch loss.
    """
    if num_tokens is None:
        num_tokens = mask.sum().clamp(min=1)
    if num_sequences is None:
        num_sequences = (mask.sum(dim=1) > 0).sum().clamp(min=1)
    if mode == "token_mean":
        return masked_sum(values, mask) / num_tokens
    if mode == "seq_mean_token_mean":
        return (masked_sum_rows(values, mask) / mask.sum(dim=1).clamp(min=1)).sum() / num_sequences
    if mode == "seq_mean_token_sum":
        return masked_sum(values, mask) / num_sequences
    raise ValueError(f"unknown loss aggregation {mode!r}")


def kl_penalty(log_probs: Tensor, ref_log_probs: Tensor, estimator: str) -> Tensor:
    """Per-token KL estimate against the frozen reference, with x = logp - ref_logp:

    k1 = x
    k2 = x^2 / 2
    k3 = exp(-x) - 1 + x
    low_var_kl = clamp(k3, -10, 10)
    """
    x = log_probs - ref_log_probs
    if estimator == "k1":
        return x
    if estimator == "k2":
        return x.pow(2) / 2
    k3 = torch.exp(-x) - 1 + x
    if estimator == "k3":
        return k3
    if estimator == "low_var_kl":
        return torch.clamp(k3, -KL_CLAMP, KL_CLAMP)
    raise ValueError(f"unknown KL estimator {estimator!r}")


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the softmax over the last dimension:
    H = -sum_v p_v log p_v = logsumexp(z) - sum_v p_v z_v."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def rollout_is_weights(
    old_log_probs: Tensor,
    rollout_log_probs: Tensor,
    mask: Tensor,
    *,
    level: str,
    mode: str,
    lower: float,
    upper: float,
) -> Tensor:
    """Importance weights [B, T] correcting for the engine's sampling distribution (rollout
    log-probs) differing from the trainer's (old log-probs); the policy loss of each token
    is multiplied by its weight (a constant: no gradient). The ratio, at

        level 'token':     rho_t = exp(old_logp_t - rollout_logp_t)
        level 'sequence':  rho_i = exp(sum_t (old_logp_t - rollout_logp_t) * m_t)
                           (the product of the token ratios over the trained tokens,
                           every token of the sequence carries it)

    is bounded by

        mode 'truncate':   w = clamp(rho, lower, upper)                   (TIS)
        mode 'mask':       w = rho if lower <= rho <= upper, else 0       (MIS)

    A masked token or sequence contributes nothing to the loss, but still counts in the
    loss aggregation's token and sequence counts: the estimator is E[rho * 1(in range) * g]
    over all samples. The ratio is compared in log space, so a far-off sequence (whose
    ratio would overflow) is masked or truncated, never inf. Untrained positions are 0.
    """
    log_ratio = torch.where(mask > 0, old_log_probs - rollout_log_probs, 0.0)
    if level == "sequence":
        log_ratio = log_ratio.sum(dim=1, keepdim=True).expand_as(mask)
    elif level != "token":
        raise ValueError(f"unknown rollout importance-sampling level {level!r}")
    log_upper = math.log(upper)
    log_lower = math.log(lower) if lower > 0 else -math.inf
    if mode == "truncate":
        weights = torch.clamp(torch.exp(torch.clamp(log_ratio, max=log_upper)), min=lower)
    elif mode == "mask":
        inside = (log_ratio >= log_lower) & (log_ratio <= log_upper)
        weights = torch.where(inside, torch.exp(torch.clamp(log_ratio, max=log_upper)), 0.0)
    else:
        raise ValueError(f"unknown rollout importance-sampling mode {mode!r}")
    return (weights * (mask > 0)).detach()


def clipped_value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip: float | None,
    num_tokens: float | None = None,
) -> Tensor:
    """PPO's critic loss, mean over the trained tokens:

        V_clip = old_V + clamp(V - old_V, -clip, clip)
        L_t    = 0.5 * max((V - R)^2, (V_clip - R)^2)
        loss   = sum(L_t * m) / N_tokens                 (N_tokens defaults to sum(m))

    with R the returns of gae_advantages and old_V the values recorded before the update.
    clip None is the plain squared error 0.5 * (V - R)^2. With gradient accumulation pass
    the whole mini-batch's token count.
    """
    loss = (values - returns) ** 2
    if clip is not None:
        clipped = old_values + torch.clamp(values - old_values, -clip, clip)
        loss = torch.maximum(loss, (clipped - returns) ** 2)
    return aggregate_loss(0.5 * loss, mask, "token_mean", num_tokens=num_tokens)


def approx_kl(log_probs: Tensor, old_log_probs: Tensor, mask: Tensor) -> Tensor:
    """Metric: the k1 estimate of KL(old || new), mean over trained tokens of
    old_logp - logp."""
    return masked_mean(old_log_probs - log_probs, mask)


def nll_loss(log_probs: Tensor, mask: Tensor, num_tokens: float | None = None) -> Tensor:
    """SFT: mean negative log-likelihood of the trained tokens,
    sum(-logp * m) / N_tokens (N_tokens defaults to sum(m))."""
    return aggregate_loss(-log_probs, mask, "token_mean", num_tokens=num_tokens)
