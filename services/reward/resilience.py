"""Calling a remote reward service without letting it hurt the run: batching, a
concurrency cap (semaphore), a timeout per call, bounded retries with exponential
backoff and jitter, and a circuit breaker. RemoteCaller.score never raises and never
waits without bound: every sample comes back with a score or the reason it has none.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rlmesh.common.reward_service import RemoteServiceSpec
from rlmesh.reward.remote import CallFailed, SampleResult, Transport, Unit

log = logging.getLogger(__name__)

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


@dataclass(frozen=True)
class CallPolicy:
    """The reward service's settings for every remote (per-service knobs live in the registration)."""

    max_retries: int = 2
    backoff_base_seconds: float = 0.1
    backoff_max_seconds: float = 5.0
    breaker_failure_threshold: int = 5
    breaker_cooldown_seconds: float = 10.0
    max_reply_bytes: int = 16 * 1024 * 1024

    def backoff(self, retry: int) -> float:
        """Delay before retry number `retry` (1, 2, ...): exponential, capped, with jitter
        so that many callers do not retry in lockstep."""
        ceiling = min(self.backoff_max_seconds, self.backoff_base_seconds * 2 ** (retry - 1))
        return random.uniform(ceiling / 2, ceiling)


class BreakerOpen(Exception):
    pass


class CircuitBreaker:
    """Opens after `threshold` consecutive failed calls; after `cooldown` one trial call
    goes through (half-open) while the others wait for its outcome; success closes it,
    failure opens it again."""

    def __init__(self, threshold: int, cooldown: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.threshold = threshold
        self.cooldown = cooldown
        self.clock = clock
        self.state = CLOSED
        self.consecutive_failures = 0
        self.times_opened = 0
        self.last_failure = ""
        self._opened_at = 0.0
        self._trial_done: asyncio.Event | None = None

    async def acquire(self) -> bool:
        """Wait until a call may go out; True when this call is the half-open trial.
        Raises BreakerOpen while the breaker is open."""
        while True:
            if self.state == CLOSED:
                return False
            if self.state == OPEN:
                remaining = self._opened_at + self.cooldown - self.clock()
                if remaining > 0:
                    raise BreakerOpen(
                        f"circuit breaker open after {self.consecutive_failures} consecutive failures "
                        f"(last: {self.last_failure}); next try in {remaining:.1f} s"
                    )
                self.state = HALF_OPEN
                self._trial_done = asyncio.Event()
                return True
            # HALF_OPEN: another call is the trial; its outcome decides for this one too.
            assert self._trial_done is not None
            await self._trial_done.wait()

    def record_success(self) -> None:
        self.state = CLOSED
        self.consecutive_failures = 0
        self._end_trial()

    def record_failure(self, reason: str) -> None:
        self.consecutive_failures += 1
        self.last_failure = reason
        if self.state == HALF_OPEN or (self.state == CLOSED and self.consecutive_failures >= self.threshold):
            self.state = OPEN
            self.times_opened += 1
            self._opened_at = self.clock()
            log.warning("circuit breaker opened after %d consecutive failures: %s", self.consecutive_failures, reason)
        self._end_trial()

    def _end_trial(self) -> None:
        if self._trial_done is not None:
            self._trial_done.set()
            self._trial_done = None


@dataclass
class CallerStats:
    calls: int = 0
    failures: int = 0
    retries: int = 0
    samples_scored: int = 0
    samples_failed: int = 0
    last_error: str = ""
    latency_total: float = 0.0
    successful_calls: int = 0

    @property
    def mean_latency(self) -> float:
        return self.latency_total / self.successful_calls if self.successful_calls else 0.0


def pack_batches(units: Sequence[Unit], max_batch_size: int) -> list[list[Unit]]:
    """Consecutive units, whole, into batches of at most max_batch_size samples (a unit
    larger than that travels alone)."""
    batches: list[list[Unit]] = []
    current: list[Unit] = []
    size = 0
    for unit in units:
        n = len(unit.samples)
        if current and size + n > max_batch_size:
            batches.append(current)
            current, size = [], 0
        current.append(unit)
        size += n
    if current:
        batches.append(current)
    return batches


class RemoteCaller:
    """One registered service: its transport, breaker, semaphore and counters."""

    def __init__(self, config: RemoteServiceSpec, policy: CallPolicy, transport: Transport) -> None:
        self.config = config
        self.policy = policy
        self.transport = transport
        self.breaker = CircuitBreaker(policy.breaker_failure_threshold, policy.breaker_cooldown_seconds)
        self.stats = CallerStats()
        self._semaphore = asyncio.Semaphore(config.max_concurrency)

    async def score(self, units: Sequence[Unit]) -> list[SampleResult]:
        """One result per sample of `units`, in order: a RemoteScore or the reason it failed
        (prefixed with the service's name)."""
        batches = pack_batches([u for u in units if u.samples], self.config.max_batch_size)
        per_batch = await asyncio.gather(*(self._score_batch(b) for b in batches))
        results = [r for batch in per_batch for r in batch]
        failed = sum(isinstance(r, str) for r in results)
        self.stats.samples_failed += failed
        self.stats.samples_scored += len(results) - failed
        return [f"{self.config.name}: {r}" if isinstance(r, str) else r for r in results]

    async def _score_batch(self, units: list[Unit]) -> list[SampleResult]:
        n = sum(len(u.samples) for u in units)
        attempt = 0
        last: CallFailed | None = None
        while True:
            try:
                outcome = await self._attempt(units)
            except BreakerOpen as e:
                if last is None:
                    return [str(e)] * n
                # Our own failures opened it: the reason is the last failure, not the breaker.
                return [f"{last.reason} ({_attempts(attempt)}; the circuit breaker is now open)"] * n
            attempt += 1
            if not isinstance(outcome, CallFailed):
                return outcome
            last = outcome
            if not outcome.retryable or attempt > self.policy.max_retries:
                return [f"{outcome.reason} ({_attempts(attempt)})"] * n
            self.stats.retries += 1
            await asyncio.sleep(self.policy.backoff(attempt))

    async def _attempt(self, units: list[Unit]) -> list[SampleResult] | CallFailed:
        is_trial = await self.breaker.acquire()
        recorded = False
        try:
            async with self._semaphore:
                timeout = self.config.timeout_seconds
                self.stats.calls += 1
                started = time.monotonic()
                try:
                    # The transport has its own timeout; this one also bounds a reply that trickles.
                    results = await asyncio.wait_for(self.transport.call(units, timeout), timeout)
                except CallFailed as e:
                    failure = e
                except asyncio.TimeoutError:
                    failure = CallFailed(f"no answer within {timeout:g} s", retryable=True)
                except Exception as e:
                    log.exception("remote reward service %s: unexpected error", self.config.name)
                    failure = CallFailed(f"unexpected error: {type(e).__name__}: {e}", retryable=False)
                else:
                    self.stats.latency_total += time.monotonic() - started
                    self.stats.successful_calls += 1
                    self.breaker.record_success()
                    recorded = True
                    return results
            self.stats.failures += 1
            self.stats.last_error = failure.reason
            self.breaker.record_failure(failure.reason)
            recorded = True
            return failure
        finally:
            if is_trial and not recorded:  # cancelled mid-trial: do not leave the others waiting
                self.breaker.record_failure("the trial call was cancelled")

    async def close(self) -> None:
        await self.transport.close()


def _attempts(n: int) -> str:
    return f"{n} attempt{'s' if n > 1 else ''}"
