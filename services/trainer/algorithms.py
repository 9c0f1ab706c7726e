"""The RL math of the trainer, as pure tensor functions.

Shapes: per-sequence values are [B]; per-token values are [B, T], response tokens
only, right-padded, with a float `mask` [B, T] that is 1 where a token is trained
(inside the response and loss_mask = 1) and 0 elsewhere. Nothing here knows about
models, devices or samples; every formula is in the docstring and checked by
tests/test_algorithms.py against numbers worked out by hand.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from rlmesh.common.run_config import AlgorithmConfig

GRPO_EPS = 1e-6
WHITEN_EPS = 1e-8
KL_CLAMP = 10.0


# --------------------------------------------------------------------------------------
# Masked reductions
# --------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------
# Advantages: one group = the samples of one prompt
# --------------------------------------------------------------------------------------


def grpo_advantages(rewards: Tensor, normalize_std: bool = True, eps: float = GRPO_EPS) -> Tensor:
    """GRPO, one group of n rewards:

        A_i = (r_i - mean(r)) / (std(r) + eps)      with normalize_std
        A_i =  r_i - mean(r)                        without

    std is the *unbiased* sample standard deviation, sqrt(sum((r - mean)^2) / (n - 1)),
    as torch.std computes by default (the same choice as verl and slime). A group of
    one sample has no spread: its std is taken as 0, so its advantage is 0.
    """
    centered = rewards - rewards.mean()
    if not normalize_std:
        return centered
    std = rewards.std() if rewards.numel() > 1 else torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    return centered / (std + eps)


def dr_grpo_advantages(rewards: Tensor) -> Tensor:
    """Dr. GRPO: A_i = r_i - mean(r). No std scaling; pair it with a loss aggregation
    that does not divide by each sequence's length (`seq_mean_token_sum`)."""
    return rewards - rewards.mean()


def rloo_advantages(rewards: Tensor) -> Tensor:
    """RLOO (leave one out): A_i = r_i - (sum_j r_j - r_i) / (n - 1).
    A group of one sample has no baseline: its advantage is 0."""
    n = rewards.numel()
    if n < 2:
        return torch.zeros_like(rewards)
    return rewards - (rewards.sum() - rewards) / (n - 1)


def reinforce_plus_plus_token_rewards(
    final_rewards: Tensor, mask: Tensor, kl: Tensor | None = None, kl_coef: float = 0.0
) -> Tensor:
    """REINFORCE++ per-token rewards [B, T]:

        r_t = -kl_coef * KL_t * m_t  +  (final reward if t is the sequence's last trained token)

    KL_t is the per-token KL to the reference model (any estimator, see kl_penalty).
    A sequence with no trained token gets no reward at all.
    """
    token_rewards = torch.zeros_like(mask)
    if kl is not None and kl_coef:
        token_rewards = token_rewards - kl_coef * kl * mask
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, positions, -1).max(dim=1).values  # -1: nothing trained
    rows = torch.nonzero(last >= 0).squeeze(1)
    token_rewards[rows, last[rows]] += final_rewards[rows].to(token_rewards.dtype)
    return token_rewards


def discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + gamma * G_{t+1}, computed right to left over the trained tokens.
    A masked-out token (say a tool's output inside the response) is not an action of
    the policy: it passes G_{t+1} through unchanged and is not discounted."""
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in range(token_rewards.shape[1] - 1, -1, -1):
        m = mask[:, t]
        running = m * (token_rewards[:, t] + gamma * running) + (1 - m) * running
        returns[:, t] = running * m
    return returns


def compute_advantages(
    config: AlgorithmConfig,
    rewards: Tensor,
    group_sizes: Sequence[int],
    mask: Tensor,
    kl: Tensor | None = None,
) -> Tensor:
    """Per-token advantages [B, T] for a batch whose samples are laid out group after
    group (`group_sizes` consecutive samples per prompt):

    - grpo, gspo:   grpo_advantages per group, broadcast to every trained token
    - dr_grpo:      dr_grpo_advantages per group, broadcast
    - rloo:         rloo_advantages per group, broadcast
    - reinforce_plus_plus:          masked_whiten(discounted_returns(
                                      reinforce_plus_plus_token_rewards(r, KL, kl_coef), gamma))
    - reinforce_plus_plus_baseline: masked_whiten((r_i - mean(group)) broadcast to tokens)

    `kl` (per token, against the reference model) is only used by reinforce_plus_plus.
    """
    if sum(group_sizes) != rewards.numel():
        raise ValueError(f"group sizes add up to {sum(group_sizes)} but there are {rewards.numel()} rewards")
    estimator = config.advantage_estimator
    if estimator == "reinforce_plus_plus":
        token_rewards = reinforce_plus_plus_token_rewards(rewards, mask, kl, config.kl_coef)
        return masked_whiten(discounted_returns(token_rewards, mask, config.gamma), mask)

    per_group = {
        "grpo": lambda r: grpo_advantages(r, config.normalize_advantage_std),
        "gspo": lambda r: grpo_advantages(r, config.normalize_advantage_std),
        "dr_grpo": dr_grpo_advantages,
        "rloo": rloo_advantages,
        "reinforce_plus_plus_baseline": dr_grpo_advantages,
    }[estimator]
    sequence_advantages = torch.cat([per_group(r) for r in torch.split(rewards, list(group_sizes))])
    token_advantages = sequence_advantages.unsqueeze(1).to(mask.dtype) * mask
    if estimator == "reinforce_plus_plus_baseline":
        return masked_whiten(token_advantages, mask)
    return token_advantages


# --------------------------------------------------------------------------------------
# Policy loss
# --------------------------------------------------------------------------------------


def gspo_log_ratio(log_probs: Tensor, old_log_probs: Tensor, mask: Tensor) -> Tensor:
    """GSPO's sequence-level log importance ratio, laid out per token:

        s_i = exp( sum_t (logp - old_logp) * m / sum_t m )          (one value per sequence)

    The returned per-token log ratio has the value log s_i at every token and the
    gradient of that token's own log-prob (sg(log s_i) + logp_t - sg(logp_t)), so that
    with `seq_mean_token_mean` aggregation the gradient is GSPO's:
    s_i * A_i * mean_t grad logp_t.
    """
    seq_log_ratio = masked_sum_rows(log_probs - old_log_probs, mask) / mask.sum(dim=1).clamp(min=1)
    return seq_log_ratio.detach().unsqueeze(1) + log_probs - log_probs.detach()


def policy_loss(
    log_ratio: Tensor,
    advantages: Tensor,
    eps_clip: float,
    eps_clip_high: float | None = None,
    dual_clip_c: float | None = None,
) -> tuple[Tensor, Tensor]:
    """PPO clipped surrogate, per token. With ratio = exp(log_ratio), where
    log_ratio = logp - old_logp (or gspo_log_ratio):

        L = max(-A * ratio, -A * clip(ratio, 1 - eps_clip, 1 + eps_clip_high))

    eps_clip_high defaults to eps_clip (set it higher for DAPO's clip-higher). With a
    dual clip c > 1, tokens with A < 0 are also capped: L = min(L, -c * A).

    Returns (L, clipped) where clipped is 1.0 where the clipped term was the larger
    one (the token's gradient is cut), for the clip-fraction metric.
    """
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    if dual_clip_c is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -dual_clip_c * advantages), loss)
    return loss, (clipped > unclipped).to(log_ratio.dtype)


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


def tis_weights(old_log_probs: Tensor, rollout_log_probs: Tensor, cap: float) -> Tensor:
    """Truncated importance sampling weight per token, trainer vs engine:

        w = clamp(exp(old_logp - rollout_logp), 0, cap)

    The policy loss of each token is multiplied by w (a constant: no gradient)."""
    return torch.clamp(torch.exp(old_log_probs - rollout_log_probs), 0.0, cap).detach()


def approx_kl(log_probs: Tensor, old_log_probs: Tensor, mask: Tensor) -> Tensor:
    """Metric: the k1 estimate of KL(old || new), mean over trained tokens of
    old_logp - logp."""
    return masked_mean(old_log_probs - log_probs, mask)


def nll_loss(log_probs: Tensor, mask: Tensor, num_tokens: float | None = None) -> Tensor:
    """SFT: mean negative log-likelihood of the trained tokens,
    sum(-logp * m) / N_tokens (N_tokens defaults to sum(m))."""
    return aggregate_loss(-log_probs, mask, "token_mean", num_tokens=num_tokens)
