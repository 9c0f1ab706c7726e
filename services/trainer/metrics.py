"""The trainer's Prometheus metrics: how long train steps and weight pushes take and how
much they move. Labels: the loss ("rl" or "sft"), nothing per run."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from rlmesh.common.prometheus import LATENCY_BUCKETS, ServiceMetrics


class TrainerMetrics:
    def __init__(self, metrics: ServiceMetrics) -> None:
        r = metrics.registry
        self.step_seconds = Histogram(
            "rlmesh_trainer_step_seconds",
            "Time of a train step's forward/backward "
            "passes and optimizer step (not the wait for its batch), in seconds.",
            ["loss"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.steps = Counter("rlmesh_trainer_steps", "Train steps taken.", ["loss"], registry=r)
        self.samples = Counter("rlmesh_trainer_samples_trained", "Samples trained on.", ["loss"], registry=r)
        self.groups = Counter("rlmesh_trainer_groups_trained", "Groups trained on.", ["loss"], registry=r)
        self.publish_seconds = Histogram(
            "rlmesh_trainer_weight_publish_seconds",
            "Time to push new weights to the engines, in seconds.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.publish_bytes = Counter(
            "rlmesh_trainer_weight_publish_bytes", "Bytes of weights pushed to the engines.", registry=r
        )

    def step(self, loss: str, seconds: float, groups: int, samples: int) -> None:
        loss = "sft" if loss == "sft" else "rl"
        self.step_seconds.labels(loss).observe(seconds)
        self.steps.labels(loss).inc()
        self.groups.labels(loss).inc(groups)
        self.samples.labels(loss).inc(samples)

    def publish(self, seconds: float, size: int) -> None:
        self.publish_seconds.observe(seconds)
        self.publish_bytes.inc(size)
