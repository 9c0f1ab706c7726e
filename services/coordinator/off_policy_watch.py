"""Warnings a run raises when its samples of older weights drift far from the trainer, when
most of its samples fail, and when its batches stop teaching anything after its reward fell:
read from the metrics of the last iterations (docs/training-modes.md says what each means and what to
change). The run driver calls record_warnings after each iteration; the warnings are kept
with the run (`warnings` in GET /runs/{id})."""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable

from rlmesh.coordinator.store import RunStore

log = logging.getLogger(__name__)

# How many consecutive RL iterations a metric must be past its threshold: one bad batch is
# noise, two in a row is a trend (in the collapses measured, the gap grew over several).
WINDOW = 2
MAX_WARNINGS = 16
# The iterations read for the reward's best so far (a fall is measured from it).
HISTORY = 64
# The metric that is 0 when every group's samples scored alike (see nothing_learned).
NOTHING_LEARNED = "train/advantage_abs_mean"

COLLAPSE = "a run may collapse next (see docs/training-modes.md#off-policy-correction)"
# (metric, comparison, threshold, what it means, what follows)
CHECKS: tuple[tuple[str, Callable[[float, float], bool], float, str, str], ...] = (
    (
        "train/is_ess",
        operator.lt,
        0.5,
        "a few samples of older weights dominate the batch's importance weights",
        COLLAPSE,
    ),
    (
        "train/train_rollout_logprob_abs_diff",
        operator.gt,
        0.2,
        "the trainer's and the engines' log-probs of the trained tokens are far apart (nats per token)",
        COLLAPSE,
    ),
    (
        "train/is_truncated_masked_fraction",
        operator.gt,
        0.2,
        "the off-policy correction truncates or masks a large share of the trained tokens",
        COLLAPSE,
    ),
    (
        "rollout/failed_ratio",
        operator.gt,
        0.5,
        "most of the iteration's samples failed (a reward service or the engines answered an error)",
        "failed samples are never trained; GET /runs/{id}/samples?status=failed says why (see docs/rewards.md)",
    ),
)


def new_warnings(records: list[dict], raised: list[str]) -> list[str]:
    """Warnings for the checks whose metric was past its threshold in each of the last WINDOW
    iteration records of `records` (oldest first), each raised once per run (`raised`: the
    run's warnings so far)."""
    out: list[str] = []
    for name, crossed, threshold, meaning, follows in CHECKS:
        values = [r[name] for r in records[-WINDOW:] if isinstance(r.get(name), (int, float))]
        if len(values) < WINDOW or not all(crossed(v, threshold) for v in values):
            continue
        if any(w.startswith(name + " ") for w in raised) or len(raised) + len(out) >= MAX_WARNINGS:
            continue
        where = records[-1].get("rollout_id", "?")
        sign = "<" if crossed is operator.lt else ">"
        out.append(
            f"{name} {sign} {threshold:g} for {WINDOW} iterations (last {values[-1]:.3g}, at rollout {where}): "
            f"{meaning}; {follows}"
        )
    nothing = nothing_learned(records)
    if nothing and not any(w.startswith(NOTHING_LEARNED) for w in raised) and len(raised) + len(out) < MAX_WARNINGS:
        out.append(nothing)
    return out


def nothing_learned(records: list[dict]) -> str:
    """A warning when each of the last WINDOW batches had no advantage (every group's samples
    scored alike: GRPO and its relatives then learn nothing) at a train reward that fell more
    than half the way from its best in `records` to its lowest there. In the collapses
    measured every group then scored 0 and the run never recovered; a run at its reward's
    ceiling (the task learned, a few groups all wrong) is not warned of."""
    last = records[-WINDOW:]
    advantages = [r.get(NOTHING_LEARNED) for r in last]
    if len(records) <= WINDOW or not all(isinstance(a, (int, float)) and abs(a) < 1e-9 for a in advantages):
        return ""
    rewards = [r["train/reward_mean"] for r in records if isinstance(r.get("train/reward_mean"), (int, float))]
    reward = last[-1].get("train/reward_mean")
    if not isinstance(reward, (int, float)) or reward >= (max(rewards) + min(rewards)) / 2:
        return ""
    best = max(rewards)
    return (
        f"{NOTHING_LEARNED} = 0 for {WINDOW} iterations (at rollout {last[-1].get('rollout_id', '?')}, train reward "
        f"{reward:.3g}, its best {best:.3g}): every group's samples scored alike, so the batches teach "
        "nothing, and a run that fell this far has not recovered by itself in the runs measured: resume from a "
        "checkpoint before the fall with a lower learning rate or max_staleness (see docs/training-modes.md)"
    )


async def record_warnings(store: RunStore, run_id: str) -> None:
    """Add to the run the warnings its newest iteration records call for."""
    raised = (await store.get(run_id))["warnings"]
    if added := new_warnings(await store.metrics(run_id, HISTORY), raised):
        log.warning("run %s: %s", run_id, "; ".join(added))
        await store.update(run_id, warnings=raised + added)
