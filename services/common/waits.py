"""What a service waits for right now (a peer that is down, restarting or frozen), kept so
that whoever holds a request to it can ask and say so: a run's `waiting_for` names an
outage wherever it is absorbed, not only where the coordinator itself waits."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

# A wait not renewed for this long is over (retries renew theirs at each backoff, at most
# every retry_backoff_max seconds).
FRESH_SECONDS = 30.0
MOST_WAITS = 8  # reasons told at once (one per service waited for)
MOST_REASON_CHARS = 500
LOG_EVERY_SECONDS = 5.0


class Waits:
    """The current waits of one service, by what it waits for."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._waits: dict[str, tuple[str, float]] = {}  # what it waits for -> (why, when last said)
        self._logged: dict[str, float] = {}  # what it waits for -> when a wait for it was last logged

    def on_wait(self, what: str) -> Callable[[str], Awaitable[None]]:
        """A retry's on_wait: logs the reason and keeps it as the wait for `what`."""

        async def waiting(reason: str) -> None:
            now = self._clock()
            # Logged once a while per thing waited for: every sample of a rollout retries on
            # its own, and 2,000 lines in 30 s for one engine restart said nothing more.
            if now - self._logged.get(what, -LOG_EVERY_SECONDS) >= LOG_EVERY_SECONDS:
                self._logged[what] = now
                log.warning("%s", reason)
            self._waits[what] = (reason[:MOST_REASON_CHARS], now)

        return waiting

    def over(self, what: str) -> None:
        """The wait for `what` ended (a call to it went through, or was given up)."""
        self._waits.pop(what, None)

    def current(self) -> list[str]:
        """The reasons of the waits under way, newest first."""
        now = self._clock()
        live = {w: v for w, v in self._waits.items() if now - v[1] <= FRESH_SECONDS}
        self._waits = live
        return [reason for reason, _ in sorted(live.values(), key=lambda v: -v[1])][:MOST_WAITS]
