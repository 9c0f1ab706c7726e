"""The reward service's Prometheus metrics, read from the scorer's and the remote callers'
counters at each scrape (the scoring code keeps plain counters and knows nothing of Prometheus).

Labels are bounded: failure causes are a fixed list (rlmesh.reward.scoring.FAILURE_CAUSES);
remote services are the ones registered (each registration is an operator's act)."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from rlmesh.common.prometheus import ServiceMetrics
from rlmesh.reward.registry import RemoteRegistry
from rlmesh.reward.resilience import OPEN
from rlmesh.reward.scoring import Scorer


class RewardCollector(Collector):
    def __init__(self, scorer: Scorer, registry: RemoteRegistry) -> None:
        self.scorer = scorer
        self.registry = registry

    def describe(self):
        return []

    def collect(self):
        stats = self.scorer.stats
        scored = CounterMetricFamily("rlmesh_reward_samples_scored", "Samples given a reward.")
        scored.add_metric([], float(stats.samples_scored))
        yield scored
        failed = CounterMetricFamily(
            "rlmesh_reward_sample_failures",
            "Samples that got no reward (status FAILED, not trained on), by the kind of "
            "failure: raised, invalid_value, timeout, worker_died, stopping, remote_failed, "
            "missing_score. A sample failing in two ways counts in both.",
            labels=["reason"],
        )
        for cause, n in sorted(stats.failures_by_cause.items()):
            failed.add_metric([cause], float(n))
        yield failed
        callers = self.registry.known_callers()
        families = {
            "calls": CounterMetricFamily(
                "rlmesh_reward_remote_calls", "Calls to a remote reward service.", labels=["service"]
            ),
            "failures": CounterMetricFamily(
                "rlmesh_reward_remote_call_failures",
                "Calls to a remote reward service that failed (each try counts).",
                labels=["service"],
            ),
            "retries": CounterMetricFamily(
                "rlmesh_reward_remote_retries", "Retried calls to a remote reward service.", labels=["service"]
            ),
        }
        breaker_open = GaugeMetricFamily(
            "rlmesh_reward_remote_breaker_open",
            "1 while a remote reward service's circuit breaker is open.",
            labels=["service"],
        )
        for name, caller in sorted(callers.items()):
            for field, family in families.items():
                family.add_metric([name], float(getattr(caller.stats, field)))
            breaker_open.add_metric([name], 1.0 if caller.breaker.state == OPEN else 0.0)
        yield from families.values()
        yield breaker_open


def register(metrics: ServiceMetrics, scorer: Scorer, registry: RemoteRegistry) -> None:
    metrics.registry.register(RewardCollector(scorer, registry))
    metrics.on_scrape(_refresh(registry))


def _refresh(registry: RemoteRegistry):
    async def refresh() -> None:
        await registry.callers()  # services registered through another replica too

    return refresh
