"""The RL math of the trainer, as pure tensor functions.

Shapes: per-sequence values are [B]; per-token values are [B, T], response tokens
only, right-padded, with a float `mask` [B, T] that is 1 where a token is trained
(inside the response and loss_mask = 1) and 0 elsewhere. Nothing here knows about
models, devices or samples; every formula is in the docstring and checked by
tests/unit/test_algorithms.py against numbers worked out by hand. Here: the registries
and the advantage estimators and policy losses registered in them; the terms and
reductions every algorithm shares are in loss_terms.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor

from rlmesh.common import algorithm as declared
from rlmesh.common.algorithm import AlgorithmConfig, EstimatorSpec, PolicyLossSpec
from rlmesh.trainer.loss_terms import masked_sum_rows, masked_whiten

GRPO_EPS = 1e-6


# --------------------------------------------------------------------------------------
# Registries: each algorithm declared in rlmesh.common.algorithm (what the run config
# accepts) has its function here, under one register_* decorator.
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator may use, for a batch laid out group after group."""

    rewards: Tensor  # [B]
    group_sizes: Sequence[int]  # consecutive samples per prompt
    mask: Tensor  # [B, T]
    # [B, T] KL to the reference, for kl_reward_level 'token' and estimators with kl_reward_shaping
    # (compute_advantages passes None when the KL is already in `rewards`, level 'sequence').
    kl: Tensor | None
    # [B, T] the critic's value of the state before each token, for estimators with needs_critic.
    values: Tensor | None = None
    # [B] weights of each group's baseline (the off-policy correction's optimal_baseline), for
    # the estimators whose baseline is the group's mean reward; None: the plain mean.
    baseline_weights: Tensor | None = None

    def per_group(self, group_advantages: Callable[[Tensor], Tensor]) -> Tensor:
        """A one-group estimator (rewards [n] -> A [n]) applied to every group, each A_i
        broadcast to the trained tokens of sample i."""
        groups = torch.split(self.rewards, list(self.group_sizes))
        return self._broadcast(torch.cat([group_advantages(r) for r in groups]))

    def per_group_weighted(self, group_advantages: Callable[[Tensor, Tensor | None], Tensor]) -> Tensor:
        """per_group for an estimator that also takes the group's baseline weights ([n] or None)."""
        sizes = list(self.group_sizes)
        weights = (
            torch.split(self.baseline_weights, sizes) if self.baseline_weights is not None else [None] * len(sizes)
        )
        groups = zip(torch.split(self.rewards, sizes), weights)
        return self._broadcast(torch.cat([group_advantages(r, w) for r, w in groups]))

    def _broadcast(self, sequence_advantages: Tensor) -> Tensor:
        return sequence_advantages.unsqueeze(1).to(self.mask.dtype) * self.mask


# -> advantages [B, T]; an estimator with needs_critic returns (advantages, returns) [B, T],
# the returns being its critic's regression targets.
AdvantageFn = Callable[[AdvantageInputs, AlgorithmConfig], Any]
# (log_probs, old_log_probs, advantages, mask, config) -> (per-token loss, clipped indicator)
PolicyLossFn = Callable[[Tensor, Tensor, Tensor, Tensor, AlgorithmConfig], tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class AdvantageEstimator:
    name: str
    compute: AdvantageFn  # -> per-token advantages [B, T]
    # What the estimator needs (its kl_reward_shaping, needs_critic, defaults), as declared.
    spec: EstimatorSpec

    @property
    def needs_critic(self) -> bool:
        # The trainer then adds a value head, passes its values of the old policy's pass in
        # AdvantageInputs.values, and trains it on the returned returns.
        return self.spec.needs_critic

    @property
    def kl_reward_shaping(self) -> bool:
        return self.spec.kl_reward_shaping


@dataclass(frozen=True)
class PolicyLoss:
    name: str
    compute: PolicyLossFn
    spec: PolicyLossSpec

    @property
    def sequence_level(self) -> bool:
        return self.spec.sequence_level


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}
POLICY_LOSSES: dict[str, PolicyLoss] = {}

_Fn = TypeVar("_Fn", bound=Callable)


def register_advantage_estimator(name: str) -> Callable[[_Fn], _Fn]:
    """The tensor function of the advantage estimator `name` (declared in rlmesh.common.algorithm)."""

    def register(compute: _Fn) -> _Fn:
        spec = _declared(declared.ADVANTAGE_ESTIMATORS, "declare_advantage_estimator", name)
        _add(ADVANTAGE_ESTIMATORS, AdvantageEstimator(name, compute, spec))
        return compute

    return register


