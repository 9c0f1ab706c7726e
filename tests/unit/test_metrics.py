"""Combining metric windows (the fully_async generation loop reports one per heartbeat)."""

from rlmesh.common.metrics import merge_sample_metrics


def test_means_are_weighted_by_samples_and_counts_add_up():
    total: dict[str, float] = {}
    merge_sample_metrics(
        total,
        {"rollout/samples": 2, "rollout/reward_mean": 1.0, "rollout/truncated_ratio": 0.0, "rollout/groups_written": 1},
        "rollout/samples",
    )
    merge_sample_metrics(
        total,
        {"rollout/samples": 6, "rollout/reward_mean": 0.0, "rollout/truncated_ratio": 0.5, "rollout/groups_written": 3},
        "rollout/samples",
    )
    merge_sample_metrics(total, {}, "rollout/samples")  # an empty window changes nothing
    assert total == {
        "rollout/samples": 8,
        "rollout/reward_mean": 0.25,
        "rollout/truncated_ratio": 0.375,
        "rollout/groups_written": 4,
    }


def test_drop_reasons_exported_are_bounded():
    from rlmesh.buffer.metrics import bounded_reasons

    few = {"filtered": 3, "stale": 1}
    assert bounded_reasons(few) == few
    many = {f"reason{i}": i for i in range(1, 41)}
    kept = bounded_reasons(many, most=4)
    assert kept == {"reason40": 40, "reason39": 39, "reason38": 38, "other": sum(range(1, 38))}
    assert sum(kept.values()) == sum(many.values())
