"""The buffer's Prometheus metrics: the depths and counters of every run in its Redis
(`rlmesh_buffer_*`, labelled by run), read from Redis before each scrape.

Runs are a bounded label: the coordinator keeps at most max_finished_runs finished runs and
deletes their buffer data beyond that (DeleteRun), and a run's series go with it."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from rlmesh.buffer.store import BufferStore
from rlmesh.common.errors import NotFound
from rlmesh.common.prometheus import ServiceMetrics

PREFIX = "rlmesh_buffer_"
MAX_REASONS = 16  # drop reasons exported per run
# BufferStats field -> (metric name without prefix and without a counter's _total, type, help)
FIELDS = [
    ("queued_groups", "queued_groups", "gauge", "Completed groups waiting for training."),
    ("queued_samples", "queued_samples", "gauge", "Samples in the queued groups."),
    ("leased_groups", "leased_groups", "gauge", "Groups leased to a trainer, not yet acknowledged."),
    (
        "expired_lease_groups",
        "expired_lease_groups",
        "gauge",
        "Groups of leases past their expiry; the next lease queues them again.",
    ),
    ("partial_groups", "partial_groups", "gauge", "Aborted groups waiting to resume."),
    (
        "dead_letter_groups",
        "dead_letter_groups",
        "gauge",
        "Groups in the dead-letter list (rejected by a trainer, or delivered max_deliveries times); never delivered.",
    ),
    ("epoch", "epoch", "gauge", "Epoch of the first training dataset."),
    ("groups_written", "groups_written", "counter", "Completed groups stored (duplicates not counted)."),
    ("acknowledged_groups", "acknowledged_groups", "counter", "Groups acknowledged by a trainer."),
    ("dropped_groups", "dropped_groups", "counter", "Groups dropped (filtered out by rollout, or stale)."),
    ("stale_groups_dropped", "stale_groups_dropped", "counter", "Groups dropped as older than a lease's bound."),
    ("stale_groups_kept", "stale_groups_kept", "counter", "Groups delivered although older than a lease's bound."),
    ("redelivered_groups", "redelivered_groups", "counter", "Groups redelivered after a batch lease expired."),
    ("prompts_handed_out", "prompts_handed_out", "counter", "Prompt groups handed to rollout workers."),
    ("prompts_reissued", "prompts_reissued", "counter", "Prompts handed out again after their lease expired."),
    ("partial_groups_returned", "partial_groups_returned", "counter", "Aborted groups handed back to resume."),
    ("prompts_skipped", "prompts_skipped", "counter", "Dataset records skipped as longer than max_prompt_length."),
    ("groups_written_per_second", "groups_written_per_second", "gauge", "Groups written per second (rate window)."),
    (
        "groups_acknowledged_per_second",
        "groups_acknowledged_per_second",
        "gauge",
        "Groups acknowledged per second (rate window).",
    ),
    (
        "prompts_handed_out_per_second",
        "prompts_handed_out_per_second",
        "gauge",
        "Prompt groups handed out per second (rate window).",
    ),
]


class BufferCollector(Collector):
    """Yields the stats read by the last refresh (one Redis read per run and scrape)."""

    def __init__(self, store: BufferStore) -> None:
        self.store = store
        self.stats: dict[str, dict] = {}

    async def refresh(self) -> None:
        stats = {}
        for run in await self.store.list_runs():
            try:
                stats[run] = await self.store.stats(run)
            except NotFound:  # deleted meanwhile
                continue
        self.stats = stats

    def describe(self):
        return []  # the families depend on the runs present

    def collect(self):
        stats = self.stats
        for field, name, kind, help_text in FIELDS:
            family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
                PREFIX + name, help_text, labels=["run"]
            )
            for run, s in stats.items():
                family.add_metric([run], float(s[field]))
            yield family
        by_reason = CounterMetricFamily(
            PREFIX + "dropped_groups_by_reason", "Groups dropped, by reason.", labels=["run", "reason"]
        )
        for run, s in stats.items():
            for reason, n in bounded_reasons(s["dropped_by_reason"]).items():
                by_reason.add_metric([run, reason], float(n))
        yield by_reason


def bounded_reasons(counts: dict[str, int], most: int = MAX_REASONS) -> dict[str, int]:
    """The `most` - 1 commonest reasons, the rest summed as "other": drop reasons are words a
    rollout worker chose, and each would be a series of its own."""
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    if len(ranked) <= most:
        return dict(ranked)
    kept = dict(ranked[: most - 1])
    kept["other"] = kept.get("other", 0) + sum(n for _, n in ranked[most - 1 :])
    return kept


def register(metrics: ServiceMetrics, store: BufferStore) -> BufferCollector:
    collector = BufferCollector(store)
    metrics.registry.register(collector)
    metrics.on_scrape(collector.refresh)
    return collector
