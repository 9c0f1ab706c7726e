"""The reference engine's Prometheus metrics, under SGLang's names (`--enable-metrics`), so
that one dashboard watches SGLang servers and the reference engine alike."""

from __future__ import annotations

import time

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from rlmesh.common.prometheus import ServiceMetrics
from rlmesh.engine.runner import Engine


class EngineCollector(Collector):
    def __init__(self, engine: Engine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self._last = (time.monotonic(), engine.generation_tokens_total)

    def describe(self):
        return []

    def collect(self):
        labels, values = ["model_name"], [self.model_name]
        running, queued = self.engine.load()
        for name, help_text, value in [
            ("sglang:num_running_reqs", "The number of running requests.", running),
            ("sglang:num_queue_reqs", "The number of requests in the waiting queue.", queued),
            (
                "sglang:gen_throughput",
                "The generation throughput (token/s) since the previous scrape.",
                self._throughput(),
            ),
        ]:
            family = GaugeMetricFamily(name, help_text, labels=labels)
            family.add_metric(values, float(value))
            yield family
        for name, help_text, value in [
            ("sglang:prompt_tokens", "Number of prefill tokens processed.", self.engine.prompt_tokens_total),
            ("sglang:generation_tokens", "Number of generation tokens processed.", self.engine.generation_tokens_total),
            (
                "sglang:cached_tokens",
                "Number of prompt tokens reused from the prefix cache.",
                self.engine.cached_tokens_total,
            ),
        ]:
            family = CounterMetricFamily(name, help_text, labels=labels)
            family.add_metric(values, float(value))
            yield family

    def _throughput(self) -> float:
        now, total = time.monotonic(), self.engine.generation_tokens_total
        then, before = self._last
        self._last = (now, total)
        return (total - before) / (now - then) if now > then else 0.0


def engine_metrics(engine: Engine, model_name: str) -> ServiceMetrics:
    metrics = ServiceMetrics()
    metrics.registry.register(EngineCollector(engine, model_name))
    return metrics