def register_policy_loss(name: str) -> Callable[[_Fn], _Fn]:
    """The tensor function of the policy loss `name` (declared in rlmesh.common.algorithm)."""

    def register(compute: _Fn) -> _Fn:
        _add(POLICY_LOSSES, PolicyLoss(name, compute, _declared(declared.POLICY_LOSSES, "declare_policy_loss", name)))
        return compute

    return register


def _declared(table: dict, declare: str, name: str):
    # Caught at import rather than in the middle of a run.
    if name not in table:
        raise ValueError(
            f"{name!r} is not declared: add {declare}({name!r}, ...) to rlmesh.common.algorithm "
            "(what it needs and its defaults), then register its function here"
        )
    return table[name]


def _add(registry: dict, implementation: AdvantageEstimator | PolicyLoss) -> None:
    if implementation.name in registry:
        raise ValueError(f"{implementation.name!r} is already registered")
    registry[implementation.name] = implementation


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    return _lookup(ADVANTAGE_ESTIMATORS, "advantage_estimator", name)


def get_policy_loss(name: str) -> PolicyLoss:
    return _lookup(POLICY_LOSSES, "policy_loss", name)


def _lookup(registry: dict, setting: str, name: str):
    if name not in registry:
        raise ValueError(f"{setting} must be one of {', '.join(registry)}; got {name!r}")
    return registry[name]


# --------------------------------------------------------------------------------------
# Advantages: one group = the samples of one prompt
# --------------------------------------------------------------------------------------


def grpo_advantages(
    rewards: Tensor, normalize_std: bool = True, eps: float = GRPO_EPS, baseline_weights: Tensor | None = None
) -> Tensor:
    """GRPO, one group of n rewards:

        A_i = (r_i - mean(r)) / (std(r) + eps)      with normalize_std
        A_i =  r_i - mean(r)                        without

    With baseline_weights v, the baseline is the weighted mean sum_i v_i r_i / sum_i v_i
    (VCPO's off-policy baseline; std(r) unchanged).

    std is the *unbiased* sample standard deviation, sqrt(sum((r - mean)^2) / (n - 1)),
    as torch.std computes by default (the same choice as verl and slime). A group of
    one sample has no spread: its std is taken as 0, so its advantage is 0. Neither has a
    group whose rewards are all equal (exactly 0, not float noise / eps).
    """
    centered = _centered(rewards, baseline_weights)
    if not normalize_std:
        return centered
    std = rewards.std() if rewards.numel() > 1 else torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    return centered / (std + eps)


def dr_grpo_advantages(rewards: Tensor, baseline_weights: Tensor | None = None) -> Tensor:
    """Dr. GRPO: A_i = r_i - mean(r) (the weighted mean with baseline_weights, as in
    grpo_advantages). No std scaling; pair it with a loss aggregation that does not divide
    by each sequence's length (`seq_mean_token_sum`)."""
    return _centered(rewards, baseline_weights)


def _centered(rewards: Tensor, weights: Tensor | None = None) -> Tensor:
    """r - mean(r) (or the `weights`-weighted mean), exactly zero when all rewards are equal:
    the mean of equal floats can be off by an ulp, and divided by a tiny std that noise would
    become a large advantage."""
    if rewards.numel() == 0 or bool(rewards.max() == rewards.min()):
        return torch.zeros_like(rewards)
    if weights is None:
        return rewards - rewards.mean()
    return rewards - (weights * rewards).sum() / weights.sum()


def rloo_advantages(rewards: Tensor) -> Tensor:
    """RLOO (leave one out): A_i = r_i - (sum_j r_j - r_i) / (n - 1).
    A group of one sample has no baseline: its advantage is 0."""
    n = rewards.numel()
    if n < 2 or bool(rewards.max() == rewards.min()):  # equal rewards: exactly no advantage
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


