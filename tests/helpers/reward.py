"""Custom reward functions the reward tests configure by import path, and a sample maker."""

from __future__ import annotations

import asyncio

from rlmesh.common.sample import Sample, Status


def length_bonus(sample: Sample) -> float:
    return min(len(sample.response), 10) / 10


def first_char_parity(sample: Sample) -> float:
    """1 when the response starts with a character of even code: an untrained model's
    samples of one prompt often differ, and often do not (the dynamic filter has work)."""
    return float(bool(sample.response) and ord(sample.response[0]) % 2 == 0)


async def async_contains_label(sample: Sample) -> dict:
    await asyncio.sleep(0)
    return {"score": float(sample.label in sample.response), "pred_len": len(sample.response)}


def broken(sample: Sample) -> float:
    raise RuntimeError("the judge is down")


def not_a_number(sample: Sample):
    return "yes"


def huge(sample: Sample) -> float:
    return 1e300  # finite, but no reward: its square overflows


def large(sample: Sample) -> float:
    return 1e8  # a reward, until weighted by more than 10


def rank_in_group(samples: list[Sample]) -> list[float]:
    """Shortest response in the group gets 1.0, the others 0.0."""
    shortest = min(len(s.response) for s in samples)
    return [float(len(s.response) == shortest) for s in samples]


async def wrong_length_group(samples: list[Sample]) -> list[float]:
    return [1.0]


CUSTOM = {
    "length_bonus": f"{__name__}:length_bonus",
    "contains_label": f"{__name__}:async_contains_label",
    "broken": f"{__name__}:broken",
    "not_a_number": f"{__name__}:not_a_number",
    "huge": f"{__name__}:huge",
    "large": f"{__name__}:large",
}
GROUP = {"shortest": f"{__name__}:rank_in_group", "wrong_length": f"{__name__}:wrong_length_group"}


def make_sample(index: int, response: str, label: str, **kw) -> Sample:
    return Sample(
        index=index,
        group_index=kw.pop("group_index", 0),
        prompt="What is it?",
        tokens=[5, 6, 7, 8, 9],
        response=response,
        response_length=2,
        label=label,
        loss_mask=[1, 1],
        rollout_log_probs=[-0.5, -0.25],
        status=Status.COMPLETED,
        **kw,
    )
