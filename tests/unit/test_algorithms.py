"""Every formula of rlmesh.trainer.algorithms and rlmesh.trainer.loss_terms against
numbers worked out by hand (the arithmetic is in the comments), and the registries that
the run config's estimator and policy-loss names come from."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from rlmesh.common import algorithm as declared
from rlmesh.common.algorithm import AlgorithmConfig
from rlmesh.trainer import algorithms as algo
from rlmesh.trainer import loss_terms as terms


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def close(actual: torch.Tensor, expected, atol: float = 1e-5) -> None:
    torch.testing.assert_close(actual, t(expected), atol=atol, rtol=0)


# ------------------------------------------------------------------ registries and the config


ESTIMATORS = ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae"]
LOSSES = ["ppo_clip", "gspo", "cispo"]


@pytest.fixture
def registries():
    """Declarations and registries a test may add to; their own contents come back afterwards."""
    tables = (declared.ADVANTAGE_ESTIMATORS, declared.POLICY_LOSSES, algo.ADVANTAGE_ESTIMATORS, algo.POLICY_LOSSES)
    saved = [dict(table) for table in tables]
    yield
    for table, content in zip(tables, saved):
        table.clear()
        table.update(content)


def test_the_trainer_implements_exactly_the_declared_algorithms():
    # A name declared in rlmesh.common.algorithm (what a run config accepts) without a function
    # registered in rlmesh.trainer.algorithms, or the other way round, fails here.
    assert list(algo.ADVANTAGE_ESTIMATORS) == list(declared.ADVANTAGE_ESTIMATORS)
    assert list(algo.POLICY_LOSSES) == list(declared.POLICY_LOSSES)


def test_the_registries_list_every_algorithm_with_its_flags():
    assert list(algo.ADVANTAGE_ESTIMATORS) == ESTIMATORS
    assert list(algo.POLICY_LOSSES) == LOSSES
    assert [n for n, e in algo.ADVANTAGE_ESTIMATORS.items() if e.kl_reward_shaping] == ["reinforce_plus_plus", "gae"]
    assert [n for n, e in algo.ADVANTAGE_ESTIMATORS.items() if e.needs_critic] == ["gae"]
    assert [n for n, loss in algo.POLICY_LOSSES.items() if loss.sequence_level] == ["gspo"]
    schema = AlgorithmConfig.model_json_schema()["properties"]
    assert schema["advantage_estimator"]["enum"] == ESTIMATORS
    assert schema["policy_loss"]["enum"] == LOSSES


@pytest.mark.parametrize(("setting", "names"), [("advantage_estimator", ESTIMATORS), ("policy_loss", LOSSES)])
def test_the_config_refuses_an_unknown_name_and_lists_the_registered_ones(setting, names):
    with pytest.raises(ValidationError, match=f"{setting} must be one of {', '.join(names)}; got 'ppo2'"):
        AlgorithmConfig(**{setting: "ppo2"})


def test_the_old_gspo_estimator_is_grpo_with_the_gspo_loss():
    config = AlgorithmConfig(advantage_estimator="gspo")
    assert (config.advantage_estimator, config.policy_loss) == ("grpo", "gspo")
    assert (config.eps_clip, config.eps_clip_high) == (3e-4, 4e-4)  # GSPO's clip range ...
    explicit = AlgorithmConfig(advantage_estimator="gspo", policy_loss="gspo", eps_clip=0.1)
    assert (explicit.eps_clip, explicit.eps_clip_high) == (0.1, 4e-4)  # ... unless set
    assert AlgorithmConfig.model_validate_json(config.model_dump_json()) == config
    assert AlgorithmConfig(policy_loss="gspo") == config
    with pytest.raises(ValidationError, match="means advantage_estimator 'grpo' with policy_loss 'gspo'"):
        AlgorithmConfig(advantage_estimator="gspo", policy_loss="ppo_clip")


def test_an_algorithms_defaults_apply_unless_the_run_sets_them():
    assert AlgorithmConfig(advantage_estimator="dr_grpo").loss_aggregation == "seq_mean_token_sum"
    assert (
        AlgorithmConfig(advantage_estimator="dr_grpo", loss_aggregation="token_mean").loss_aggregation == "token_mean"
    )
    assert AlgorithmConfig().loss_aggregation == "seq_mean_token_mean"
    assert (AlgorithmConfig().eps_clip, AlgorithmConfig().eps_clip_high) == (0.2, None)


def test_kl_as_reward_only_with_an_estimator_that_shapes_rewards_with_it():
    assert AlgorithmConfig(advantage_estimator="reinforce_plus_plus", kl_coef=0.1).kl_coef == 0.1
    with pytest.raises(ValidationError, match="only used by reinforce_plus_plus, gae, not 'rloo'"):
        AlgorithmConfig(advantage_estimator="rloo", kl_coef=0.1)
    with pytest.raises(ValidationError, match="not both"):
        AlgorithmConfig(advantage_estimator="reinforce_plus_plus", kl_coef=0.1, kl_loss_coef=0.1)


def test_kl_as_a_sequence_penalty_works_with_any_estimator():
    for estimator in ESTIMATORS:
        config = AlgorithmConfig(advantage_estimator=estimator, kl_coef=0.1, kl_reward_level="sequence")
        assert config.kl_reward_level == "sequence"
    with pytest.raises(ValidationError, match="set kl_reward_level 'sequence' to subtract"):
        AlgorithmConfig(kl_coef=0.1)
    with pytest.raises(ValidationError, match="not both"):
        AlgorithmConfig(kl_coef=0.1, kl_reward_level="sequence", kl_loss_coef=0.1)


def test_cispo_defaults_to_the_papers_one_sided_clip_and_token_mean():
    config = AlgorithmConfig(policy_loss="cispo")
    assert (config.eps_clip, config.eps_clip_high, config.loss_aggregation) == (1.0, 3.0, "token_mean")
    assert AlgorithmConfig(policy_loss="cispo", eps_clip_high=0.28).eps_clip_high == 0.28
    with pytest.raises(ValidationError, match="cispo has none"):
        AlgorithmConfig(policy_loss="cispo", dual_clip_c=3.0)


def test_tis_cap_is_the_old_name_of_the_token_level_truncation_bound():
    legacy = AlgorithmConfig(tis_cap=2.0)
    assert legacy == AlgorithmConfig(rollout_is_upper=2.0)
    assert (legacy.rollout_is_level, legacy.rollout_is_mode, legacy.rollout_is_lower) == ("token", "truncate", 0)
    assert AlgorithmConfig.model_validate_json(legacy.model_dump_json()) == legacy
    with pytest.raises(ValidationError, match="set only rollout_is_upper"):
        AlgorithmConfig(tis_cap=2.0, rollout_is_upper=3.0)


def test_rollout_is_settings_are_checked():
    config = AlgorithmConfig(
        rollout_is_upper=5.0, rollout_is_lower=0.2, rollout_is_level="sequence", rollout_is_mode="mask"
    )
    assert AlgorithmConfig.model_validate_json(config.model_dump_json()) == config
    with pytest.raises(
        ValidationError, match="rollout_is_level, rollout_is_mode set, but .* off until rollout_is_upper"
    ):
        AlgorithmConfig(rollout_is_level="sequence", rollout_is_mode="mask")
    with pytest.raises(ValidationError, match="greater than or equal to 1"):  # ratio 1 (no mismatch) is in range
        AlgorithmConfig(rollout_is_upper=0.5)
    with pytest.raises(ValidationError, match=r"rollout_is_lower \(1\) must be below rollout_is_upper \(1\)"):
        AlgorithmConfig(rollout_is_upper=1.0, rollout_is_lower=1.0)


def test_a_newly_registered_estimator_and_loss_are_accepted_by_the_config(registries):
    declared.declare_advantage_estimator("max_baseline", defaults={"loss_aggregation": "token_mean"})
    declared.declare_policy_loss("vanilla_pg")

    @algo.register_advantage_estimator("max_baseline")
    def _max_baseline(batch, config):
        return batch.per_group(lambda r: r - r.max())

    @algo.register_policy_loss("vanilla_pg")
    def _vanilla_pg(log_probs, old_log_probs, advantages, mask, config):
        return -advantages * log_probs, torch.zeros_like(log_probs)

    config = AlgorithmConfig(advantage_estimator="max_baseline", policy_loss="vanilla_pg")
    assert config.loss_aggregation == "token_mean"
    assert AlgorithmConfig.model_json_schema()["properties"]["advantage_estimator"]["enum"][-1] == "max_baseline"
    # groups (1, 3) and (2,): r - max = -2, 0 | 0, broadcast under the mask
    close(
        algo.compute_advantages(config, t([1, 3, 2]), [2, 1], t([[1, 1], [1, 0], [1, 1]])), [[-2, -2], [0, 0], [0, 0]]
    )
    loss, _ = algo.get_policy_loss("vanilla_pg").compute(t([-1.0]), t([-1.0]), t([2.0]), t([1.0]), config)
    close(loss, [2.0])


def test_registration_refuses_a_taken_name_an_undeclared_one_and_defaults_for_unknown_fields(registries):
    with pytest.raises(ValueError, match="'grpo' is already registered"):
        algo.register_advantage_estimator("grpo")(lambda batch, config: batch.rewards)
    with pytest.raises(ValueError, match="'grpo' is already declared"):
        declared.declare_advantage_estimator("grpo")
    with pytest.raises(ValueError, match="'clipped' is not declared: add declare_policy_loss"):
        algo.register_policy_loss("clipped")(lambda *args: args)
    with pytest.raises(ValueError, match="fields AlgorithmConfig does not have: \\['clip'\\]"):
        declared.declare_policy_loss("clipped", defaults={"clip": 0.1})


# ------------------------------------------------------------------ advantages


def test_grpo_uses_the_unbiased_std():
    # r = 1, 2, 3, 6: mean 3, deviations -2 -1 0 3, squares sum 14,
    # unbiased std = sqrt(14 / 3) = 2.160247; A = d / (2.160247 + 1e-6)
    close(algo.grpo_advantages(t([1, 2, 3, 6])), [-0.925820, -0.462910, 0.0, 1.388730])


def test_grpo_without_std_and_with_one_sample():
    close(algo.grpo_advantages(t([1, 2, 3, 6]), normalize_std=False), [-2, -1, 0, 3])
    close(algo.grpo_advantages(t([5.0])), [0.0])  # nothing to compare with
    close(algo.grpo_advantages(t([2.0, 2.0, 2.0])), [0, 0, 0])  # std 0: 0 / 1e-6


def test_dr_grpo_is_reward_minus_mean():
    close(algo.dr_grpo_advantages(t([1, 2, 3, 6])), [-2, -1, 0, 3])


def test_rloo_leaves_one_out():
    # sum 12; baselines (12 - r) / 3 = 11/3, 10/3, 3, 2
    close(algo.rloo_advantages(t([1, 2, 3, 6])), [1 - 11 / 3, 2 - 10 / 3, 0.0, 4.0])
    close(algo.rloo_advantages(t([4.0])), [0.0])


def test_masked_whiten_uses_population_variance():
    # masked values 1 2 3: mean 2, var (1 + 0 + 1) / 3 = 2/3, std 0.816497
    close(terms.masked_whiten(t([1, 2, 3, 100]), t([1, 1, 1, 0])), [-1.224745, 0.0, 1.224745, 0.0])


def test_reinforce_plus_plus_token_rewards_put_the_reward_on_the_last_trained_token():
    mask = t([[1, 1, 1], [1, 1, 0]])
    kl = t([[0.1, 0.2, 0.3], [0.5, 0.4, 9.0]])
    # -0.5 * kl, plus the final reward (1, then -1) on the last token with mask 1
    expected = [[-0.05, -0.1, -0.15 + 1], [-0.25, -0.2 - 1, 0.0]]
    close(algo.reinforce_plus_plus_token_rewards(t([1, -1]), mask, kl, kl_coef=0.5), expected)


def test_discounted_returns_skip_masked_tokens():
    # gamma 0.5: row 0: G2 = .85, G1 = -.1 + .5 * .85 = .325, G0 = -.05 + .5 * .325 = .1125
    #            row 1: G2 masked = 0, G1 = -1.2, G0 = -.25 + .5 * -1.2 = -.85
    rewards = t([[-0.05, -0.1, 0.85], [-0.25, -1.2, 0.0]])
    close(algo.discounted_returns(rewards, t([[1, 1, 1], [1, 1, 0]]), 0.5), [[0.1125, 0.325, 0.85], [-0.85, -1.2, 0]])
    # A masked token in the middle (a tool's output) neither earns nor discounts:
    # G2 = 2, G1 passes 2 through (its own 5 is ignored) and reads 0, G0 = 1 + .5 * 2
    close(algo.discounted_returns(t([[1, 5, 2]]), t([[1, 0, 1]]), 0.5), [[2, 0, 2]])


def test_reinforce_plus_plus_advantages_are_whitened_returns():
    config = AlgorithmConfig(advantage_estimator="reinforce_plus_plus", kl_coef=0.5, gamma=0.5)
    mask = t([[1, 1, 1], [1, 1, 0]])
    kl = t([[0.1, 0.2, 0.3], [0.5, 0.4, 9.0]])
    # returns .1125 .325 .85 | -.85 -1.2: mean -.1525, population var .5774, std .759868
    adv = algo.compute_advantages(config, t([1, -1]), [1, 1], mask, kl)
    close(adv, [[0.348745, 0.628398, 1.319307], [-0.917922, -1.378528, 0.0]])


def test_reinforce_plus_plus_baseline_subtracts_the_group_mean_then_whitens():
    config = AlgorithmConfig(advantage_estimator="reinforce_plus_plus_baseline")
    # groups (1, 0) and (3, 3): centred .5 -.5 0 0 on two tokens each;
    # token mean 0, var 4 * .25 / 8 = .125, std .353553 -> +-1.414214
    adv = algo.compute_advantages(config, t([1, 0, 3, 3]), [2, 2], torch.ones(4, 2))
    close(adv, [[1.414214, 1.414214], [-1.414214, -1.414214], [0, 0], [0, 0]])


def test_group_advantages_are_broadcast_per_group_under_the_mask():
    mask = t([[1, 1], [1, 0], [0, 1]])
    # group (1, 0): mean .5, unbiased std sqrt(.5) = .707107 -> +-.707106; group (7,): 0
    grpo = algo.compute_advantages(AlgorithmConfig(), t([1, 0, 7]), [2, 1], mask)
    close(grpo, [[0.707106, 0.707106], [-0.707106, 0], [0, 0]])
    rloo = algo.compute_advantages(AlgorithmConfig(advantage_estimator="rloo"), t([1, 0, 7]), [2, 1], mask)
    close(rloo, [[1, 1], [-1, 0], [0, 0]])
    with pytest.raises(ValueError, match="group sizes"):
        algo.compute_advantages(AlgorithmConfig(), t([1, 0, 7]), [2, 2], mask)


def test_kl_sequence_penalty_is_subtracted_from_rewards_before_any_estimator():
    mask = t([[1, 1, 0], [1, 1, 1], [1, 1, 0], [1, 1, 1]])
    # The untrained position's KL does not count, even an inf one (an unclamped estimate).
    kl = t([[0.1, 0.2, math.inf], [0.3, 0.0, 0.0], [0.5, 0.5, 0.0], [0.0, 0.0, 0.0]])
    close(algo.sequence_kl(kl, mask), [0.3, 0.3, 1.0, 0.0])
    # rewards 1 0 | 1 1 minus .5 * sequence KL: .85 -.15 | .5 1
    close(algo.kl_penalized_rewards(t([1, 0, 1, 1]), kl, mask, 0.5), [0.85, -0.15, 0.5, 1.0])
    # dr_grpo on those: group means .35 and .75 -> .5 -.5 | -.25 .25; the equal rewards of
    # the second group now differ by their KL
    config = AlgorithmConfig(advantage_estimator="dr_grpo", kl_coef=0.5, kl_reward_level="sequence")
    adv = algo.compute_advantages(config, t([1, 0, 1, 1]), [2, 2], mask, kl)
    close(adv, [[0.5, 0.5, 0], [-0.5, -0.5, -0.5], [-0.25, -0.25, 0], [0.25, 0.25, 0.25]])
    with pytest.raises(ValueError, match="no per-token KL was passed"):
        algo.compute_advantages(config, t([1, 0, 1, 1]), [2, 2], mask)


def test_kl_sequence_penalty_is_not_also_added_per_token():
    # REINFORCE++ at level 'sequence' is REINFORCE++ without KL on the penalized rewards.
    mask = t([[1, 1, 1], [1, 1, 0]])
    kl = t([[0.1, 0.2, 0.3], [0.5, 0.4, 9.0]])
    config = AlgorithmConfig(
        advantage_estimator="reinforce_plus_plus", kl_coef=0.5, gamma=0.5, kl_reward_level="sequence"
    )
    penalized = t([1 - 0.5 * 0.6, -1 - 0.5 * 0.9])
    without_kl = AlgorithmConfig(advantage_estimator="reinforce_plus_plus", gamma=0.5)
    close(
        algo.compute_advantages(config, t([1, -1]), [1, 1], mask, kl),
        algo.compute_advantages(without_kl, penalized, [1, 1], mask).tolist(),
    )


def test_gae_skips_masked_tokens():
    # gamma .9, lam .5 (g * l = .45); row 0, right to left:
    #   t2: delta = 1 - .8 = .2,               A = .2,                  R = 1.0
    #   t1: delta = .9 * .8 - .4 = .32,        A = .32 + .45 * .2 = .41, R = .81
    #   t0: delta = .9 * .4 - .5 = -.14,       A = -.14 + .45 * .41 = .0445, R = .5445
    # row 1: the middle token (reward 5, value 9) is a tool's output, passed through:
    #   t2: delta = 2 - .6 = 1.4,              A = 1.4,                 R = 2.0
    #   t0: delta = .9 * .6 - .2 = .34,        A = .34 + .45 * 1.4 = .97, R = 1.17
    rewards = t([[0, 0, 1], [0, 5, 2]])
    values = t([[0.5, 0.4, 0.8], [0.2, 9.0, 0.6]])
    advantages, returns = algo.gae_advantages(rewards, values, t([[1, 1, 1], [1, 0, 1]]), gamma=0.9, lam=0.5)
    close(advantages, [[0.0445, 0.41, 0.2], [0.97, 0.0, 1.4]])
    close(returns, [[0.5445, 0.81, 1.0], [1.17, 0.0, 2.0]])


def test_gae_with_no_critic_and_lambda_one_is_the_discounted_return():
    rewards, mask = t([[-0.05, -0.1, 0.85], [-0.25, 3.0, -1.2]]), t([[1, 1, 1], [1, 0, 1]])
    advantages, returns = algo.gae_advantages(rewards, torch.zeros(2, 3), mask, gamma=0.5, lam=1.0)
    expected = algo.discounted_returns(rewards, mask, 0.5).tolist()
    close(advantages, expected)
    close(returns, expected)


# Two samples of one prompt, rewards 1 and 0; sample 1 trains only its first token.
GAE_MASK = t([[1, 1], [1, 0]])
GAE_VALUES = t([[0.5, 0.8], [0.2, 0.0]])


def test_the_gae_estimator_whitens_gae_advantages_and_returns_the_critic_targets():
    # gamma 1, lambda 1 (defaults); the reward sits on the last trained token:
    #   row 0: t1: delta = 1 - .8 = .2, A = .2, R = 1;  t0: delta = .8 - .5 = .3, A = .3 + .2 = .5, R = 1
    #   row 1: t0: delta = 0 - .2 = -.2, A = -.2, R = 0
    # whitened over [.5, .2, -.2]: mean 1/6, population var .246667 / 3 = .082222, std .286744
    #   -> (.333333, .033333, -.366667) / .286744 = 1.162476, .116248, -1.278724
    config = AlgorithmConfig(advantage_estimator="gae")
    advantages, returns = algo.compute_advantages_and_returns(config, t([1.0, 0.0]), [2], GAE_MASK, values=GAE_VALUES)
    close(advantages, [[1.162476, 0.116248], [-1.278724, 0.0]], atol=1e-4)
    close(returns, [[1.0, 1.0], [0.0, 0.0]])


def test_the_gae_estimator_shapes_token_rewards_with_the_kl():
    # kl_coef .1, KL [[1, 2], [3, -]]: token rewards row 0 [-.1, -.2 + 1 = .8], row 1 [-.3]
    #   row 0: t1: A = .8 - .8 = 0, R = .8;  t0: A = -.1 + .8 - .5 + 0 = .2, R = .7
    #   row 1: t0: A = -.3 - .2 = -.5, R = -.3
    config = AlgorithmConfig(advantage_estimator="gae", kl_coef=0.1)
    kl = t([[1.0, 2.0], [3.0, 7.0]])
    _, returns = algo.compute_advantages_and_returns(config, t([1.0, 0.0]), [2], GAE_MASK, kl, GAE_VALUES)
    close(returns, [[0.7, 0.8], [-0.3, 0.0]])


def test_critic_settings_only_with_a_critic():
    assert AlgorithmConfig(advantage_estimator="gae", gae_lambda=0.9, value_clip=None).value_clip is None
    with pytest.raises(ValidationError, match="gae_lambda, value_clip set, but only an estimator with a critic"):
        AlgorithmConfig(advantage_estimator="grpo", gae_lambda=0.9, value_clip=None)
    # A dumped config (every field, at its default) validates again.
    AlgorithmConfig.model_validate(AlgorithmConfig().model_dump())


def test_the_gae_estimator_needs_the_critics_values():
    with pytest.raises(ValueError, match="needs the critic's values"):
        algo.compute_advantages(AlgorithmConfig(advantage_estimator="gae"), t([1.0, 0.0]), [2], GAE_MASK)


def test_explained_variance():
    # R = 1, 2, 3 (population var 2/3); a fourth, untrained token holds junk
    returns, mask = t([[1.0, 2.0, 3.0, 50.0]]), t([[1, 1, 1, 0]])
    close(terms.explained_variance(t([[1.0, 2.0, 3.0, 0.0]]), returns, mask), 1.0)  # exact values
    close(terms.explained_variance(t([[0.0, 0.0, 0.0, 0.0]]), returns, mask), 0.0)  # residual = R
    # residual -.5, 0, .5: var 1/6 -> 1 - (1/6) / (2/3) = .75
    close(terms.explained_variance(t([[1.5, 2.0, 2.5, 0.0]]), returns, mask), 0.75)
    close(terms.explained_variance(t([[1.0, 9.0]]), t([[2.0, 2.0]]), t([[1, 1]])), 0.0)  # nothing to explain


def test_clipped_value_loss():
    # clip .2:
    #   V 1,  old .5, R 2: (1 - 2)^2 = 1;  V_clip = .5 + .2 = .7, (.7 - 2)^2 = 1.69 -> .5 * 1.69 = .845
    #   V 2,  old 2.5, R 2: 0;             V_clip = 2.3, .09                     -> .045
    #   V -1, old 0,  R 1: (-2)^2 = 4;     V_clip = -.2, 1.44                    -> 2.0 (unclipped)
    #   the fourth token is not trained
    values, old = t([[1.0, 2.0, -1.0, 7.0]]), t([[0.5, 2.5, 0.0, 0.0]])
    returns, mask = t([[2.0, 2.0, 1.0, 0.0]]), t([[1, 1, 1, 0]])
    close(terms.clipped_value_loss(values, old, returns, mask, clip=0.2), 2.89 / 3)
    close(terms.clipped_value_loss(values, old, returns, mask, clip=0.2, num_tokens=5), 2.89 / 5)
    close(terms.clipped_value_loss(values, old, returns, mask, clip=None), 0.5 * (1 + 0 + 4) / 3)


# ------------------------------------------------------------------ policy loss


def test_policy_loss_clips_low_and_high():
    ratios = t([0.5, 1.5, 0.5, 1.5, 1.1])
    adv = t([1, 1, -1, -1, 2])
    loss, clipped = algo.policy_loss(torch.log(ratios), adv, eps_clip=0.2, eps_clip_high=0.28)
    # A=+1, r=.5:  max(-.5, -.8)  = -.5   (not clipped)
    # A=+1, r=1.5: max(-1.5, -1.28) = -1.28 (clipped at 1 + .28)
    # A=-1, r=.5:  max(.5, .8)   = .8    (clipped at 1 - .2)
    # A=-1, r=1.5: max(1.5, 1.28) = 1.5   (not clipped)
    # A=2,  r=1.1: -2.2 both ways
    close(loss, [-0.5, -1.28, 0.8, 1.5, -2.2])
    close(clipped, [0, 1, 1, 0, 0])


def test_policy_loss_symmetric_clip_by_default():
    loss, _ = algo.policy_loss(torch.log(t([1.5])), t([1.0]), eps_clip=0.2)
    close(loss, [-1.2])


def test_dual_clip_caps_negative_advantages():
    ratios = t([5.0, 2.0, 5.0])
    adv = t([-1, -1, 1])
    loss, _ = algo.policy_loss(torch.log(ratios), adv, eps_clip=0.2, dual_clip_c=3.0)
    # A=-1, r=5: max(5, 1.2) = 5, capped at 3 * 1 = 3;  A=-1, r=2: 2 < 3 stays;
    # A=+1, r=5: max(-5, -1.2) = -1.2 (dual clip only touches A < 0)
    close(loss, [3.0, 2.0, -1.2])


def test_registered_losses_differ_in_the_ratio_only():
    log_probs, old, mask = t([[-1.0, -2.0, -3.0]]), t([[-1.5, -2.0, -2.5]]), t([[1, 1, 0]])
    adv = t([[1, 1, 0]])
    config = AlgorithmConfig(eps_clip=0.2)
    # ppo_clip: ratios e^.5 = 1.6487 (clipped to 1.2), e^0 = 1; the untrained token has A = 0
    loss, clipped = algo.get_policy_loss("ppo_clip").compute(log_probs, old, adv, mask, config)
    close(loss, [[-1.2, -1.0, 0.0]])
    close(clipped, [[1, 0, 0]])
    # gspo: one ratio e^((.5 + 0) / 2) = 1.2840 on every token, clipped to 1.2 where A = 1
    config = AlgorithmConfig(policy_loss="gspo", eps_clip=0.2, eps_clip_high=0.2)
    loss, clipped = algo.get_policy_loss("gspo").compute(log_probs, old, adv, mask, config)
    close(loss, [[-1.2, -1.2, 0.0]])
    close(clipped, [[1, 1, 0]])


def test_gspo_ratio_is_the_sequence_mean_with_per_token_gradient():
    log_probs = t([[-1.0, -2.0, -3.0]]).requires_grad_()
    old = t([[-1.5, -2.0, -2.5]])
    # trained diffs .5 and 0 (the third token is masked): mean .25 on every token
    log_ratio = algo.gspo_log_ratio(log_probs, old, t([[1, 1, 0]]))
    close(log_ratio.detach(), [[0.25, 0.25, 0.25]])
    log_ratio[0, 0].backward()
    close(log_probs.grad, [[1.0, 0.0, 0.0]])


def test_cispo_clips_and_detaches_the_weight():
    # ratios e^.5 = 1.6487 -> 1.28, e^0 = 1, e^-2 = .1353 -> .8 (eps .2 low, .28 high)
    log_probs = t([[-1.0, -2.0, -3.0]]).requires_grad_()
    old, adv = t([[-1.5, -2.0, -1.0]]), t([[1.0, -1.0, 2.0]])
    loss, clipped = algo.cispo_loss(log_probs, old, adv, eps_low=0.2, eps_high=0.28)
    # -w * A * logp: -1.28 * 1 * -1 = 1.28;  -1 * -1 * -2 = -2;  -.8 * 2 * -3 = 4.8
    close(loss.detach(), [[1.28, -2.0, 4.8]])
    close(clipped, [[1, 0, 1]])
    # The gradient goes through logp only: -w * A, even where the weight was clipped.
    loss.sum().backward()
    close(log_probs.grad, [[-1.28, 1.0, -1.6]])


def test_cispo_keeps_the_gradient_ppo_clip_cuts():
    # ratio 1.5 and A = 1 with eps .2: PPO's clipped term wins (no gradient); CISPO pushes with w = 1.2
    config = AlgorithmConfig(policy_loss="cispo", eps_clip=0.2, eps_clip_high=0.2)
    grads = {}
    for name in ("ppo_clip", "cispo"):
        log_probs = torch.log(t([[1.5]])).requires_grad_()
        loss, _ = algo.get_policy_loss(name).compute(log_probs, t([[0.0]]), t([[1.0]]), t([[1.0]]), config)
        loss.sum().backward()
        grads[name] = float(log_probs.grad)
    assert grads == {"ppo_clip": 0.0, "cispo": pytest.approx(-1.2)}


def test_registered_cispo_has_no_lower_bound_by_default():
    config = AlgorithmConfig(policy_loss="cispo")
    # ratios 5 (capped at 1 + 3 = 4) and e^-3 = .0498 (no lower bound); A = 1
    log_probs, old = t([[-1.0, -4.0]]), t([[-1.0 - math.log(5), -1.0]])
    loss, clipped = algo.get_policy_loss("cispo").compute(log_probs, old, t([[1.0, 1.0]]), t([[1, 1]]), config)
    close(loss, [[4.0, math.exp(-3) * 4]])  # -4 * 1 * -1 = 4;  -.0498 * 1 * -4 = .1991
    close(clipped, [[1, 0]])


# ------------------------------------------------------------------ aggregation


VALUES = t([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
MASK = t([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # the third sequence trains nothing


def test_token_mean():
    close(terms.aggregate_loss(VALUES, MASK, "token_mean"), 7 / 3)  # (1 + 2 + 4) / 3


def test_seq_mean_token_mean():
    close(terms.aggregate_loss(VALUES, MASK, "seq_mean_token_mean"), 2.75)  # (1.5 + 4) / 2


def test_seq_mean_token_sum():
    close(terms.aggregate_loss(VALUES, MASK, "seq_mean_token_sum"), 3.5)  # (3 + 4) / 2


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_micro_batches_with_global_counts_add_up_to_the_batch(mode):
    whole = terms.aggregate_loss(VALUES, MASK, mode)
    parts = sum(
        terms.aggregate_loss(VALUES[rows], MASK[rows], mode, num_sequences=2, num_tokens=3)
        for rows in (slice(0, 1), slice(1, 3))
    )
    close(parts, float(whole))


def test_unknown_aggregation_is_refused():
    with pytest.raises(ValueError, match="aggregation"):
        terms.aggregate_loss(VALUES, MASK, "seq_sum")


# ------------------------------------------------------------------ KL, entropy, TIS, metrics, SFT


def test_kl_estimators():
    logp, ref = t([-1.0]), t([-1.5])  # x = .5
    close(terms.kl_penalty(logp, ref, "k1"), [0.5])
    close(terms.kl_penalty(logp, ref, "k2"), [0.125])  # .5^2 / 2
    close(terms.kl_penalty(logp, ref, "k3"), [math.exp(-0.5) - 0.5])  # .106531
    close(terms.kl_penalty(logp, ref, "low_var_kl"), [0.106531])


def test_low_var_kl_is_clamped():
    # x = -20: k3 = e^20 - 21 = 4.85e8 -> 10;  x = 20: k3 = e^-20 + 19 -> 10
    close(terms.kl_penalty(t([-21.0, -1.0]), t([-1.0, -21.0]), "low_var_kl"), [10.0, 10.0])
    close(terms.kl_penalty(t([-1.0]), t([-21.0]), "k3"), [19.0], atol=1e-4)


def test_entropy_from_logits():
    # uniform over 2: ln 2; probs (.25, .75): -( .25 ln .25 + .75 ln .75 ) = .562335
    close(terms.entropy_from_logits(t([[0.0, 0.0], [0.0, math.log(3)]])), [0.693147, 0.562335])


# old - rollout: row 0: 0, 1, -.5 (ratios 1, e = 2.7183, .6065); row 1: .5, .5 (1.6487) and
# an untrained token. Sequence ratios: e^.5 = 1.6487 and e^1 = 2.7183 (the untrained 8 left out).
IS_OLD = t([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
IS_ROLLOUT = t([[-1.0, -2.0, -0.5], [-1.5, -1.5, -9.0]])
IS_MASK = t([[1, 1, 1], [1, 1, 0]])


@pytest.mark.parametrize(
    ("level", "mode", "lower", "expected"),
    [
        ("token", "truncate", 0.7, [[1.0, 2.0, 0.7], [1.648721, 1.648721, 0]]),
        ("token", "mask", 0.7, [[1.0, 0, 0], [1.648721, 1.648721, 0]]),  # e and .6065 dropped
        ("sequence", "truncate", 0.0, [[1.648721] * 3, [2.0, 2.0, 0]]),
        ("sequence", "mask", 0.5, [[1.648721] * 3, [0, 0, 0]]),  # e > 2: the whole sequence dropped
    ],
)
def test_rollout_is_weights(level, mode, lower, expected):
    old = IS_OLD.clone().requires_grad_()
    w = terms.rollout_is_weights(old, IS_ROLLOUT, IS_MASK, level=level, mode=mode, lower=lower, upper=2.0)
    close(w, expected)
    assert not w.requires_grad


def test_rollout_is_weights_of_far_off_sequences_stay_finite():
    # sum of log ratios +-1000: e^1000 overflows, the bounds are applied in log space
    far = {"old": t([[0.0, 0.0], [-500.0, -500.0]]), "rollout": t([[-500.0, -500.0], [0.0, 0.0]])}
    for mode, expected in (("truncate", [[2.0, 2.0], [0.5, 0.5]]), ("mask", [[0, 0], [0, 0]])):
        w = terms.rollout_is_weights(
            far["old"], far["rollout"], torch.ones(2, 2), level="sequence", mode=mode, lower=0.5, upper=2.0
        )
        close(w, expected)


def test_token_truncation_without_a_lower_bound_is_tis():
    w = terms.rollout_is_weights(IS_OLD, IS_ROLLOUT, IS_MASK, level="token", mode="truncate", lower=0.0, upper=2.0)
    # TIS: clamp(exp(old - rollout), 0, cap) on trained tokens
    close(w, (torch.clamp(torch.exp(IS_OLD - IS_ROLLOUT), 0.0, 2.0) * IS_MASK).tolist())


def test_approx_kl_metric():
    # old - logp = -.5 and .5; only the first is trained
    close(terms.approx_kl(t([-1.0, -2.0]), t([-1.5, -1.5]), t([1, 0])), -0.5)
    close(terms.approx_kl(t([-1.0, -2.0]), t([-1.5, -1.5]), t([1, 1])), 0.0)


def test_sft_nll_is_the_mean_over_trained_tokens():
    close(terms.nll_loss(t([[-0.5, -1.5, -9.0]]), t([[1, 1, 0]])), 1.0)  # (.5 + 1.5) / 2
    close(terms.nll_loss(t([[-0.5, -1.5, -9.0]]), t([[1, 1, 0]]), num_tokens=4), 0.5)


@pytest.mark.parametrize("value", [0.1, 0.3, 0.7, 1 / 3, 1.0])
def test_a_group_of_equal_rewards_has_exactly_zero_advantage(value):
    # The float mean of equal rewards can be off by an ulp; over GRPO's eps that noise
    # would be a real push. No spread, no signal.
    rewards = torch.full((8,), value)
    for advantages in (
        algo.grpo_advantages(rewards),
        algo.grpo_advantages(rewards, normalize_std=False),
        algo.dr_grpo_advantages(rewards),
        algo.rloo_advantages(rewards),
    ):
        assert torch.equal(advantages, torch.zeros(8))


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_equal_reward_groups_beside_others_have_exactly_zero_advantage(estimator):
    # Awkward values: no binary fraction is exact, one is large enough that an ulp is 8,
    # and a group with spread sits between them (its advantages are not zero).
    rewards = t([0.1] * 7 + [0.3, 0.7, 1 / 3] + [-2.7] * 3 + [1e8 + 0.3] * 5)
    sizes = [7, 3, 3, 5]
    mask = torch.ones(len(rewards), 4)
    advantages = algo.compute_advantages(AlgorithmConfig(advantage_estimator=estimator), rewards, sizes, mask)
    equal_rows = list(range(7)) + list(range(10, 18))
    assert torch.equal(advantages[equal_rows], torch.zeros(len(equal_rows), 4))
    assert (advantages[7:10] != 0).all()
