"""A posted Atropos group becomes an ordinary SampleGroup, or is refused naming what is wrong."""

from __future__ import annotations

import math
import re
import time

import pytest

from rlmesh.coordinator.trajectory import (
    BadGroup,
    Environment,
    Environments,
    RegisterEnv,
    RunView,
    ScoredData,
    batch_minimums,
    scored_group,
)

RUN = RunView(vocab_size=100, max_token_length=16, max_group_size=8, weight_version=3)


def env(group_size: int = 2):
    envs = Environments("run", limit=2)
    return envs, envs.register(
        RegisterEnv(max_token_length=16, desired_name="gsm 8k", weight=1.0, group_size=group_size), 8
    )


def test_prompt_response_and_masks_map_to_a_sample():
    _, e = env()
    data = ScoredData(
        tokens=[[1, 2, 3, 4, 5], [1, 2, 6, 7, 8]],
        masks=[[-100, -100, 3, -100, 5], [-100, -100, 6, 7, 8]],  # a tool output untrained mid-response
        scores=[1.0, 0.0],
        inference_logprobs=[[1.0, 1.0, -0.1, -0.2, -0.3], [-0.5, -0.6, -0.7]],
        messages=[[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]] * 2,
    )
    g = scored_group(data, RUN, e)
    s = g.samples[0]
    assert g.dataset == "gsm_8k_0" and [x.reward for x in g.samples] == [1.0, 0.0]
    assert s.response_length == 3 and s.loss_mask == [1, 0, 1] and s.prompt_tokens == [1, 2]
    assert s.rollout_log_probs == pytest.approx([-0.1, -0.2, -0.3])
    assert g.samples[1].rollout_log_probs == pytest.approx([-0.5, -0.6, -0.7])
    assert s.weight_versions == [3] and s.response == "a"
    assert scored_group(data, RUN, e).group_id == g.group_id  # a retried post is the same group


def test_a_group_smaller_than_registered_is_taken_as_its_own_group():
    # (some of the environment's rollouts failed: Atropos trains what came back, as rlmesh does)
    _, e = env(group_size=4)
    data = ScoredData(tokens=[[1, 2, 3]] * 3, masks=[[-100, 2, 3]] * 3, scores=[0.0, 1.0, 1.0])
    g = scored_group(data, RUN, e)
    assert len(g.samples) == 3 and [s.reward for s in g.samples] == [0.0, 1.0, 1.0]
    with pytest.raises(BadGroup, match="group_overrides say group_size 2"):
        scored_group(data.model_copy(update={"group_overrides": {"group_size": 2}}), RUN, e)


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"masks": [[-100, 2], [-100, 2, 3]]}, "masks[0] has 2 entries"),
        ({"scores": [math.nan, 1.0]}, "scores[0] is nan"),
        ({"tokens": [[1, 2, 300], [1, 2, 3]]}, "id 300 at position 2, outside [0, 99]"),
        ({"masks": [[-100] * 3, [-100, 2, 3]]}, "masks[0] marks no token"),
        ({"advantages": [[1.0] * 3] * 2}, "advantages"),
        ({"tokens": [[1, 2, 3]] * 3, "masks": [[-100, 2, 3]] * 3, "scores": [0.0] * 3}, "registered group_size 2"),
        ({"inference_logprobs": [[-1.0], [-1.0]]}, "inference_logprobs[0] has 1 entries"),
        ({"inference_logprobs": [[-1.0, 5.0], [-1.0, -1.0]]}, "a log-probability is a finite number at most 0"),
        ({"scores": [1e308, 0.0]}, "scores[0] is 1e+308, outside ±1e+09"),
        ({"group_overrides": {"group_size": "x"}}, "group_size is 'x', not a whole number"),
    ],
)
def test_bad_groups_are_refused_naming_the_problem(change, says):
    _, e = env()
    data = {"tokens": [[1, 2, 3]] * 2, "masks": [[-100, 2, 3]] * 2, "scores": [0.0, 1.0], **change}
    with pytest.raises(BadGroup, match=None) as refused:
        scored_group(ScoredData(**data), RUN, e)
    assert says in str(refused.value)


def test_registration_is_bounded_and_status_counts_the_queue_in_groups():
    envs, first = env(group_size=4)
    envs.register(RegisterEnv(max_token_length=16, desired_name="gsm 8k", weight=3.0, group_size=2), 8)
    with pytest.raises(BadGroup, match="already has 2 registered"):
        envs.register(RegisterEnv(max_token_length=16, desired_name="x", weight=1.0, group_size=2), 8)
    status = envs.status(first.env_id, step=5, queued_samples=12)
    assert status["queue_size"] == 3 and status["current_step"] == 5 and status["env_weight"] == pytest.approx(0.25)
    for weight, length, says in ((-1.0, 16, "weight is -1.0"), (1e308, 16, "weight is 1e+308"), (1.0, 10**30, "1..")):
        with pytest.raises(BadGroup, match=re.escape(says)):
            Environments("run", limit=2).register(RegisterEnv(max_token_length=length, weight=weight, group_size=2), 8)
    # A group names a registered environment, or none.
    assert envs.poster(None) is None and envs.poster(first.env_id) is first
    with pytest.raises(BadGroup, match="env_id 9999 is not registered"):
        envs.poster(9999)


def test_minimum_allocations_become_each_batchs_least_groups_as_atropos_counts_them():
    envs = Environments("run", limit=8)

    def register(name: str, allocation: float | None):
        body = RegisterEnv(
            max_token_length=16, desired_name=name, weight=1.0, group_size=2, min_batch_allocation=allocation
        )
        return envs.register(body, 8)

    register("a", 0.25), register("b", None), register("c", 0.5)
    assert batch_minimums(envs.envs, 16) == {"a_0": 4, "c_0": 8}
    assert batch_minimums(envs.envs, 3) == {"c_0": 1}  # (a fraction of a group rounds down to none)
    d = register("d", 0.75)  # 4 + 8 + 12 > 16: scaled down
    assert batch_minimums(envs.envs, 16) == {"a_0": 2, "c_0": 5, "d_0": 8}
    d.connected = False  # a disconnected environment is not waited for
    assert batch_minimums(envs.envs, 16) == {"a_0": 4, "c_0": 8}
    stored = [Environment.from_json(e.to_json()) for e in envs.envs]  # (as the run's Redis list keeps them)
    assert stored == envs.envs


def test_an_environment_not_heard_from_for_a_while_is_no_longer_waited_for():
    """One that died without disconnecting (and came back under a new env_id) must not hold
    every batch: its minimum lapses once it has been silent for silent_after seconds, and
    applies again when it is heard from."""
    envs = Environments("run", limit=8)
    for name in ("a", "b"):
        envs.register(RegisterEnv(max_token_length=16, desired_name=name, weight=1.0, group_size=2,
                                  min_batch_allocation=0.25), 8)  # fmt: skip
    now = time.time()
    for e in envs.envs:
        e.registered_at = now - 1000
    assert batch_minimums(envs.envs, 16, {0: now - 5, 1: now - 400}, silent_after=300) == {"a_0": 4}
    assert batch_minimums(envs.envs, 16, {0: now - 5, 1: now - 5}, silent_after=300) == {"a_0": 4, "b_0": 4}
    envs.envs[1].registered_at = now  # (registering is being heard from)
    assert batch_minimums(envs.envs, 16, {0: now - 5}, silent_after=300) == {"a_0": 4, "b_0": 4}
    assert batch_minimums(envs.envs, 16) == {"a_0": 4, "b_0": 4}  # (no bound: every connected one)
