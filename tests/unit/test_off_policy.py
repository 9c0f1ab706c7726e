"""The corrections for samples of older weights, each against numbers worked out by hand on
a tiny batch, and the run config's choice of correction per mode."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from rlmesh.common.algorithm import AlgorithmConfig
from rlmesh.common.off_policy import ASYNC_DEFAULT, OffPolicyCorrection, resolve
from rlmesh.common.run_config import RunConfig
from rlmesh.trainer import algorithms as algo
from rlmesh.trainer import off_policy as op

ALL = torch.ones(2, 2)


def log(*ratios: float) -> list[float]:
    return [math.log(r) for r in ratios]


def weights(method: str, ratios: list[list[float]], advantages=None, mask=ALL, **settings) -> tuple[list, list]:
    log_rho = torch.tensor([log(*row) for row in ratios])
    adv = torch.ones(2, 2) if advantages is None else torch.tensor(advantages)
    w, cut = op.correction_weights(OffPolicyCorrection(method=method, **settings), log_rho, mask, adv)
    return w.tolist(), cut.int().tolist()


def approx(rows):
    return [pytest.approx(row, abs=1e-6) for row in rows]


def test_token_tis_truncates_at_upper():
    # rho = [[0.5, 3], [1.5, 1]]; w = min(rho, 2)
    w, cut = weights("tis", [[0.5, 3.0], [1.5, 1.0]])
    assert w == approx([[0.5, 2.0], [1.5, 1.0]]) and cut == [[0, 1], [0, 0]]


def test_token_tis_lower_bound():
    w, _ = weights("tis", [[0.5, 3.0], [1.5, 1.0]], lower=0.8)
    assert w == approx([[0.8, 2.0], [1.5, 1.0]])


def test_token_mis_masks_above_upper():
    w, cut = weights("mis", [[0.5, 3.0], [1.5, 1.0]])
    assert w == approx([[0.5, 0.0], [1.5, 1.0]]) and cut == [[0, 1], [0, 0]]


def test_sequence_mis_masks_whole_sequences_by_the_product():
    # products: 0.5 * 3 = 1.5 (kept, every token weighs 1.5), 1.5 * 2 = 3 (masked)
    w, cut = weights("mis", [[0.5, 3.0], [1.5, 2.0]], level="sequence")
    assert w == approx([[1.5, 1.5], [0.0, 0.0]]) and cut == [[0, 0], [1, 1]]


def test_sequence_tis_truncates_the_product():
    w, _ = weights("tis", [[0.5, 3.0], [1.5, 2.0]], level="sequence")
    assert w == approx([[1.5, 1.5], [2.0, 2.0]])


def test_decoupled_masks_behaviour_weights_above_its_cap():
    # AReaL's cap 5: rho 3 keeps its weight, rho 6 is masked
    w, cut = weights("decoupled", [[0.5, 3.0], [6.0, 1.0]])
    assert w == approx([[0.5, 3.0], [0.0, 1.0]]) and cut == [[0, 0], [1, 0]]


def test_icepop_masks_outside_the_band():
    w, cut = weights("icepop", [[0.4, 3.0], [1.5, 1.0]])  # band [0.5, 2]
    assert w == approx([[0.0, 0.0], [1.5, 1.0]]) and cut == [[1, 1], [0, 0]]


def test_m2po_masks_the_largest_squared_log_ratios_until_the_second_moment_is_bounded():
    # (log rho)^2 = [0.01, 0.25, 0.09, 0]: mean 0.0875 > 0.04; without 0.25 the mean is
    # 0.1 / 3 = 0.033 <= 0.04, so only that token is masked.
    log_rho = torch.tensor([[0.1, -0.5], [0.3, 0.0]])
    keep = op.m2po_mask(log_rho, ALL, 0.04)
    assert keep.tolist() == [[1.0, 0.0], [1.0, 1.0]]
    # a tighter bound: 0.09 goes too (0.01 / 2 = 0.005)
    assert op.m2po_mask(log_rho, ALL, 0.02).tolist() == [[1.0, 0.0], [0.0, 1.0]]
    # a batch within the bound keeps everything; masked-out positions stay 0
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    assert op.m2po_mask(log_rho, mask, 0.04).tolist() == [[1.0, 0.0], [1.0, 1.0]]


def test_asymmetric_caps_negative_advantages_tighter():
    # rho = [[0.5, 3], [1.5, 1.5]], A = [[1, 1], [-1, 1]]: A >= 0 min(rho, 2); A < 0 min(rho, 1)
    w, cut = weights("asymmetric", [[0.5, 3.0], [1.5, 1.5]], advantages=[[1.0, 1.0], [-1.0, 1.0]])
    assert w == approx([[0.5, 2.0], [1.0, 1.5]]) and cut == [[0, 1], [1, 0]]


def test_sequence_ess():
    # sequence ratios 1 and 3: (1 + 3)^2 / (2 * (1 + 9)) = 0.8
    log_rho = torch.tensor([log(0.5, 2.0), log(3.0, 1.0)])
    assert op.sequence_ess(log_rho, ALL) == pytest.approx(0.8)
    assert op.sequence_ess(torch.zeros(2, 2), ALL) == pytest.approx(1.0)
    # far-off sequences do not overflow: ratio e^200 against 1 is one effective sample of two
    assert op.sequence_ess(torch.tensor([[100.0, 100.0], [0.0, 0.0]]), ALL) == pytest.approx(0.5)


def test_correct_reports_the_weights_and_scales_the_step_by_sqrt_ess():
    old = torch.tensor([log(0.5, 2.0), log(3.0, 1.0)])
    behaviour = torch.zeros(2, 2)
    present = torch.tensor([[1.0, 1.0], [1.0, 0.0]])  # the last token has no engine log-prob
    config = OffPolicyCorrection(method="tis", ess_step_scaling=True)
    c = op.correct(config, old, behaviour, ALL, present, torch.ones(2, 2))
    assert c.weights.tolist() == approx([[0.5, 2.0], [2.0, 1.0]])
    assert c.lr_scale == pytest.approx(math.sqrt(0.8))
    m = c.metrics
    assert m["is_weight_mean"] == pytest.approx((0.5 + 2.0 + 2.0) / 3)
    assert m["is_weight_max"] == pytest.approx(2.0)
    assert m["is_truncated_masked_fraction"] == pytest.approx(1 / 3)
    assert m["is_ess"] == pytest.approx(0.8)


def test_no_correction_measures_the_raw_ratios_and_weights_nothing():
    old = torch.tensor([log(0.5, 2.0), log(3.0, 1.0)])
    c = op.correct(None, old, torch.zeros(2, 2), ALL, ALL, torch.ones(2, 2))
    assert c.weights is None and c.lr_scale == 1.0
    assert c.metrics["is_weight_max"] == pytest.approx(3.0)
    assert c.metrics["is_truncated_masked_fraction"] == 0.0
    # no engine log-probs at all: nothing measured
    assert op.correct(ASYNC_DEFAULT, old, torch.zeros(2, 2), ALL, torch.zeros(2, 2), ALL).metrics == {}


def test_the_optimal_baseline_weighs_each_groups_rewards_by_the_squared_sequence_ratio():
    # group 1: sequence ratios 1, 2, 1 (w^2 = 1, 4, 1 -> 0.25, 1, 0.25 scaled to its largest);
    # group 2: rewards all equal (no advantage, whatever the weights)
    old = torch.tensor([[0.0, 0.0], [math.log(2.0), 0.0], [0.0, 0.0], [1.0, 0.0], [0.0, 0.0]])
    behaviour, scored = torch.zeros(5, 2), torch.ones(5, 2)
    chosen = OffPolicyCorrection(optimal_baseline=True)
    weights = op.baseline_weights(chosen, old, behaviour, scored, [3, 2])
    assert weights.tolist() == pytest.approx([0.25, 1.0, 0.25, 1.0, math.exp(-2.0)])
    assert op.baseline_weights(ASYNC_DEFAULT, old, behaviour, scored, [3, 2]) is None  # (not asked for)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0])
    mask = torch.ones(5, 1)
    grpo = AlgorithmConfig(advantage_estimator="grpo")
    advantages = algo.compute_advantages(grpo, rewards, [3, 2], mask, None).squeeze(1)
    # b = (0.25 * 1) / 1.5 = 1/6 (the plain mean would be 1/3); std of (1, 0, 0) = sqrt(1/3)
    std = math.sqrt(1 / 3)
    weighted = algo.compute_advantages_and_returns(grpo, rewards, [3, 2], mask, baseline_weights=weights)[0]
    assert weighted.squeeze(1).tolist() == pytest.approx(
        [(1 - 1 / 6) / std, -1 / 6 / std, -1 / 6 / std, 0.0, 0.0], abs=1e-5
    )
    assert advantages.tolist() == pytest.approx([(2 / 3) / std, -1 / 3 / std, -1 / 3 / std, 0.0, 0.0], abs=1e-5)
    # Dr. GRPO: the same baseline, no std
    dr = algo.compute_advantages_and_returns(
        AlgorithmConfig(advantage_estimator="dr_grpo"), rewards, [3, 2], mask, baseline_weights=weights
    )[0]
    assert dr.squeeze(1).tolist() == pytest.approx([5 / 6, -1 / 6, -1 / 6, 0.0, 0.0], abs=1e-6)


def test_the_optimal_baseline_is_only_for_group_mean_estimators():
    with pytest.raises(ValidationError, match="optimal_baseline"):
        run("fully_async", off_policy={"optimal_baseline": True}, algorithm={"advantage_estimator": "rloo"})
    assert run("fully_async", off_policy={"optimal_baseline": True}).trainer_config().off_policy.optimal_baseline


# ---- the run config


def run(mode: str, **fields) -> RunConfig:
    return RunConfig.model_validate(
        {"model_path": "m", "datasets": [{"name": "train", "path": "t.jsonl"}], "mode": mode, **fields}
    )


def test_async_modes_get_a_correction_by_default_and_sync_none():
    assert run("sync").trainer_config().off_policy is None
    assert run("one_step_off").trainer_config().off_policy == ASYNC_DEFAULT
    assert run("fully_async").trainer_config().off_policy == ASYNC_DEFAULT
    # the run's own choice wins, in any mode
    chosen = {"method": "m2po", "m2_threshold": 0.1}
    assert run("sync", off_policy=chosen).trainer_config().off_policy.method == "m2po"
    assert run("fully_async", off_policy={"method": "none"}).trainer_config().off_policy.method == "none"
    # the older rollout_is_* correction replaces the default
    assert run("fully_async", algorithm={"rollout_is_upper": 2.0}).trainer_config().off_policy is None
    assert resolve(None, "one_step_off", rollout_is_set=False) == ASYNC_DEFAULT


@pytest.mark.parametrize(
    "off_policy, message",
    [
        ({"method": "m2po", "upper": 3.0}, "lower and upper"),
        ({"method": "icepop", "level": "sequence"}, "level 'sequence'"),
        ({"method": "icepop", "lower": 3.0}, "must be below upper"),
        ({"method": "tis", "upper": 0.5}, "greater than 1"),
        ({"method": "clip"}, "method"),
    ],
)
def test_bad_corrections_are_refused(off_policy, message):
    with pytest.raises(ValidationError, match=message):
        run("fully_async", off_policy=off_policy)


def test_one_ratio_correction_at_a_time():
    with pytest.raises(ValidationError, match="set one"):
        run("fully_async", off_policy={"method": "tis"}, algorithm={"rollout_is_upper": 2.0})


# ---- the run's warnings


def test_a_warning_needs_two_iterations_past_the_threshold_and_is_raised_once():
    from rlmesh.coordinator.off_policy_watch import new_warnings

    sft = {"sft_step": 3, "sft/loss": 1.0}
    low = [{"rollout_id": i, "train/is_ess": 0.3, "train/train_rollout_logprob_abs_diff": 0.05} for i in (1, 2)]
    assert new_warnings([sft, low[0]], []) == []  # one iteration is not a trend
    assert new_warnings([low[0], {**low[1], "train/is_ess": 0.6}], []) == []
    warned = new_warnings(low, [])
    assert len(warned) == 1 and warned[0].startswith("train/is_ess < 0.5 for 2 iterations (last 0.3, at rollout 2)")
    assert new_warnings(low, warned) == []  # raised once per run
    gap = [{"rollout_id": i, "train/train_rollout_logprob_abs_diff": 0.4} for i in (5, 6)]
    assert new_warnings(gap, warned)[0].startswith("train/train_rollout_logprob_abs_diff > 0.2")
    assert new_warnings([*gap[:1], {"rollout_id": 7}], []) == []  # the last two iterations, not any two


def test_batches_that_teach_nothing_after_a_fall_are_warned_of():
    from rlmesh.coordinator.off_policy_watch import new_warnings

    def it(i, reward, advantage):
        return {"rollout_id": i, "train/reward_mean": reward, "train/advantage_abs_mean": advantage}

    # (a collapsed fully_async run of the demo's task: every group scored 0 from rollout 35 on)
    falling = [it(30, 0.8, 0.5), it(34, 0.28, 0.2), it(35, 0.0, 0.0), it(36, 0.0, 0.0)]
    (warned,) = new_warnings(falling, [])
    assert warned.startswith(
        "train/advantage_abs_mean = 0 for 2 iterations (at rollout 36, train reward 0, its best 0.8)"
    )
    assert new_warnings(falling, [warned]) == []  # raised once per run
    assert new_warnings(falling[:3], []) == []  # one iteration is not a trend
    learned = [it(29, 0.3, 0.5), it(30, 1.0, 0.0), it(31, 0.94, 0.0), it(32, 0.94, 0.0)]
    assert new_warnings(learned, []) == []  # at the reward's ceiling (a group all wrong): the task is learned
    assert new_warnings([it(1, 0.0, 0.0), it(2, 0.0, 0.0), it(3, 0.0, 0.0)], []) == []  # never rose


def test_iterations_whose_samples_mostly_failed_are_warned_of():
    """A reward service down for the run: every sample failed, nothing was trained, and the
    run went on to 'complete' with nothing said (found by a probe)."""
    from rlmesh.coordinator.off_policy_watch import new_warnings

    failing = [{"rollout_id": i, "rollout/failed_ratio": 1.0, "train/samples": 0.0} for i in (1, 2)]
    (warned,) = new_warnings(failing, [])
    assert warned.startswith("rollout/failed_ratio > 0.5 for 2 iterations (last 1, at rollout 2)")
    assert "status=failed" in warned and "collapse" not in warned
    assert new_warnings([{**failing[0], "rollout/failed_ratio": 0.25}, failing[1]], []) == []
