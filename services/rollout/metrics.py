"""The rollout service's Prometheus metrics: tokens the engines generated for it (their
rate is the rollout's tokens/s: `rate(rlmesh_rollout_generated_tokens_total[1m])`), the
/generate requests waiting on engines (its queue depth there), and how long they take."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from rlmesh.common.prometheus import LATENCY_BUCKETS, ServiceMetrics

ENGINE_STATES = ("serving", "behind", "down", "leaving")


class RolloutMetrics:
    def __init__(self, metrics: ServiceMetrics) -> None:
        r = metrics.registry
        self.generated_tokens = Counter(
            "rlmesh_rollout_generated_tokens", "Tokens the engines generated for this service's requests.", registry=r
        )
        self.prompt_tokens = Counter("rlmesh_rollout_prompt_tokens", "Prompt tokens sent to the engines.", registry=r)
        self.in_flight = Gauge(
            "rlmesh_rollout_engine_requests_in_flight",
            "/generate requests sent to an engine and not answered yet.",
            registry=r,
        )
        self.requests = Counter(
            "rlmesh_rollout_engine_requests",
            "/generate requests to the engines, by outcome (ok, or error: no answer or a refusal).",
            ["outcome"],
            registry=r,
        )
        self.seconds = Histogram(
            "rlmesh_rollout_engine_request_seconds",
            "Time of a /generate request, in seconds.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

        self.engines = Gauge(
            "rlmesh_rollout_engines",
            "Engines of the pool by state when last probed: serving, behind (answers, holds older weights than "
            "the run's: a new or restarted engine before its push), down, leaving (dropped by discovery, "
            "requests still in flight there).",
            ["state"],
            registry=r,
        )

    def engines_by_state(self, states: list[str]) -> None:
        for state in ENGINE_STATES:
            self.engines.labels(state).set(states.count(state))

    def started(self) -> float:
        self.in_flight.inc()
        return time.perf_counter()

    def finished(self, started: float, answer: dict[str, Any] | None) -> None:
        self.in_flight.dec()
        self.seconds.observe(time.perf_counter() - started)
        self.requests.labels("ok" if answer is not None else "error").inc()
        if answer is None:
            return
        meta = answer.get("meta_info") or {}
        completion = meta.get("completion_tokens")
        if not isinstance(completion, int):
            completion = len(answer.get("output_ids") or ())
        self.generated_tokens.inc(max(completion, 0))
        prompt = meta.get("prompt_tokens")
        if isinstance(prompt, int) and prompt > 0:
            self.prompt_tokens.inc(prompt)