def gae_advantages(
    token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation (PPO with a critic), right to left over the
    trained tokens, with V_t the critic's value of the state before token t:

        delta_t = r_t + gamma * V_next - V_t
        A_t     = delta_t + gamma * lam * A_next
        R_t     = A_t + V_t                         (the critic's regression target)

    where V_next and A_next belong to the next *trained* token (0 after the last one). As
    in discounted_returns, a masked-out token (a tool's output) is not an action of the
    policy: its reward and value are ignored, it passes V_next and A_next through
    unchanged, and its advantage and return are 0. Returns (advantages, returns), [B, T],
    unwhitened (PPO usually whitens the advantages: masked_whiten).
    """
    advantages = torch.zeros_like(token_rewards)
    next_value = torch.zeros_like(token_rewards[:, 0])
    next_advantage = torch.zeros_like(token_rewards[:, 0])
    for t in range(token_rewards.shape[1] - 1, -1, -1):
        m = mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        next_advantage = m * advantage + (1 - m) * next_advantage
        next_value = m * values[:, t] + (1 - m) * next_value
        advantages[:, t] = advantage * m
    return advantages, (advantages + values) * mask


def sequence_kl(kl: Tensor, mask: Tensor) -> Tensor:
    """A sample's KL to the reference, [B]: sum_t KL_t over its trained tokens (the KL of
    the whole response under the k1 estimator; the sum of per-token estimates otherwise)."""
    # where, not a product: an unclamped estimate at an untrained position may be inf.
    return torch.where(mask > 0, kl, 0.0).sum(dim=1)


def kl_penalized_rewards(rewards: Tensor, kl: Tensor, mask: Tensor, kl_coef: float) -> Tensor:
    """KL as a reward penalty, one per sample (kl_reward_level 'sequence'), before any
    advantage estimator runs:

        r'_i = r_i - kl_coef * sum_t KL_{i,t} * m_{i,t}
    """
    return rewards - kl_coef * sequence_kl(kl, mask).to(rewards.dtype)


def compute_advantages(
    config: AlgorithmConfig,
    rewards: Tensor,
    group_sizes: Sequence[int],
    mask: Tensor,
    kl: Tensor | None = None,
) -> Tensor:
    """Per-token advantages [B, T] by the registered estimator `config.advantage_estimator`
    (one without a critic: see compute_advantages_and_returns)."""
    return compute_advantages_and_returns(config, rewards, group_sizes, mask, kl)[0]


def compute_advantages_and_returns(
    config: AlgorithmConfig,
    rewards: Tensor,
    group_sizes: Sequence[int],
    mask: Tensor,
    kl: Tensor | None = None,
    values: Tensor | None = None,
    baseline_weights: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Per-token advantages [B, T] by the registered estimator `config.advantage_estimator`,
    for a batch whose samples are laid out group after group (`group_sizes` consecutive
    samples per prompt), and, for an estimator with a critic (needs_critic, given the
    critic's `values` [B, T]), the critic's regression targets (returns); else None.

    `kl` is the per-token KL to the reference model; with kl_coef > 0 it is a reward
    penalty: at kl_reward_level 'sequence' each reward becomes kl_penalized_rewards(...)
    before the estimator runs (which then sees no KL, so nothing is counted twice); at
    'token' it goes to the estimator, and only those with kl_reward_shaping use it.

    `baseline_weights` [B] weigh each group's mean reward in grpo and dr_grpo (the off-policy
    correction's optimal_baseline); the other estimators do not use them."""
    if sum(group_sizes) != rewards.numel():
        raise ValueError(f"group sizes add up to {sum(group_sizes)} but there are {rewards.numel()} rewards")
    if config.kl_coef > 0 and config.kl_reward_level == "sequence":
        if kl is None:
            raise ValueError(
                "kl_coef with kl_reward_level 'sequence' subtracts each sample's KL to the reference from its "
                "reward, but no per-token KL was passed (is the reference model loaded?)"
            )
        rewards, kl = kl_penalized_rewards(rewards, kl, mask, config.kl_coef), None
    estimator = get_advantage_estimator(config.advantage_estimator)
    if estimator.needs_critic and values is None:
        raise ValueError(f"advantage_estimator {estimator.name!r} needs the critic's values, none were passed")
    batch = AdvantageInputs(rewards, group_sizes, mask, kl, values, baseline_weights)
    if estimator.needs_critic:
        advantages, returns = estimator.compute(batch, config)
        return advantages, returns
    return estimator.compute(batch, config), None


@register_advantage_estimator("grpo")
def _grpo(batch: AdvantageInputs, config: AlgorithmConfig) -> Tensor:
    """grpo_advantages per group, broadcast to every trained token."""
    return batch.per_group_weighted(lambda r, w: grpo_advantages(r, config.normalize_advantage_std, baseline_weights=w))


@register_advantage_estimator("dr_grpo")
def _dr_grpo(batch: AdvantageInputs, config: AlgorithmConfig) -> Tensor:
    """dr_grpo_advantages per group, broadcast; by default the loss is not divided by each
    sequence's length, as Dr. GRPO means."""
    return batch.per_group_weighted(dr_grpo_advantages)


@register_advantage_estimator("rloo")
def _rloo(batch: AdvantageInputs, config: AlgorithmConfig) -> Tensor:
    """rloo_advantages per group, broadcast."""
    return batch.per_group(rloo_advantages)


@register_advantage_estimator("reinforce_plus_plus")
def _reinforce_plus_plus(batch: AdvantageInputs, config: AlgorithmConfig) -> Tensor:
    """masked_whiten(discounted_returns(reinforce_plus_plus_token_rewards(r, KL, kl_coef), gamma))"""
    token_rewards = reinforce_plus_plus_token_rewards(batch.rewards, batch.mask, batch.kl, config.kl_coef)
    return masked_whiten(discounted_returns(token_rewards, batch.mask, config.gamma), batch.mask)


@register_advantage_estimator("reinforce_plus_plus_baseline")
def _reinforce_plus_plus_baseline(batch: AdvantageInputs, config: AlgorithmConfig) -> Tensor:
    """masked_whiten((r_i - mean(group)) broadcast to tokens)"""
    return masked_whiten(batch.per_group(dr_grpo_advantages), batch.mask)


@register_advantage_estimator("gae")
def _gae(batch: AdvantageInputs, config: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    """PPO with a critic: token rewards as REINFORCE++'s (the reward on the last trained
    token, each token's reward shaped by -kl_coef * KL_t), then

        A, R = gae_advantages(token_rewards, V, mask, gamma, gae_lambda)
        -> (masked_whiten(A), R)

    the advantages whitened over the batch (PPO's usual normalization), the returns not
    (they are the critic's regression targets, in reward units)."""
    assert batch.values is not None  # compute_advantages_and_returns checks it
    token_rewards = reinforce_plus_plus_token_rewards(batch.rewards, batch.mask, batch.kl, config.kl_coef)
    advantages, returns = gae_advantages(token_rewards, batch.values, batch.mask, config.gamma, config.gae_lambda)
    return masked_whiten(advantages, batch.mask), returns


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


@register_policy_loss("ppo_clip")
def _ppo_clip(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor, config: AlgorithmConfig
) -> tuple[Tensor, Tensor]:
    """policy_loss with the per-token ratio logp - old_logp."""
    log_ratio = log_probs - old_log_probs
    return policy_loss(log_ratio, advantages, config.eps_clip, config.eps_clip_high, config.dual_clip_c)


# GSPO's sequence-level ratio stays near 1, so its paper clips it in a far smaller range.
@register_policy_loss("gspo")
def _gspo(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor, config: AlgorithmConfig
) -> tuple[Tensor, Tensor]:
    """policy_loss with gspo_log_ratio."""
    log_ratio = gspo_log_ratio(log_probs, old_log_probs, mask)
    return policy_loss(log_ratio, advantages, config.eps_clip, config.eps_clip_high, config.dual_clip_c)


def cispo_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    eps_low: float,
    eps_high: float,
) -> tuple[Tensor, Tensor]:
    """CISPO (MiniMax-M1), per token, with ratio r = exp(logp - old_logp):

        L = -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * logp

    The importance weight is clipped and detached (sg: stop-gradient), so the gradient,
    -w * A * grad logp, flows through the log-prob only and no token's gradient is ever
    cut, as PPO's clip cuts it. eps_low >= 1 leaves the weight without a lower bound (the
    paper tunes only eps_high).

    Returns (L, clipped) where clipped is 1.0 where the weight was clipped (its gradient
    is bounded, not cut), for the clip-fraction metric.
    """
    ratio = torch.exp(log_probs - old_log_probs).detach()
    weight = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    return -weight * advantages * log_probs, (weight != ratio).to(log_probs.dtype)


# The paper normalizes by all tokens of the batch, sets no lower bound on the weight
# (1 - 1 = 0) and does not publish its upper one; a weight of at most 1 + 3 = 4 is a cap
# other CISPO implementations use by default.
@register_policy_loss("cispo")
def _cispo(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor, config: AlgorithmConfig
) -> tuple[Tensor, Tensor]:
    """cispo_loss with eps_low = eps_clip and eps_high = eps_clip_high (default eps_clip)."""
    eps_high = config.eps_clip if config.eps_clip_high is None else config.eps_clip_high
    return cispo_loss(log_probs, old_log_probs, advantages, config.eps_clip, eps_high)
