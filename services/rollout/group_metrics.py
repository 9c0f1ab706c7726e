"""What the rollout service reports of the groups it made (training rollouts and
evaluations alike), and which groups it keeps (the group filter)."""

from __future__ import annotations

import statistics

from rlmesh.common.sample import Sample, SampleGroup, Status

# Reward components reported per rollout or evaluation (a remote service's named scores
# add names: the metric keys stay bounded).
MAX_COMPONENT_METRICS = 32


def keep_group(group: SampleGroup, group_filter: str) -> bool:
    if group_filter == "nonzero_std":
        rewards = [s.reward for s in group.samples if s.status != Status.FAILED]
        return len(rewards) > 1 and max(rewards) != min(rewards)
    return True


def rollout_metrics(groups: list[SampleGroup], prefix: str) -> dict[str, float]:
    samples = [s for g in groups for s in g.samples]
    if not samples:
        return {}
    scored = [s.reward for s in samples if s.status != Status.FAILED]
    out = {
        f"{prefix}reward_mean": statistics.fmean(scored) if scored else 0.0,
        f"{prefix}response_length_mean": statistics.fmean(s.response_length for s in samples),
        f"{prefix}truncated_ratio": sum(s.status == Status.TRUNCATED for s in samples) / len(samples),
        f"{prefix}failed_ratio": sum(s.status == Status.FAILED for s in samples) / len(samples),
        f"{prefix}samples": float(len(samples)),
    }
    for s in samples:  # failed samples counted by what failed (a few fixed names: the keys stay bounded)
        if s.status == Status.FAILED:
            key = f"{prefix}failed/{_failure_kind(s)}"
            out[key] = out.get(key, 0.0) + 1.0
    out.update(component_means(samples, prefix))
    return out


def component_means(samples: list[Sample], prefix: str) -> dict[str, float]:
    """Each reward component's mean beside the weighted total (reward_mean), over the scored
    samples that have it: `<prefix>reward/<name>_mean`, for at most MAX_COMPONENT_METRICS names."""
    values: dict[str, list[float]] = {}
    for s in samples:
        if s.status != Status.FAILED:
            for name, value in s.reward_components.items():
                values.setdefault(name, []).append(value)
    return {
        f"{prefix}reward/{name}_mean": statistics.fmean(values[name]) for name in sorted(values)[:MAX_COMPONENT_METRICS]
    }


def _failure_kind(sample: Sample) -> str:
    """'generation' (the engine, a generate function or its time limit: metadata['failure']),
    'reward' (scoring: metadata['reward_error']) or 'other'."""
    if "failure" in sample.metadata:
        return "generation"
    return "reward" if "reward_error" in sample.metadata else "other"
