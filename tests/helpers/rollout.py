"""A GenerateRolloutRequest for the rollout service's tests."""

from __future__ import annotations

from rlmesh.common.run_config import SamplingConfig
from rlmesh.common.sampling import sampling_to_proto
from rlmesh.v1 import reward_pb2, rollout_pb2


def request(**kw) -> rollout_pb2.GenerateRolloutRequest:
    defaults = dict(
        run_id="r",
        num_groups=2,  # group size: the buffer run's (3)
        sampling=sampling_to_proto(SamplingConfig(max_new_tokens=6)),
        reward=reward_pb2.RewardSpec(components={"exact_match": 1.0}),
    )
    return rollout_pb2.GenerateRolloutRequest(**{**defaults, **kw})
