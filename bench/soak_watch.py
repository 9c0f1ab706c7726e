"""What bench.soak watches while a run goes through its faults: when the run makes progress
(GET /runs/{id} and the buffer's counters, polled), each period without progress longer
than a threshold and whether `waiting_for` said something within it, and the lines of the
services' logs worth showing beside a violation."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from tests.helpers.chaos import Chaos

FINAL = ("completed", "failed", "stopped")
PHASES = ("setup", "sft", "rl", "done")
POLL_SECONDS = 0.25


class Watch:
    """Polls run `run_id` in a thread. Progress is any growth of its work done: groups written
    or acknowledged, weight versions, iterations, the phase, the evaluation before RL, its end."""

    def __init__(self, chaos: Chaos, run_id: str, silence: float) -> None:
        self.chaos, self.run_id, self.silence = chaos, run_id, silence
        self.t0 = time.monotonic()
        self.last: dict | None = None  # the newest answer of GET /runs/{id}
        self.counts = (0, 0)  # groups written, acknowledged (last known)
        self.best = -1
        self.progress: list[float] = []
        self.period_start, self.said_at, self.said = self.t0, None, ""
        self._stalls: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._cond = threading.Condition()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        with self._cond:
            self._close_period(time.monotonic())

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def final(self) -> bool:
        return self.last is not None and self.last.get("status") in FINAL

    def stalls(self) -> list[dict]:
        return list(self._stalls)

    def wait_final(self, timeout: float) -> dict | None:
        """The run's last answer once it has ended, or None after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self.final():
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(min(left, 1.0))
            return self.last

    def progress_after(self, t: float, timeout: float, also: Callable[[], bool] | None = None) -> float | None:
        """Seconds from `t` until the run's first progress after it, or until `also` holds
        (None: neither within `timeout`)."""
        deadline = t + timeout
        with self._cond:
            while True:
                later = [p for p in self.progress if p > t]
                if later:
                    return later[0] - t
                if also is not None and also():
                    return max(time.monotonic() - t, 0.0)
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(min(left, 0.25))

    def poll(self) -> None:
        """Look at the run now (the thread does it every POLL_SECONDS)."""
        run = self._get()
        counts = self._counts()
        now = time.monotonic()
        with self._cond:
            if run is not None and not self.final():  # (two polls may overlap: an end stays)
                self.last = run
            if counts is not None:  # (both only grow)
                self.counts = (max(counts[0], self.counts[0]), max(counts[1], self.counts[1]))
            self._observe(now)
            self._cond.notify_all()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.poll()
            if self.final():
                return
            self._stop.wait(POLL_SECONDS)

    def _get(self) -> dict | None:
        try:
            run = self.chaos.api.get(f"/runs/{self.run_id}", params={"metrics_last": 0}, timeout=5).json()
        except (httpx.HTTPError, ValueError):  # the coordinator down, frozen or restarting
            return None
        return run if "status" in run else None  # (503 while a dependency restarts)

    def _counts(self) -> tuple[int, int] | None:
        try:
            s = self.chaos.stats(self.run_id, timeout=3)
        except Exception:  # the buffer or its Redis down, frozen or restarting
            return None
        return s.groups_written, s.acknowledged_groups

    def _observe(self, now: float) -> None:
        run = self.last or {}
        work = sum(self.counts) + run.get("weight_version", 0) + run.get("rollout_id", 0)
        work += bool(run.get("eval_before")) + PHASES.index(run.get("phase", "setup")) + (run.get("status") in FINAL)
        if run.get("waiting_for") and self.said_at is None:
            self.said_at, self.said = now, run["waiting_for"]
        if work > self.best:
            if self.best >= 0:
                self.progress.append(now)
            self.best = work
            self._close_period(now)

    def _close_period(self, now: float) -> None:
        """The period without progress ends at `now`: kept if it was long."""
        length = now - self.period_start
        if length > self.silence:
            said_after = None if self.said_at is None else self.said_at - self.period_start
            self._stalls.append(
                {
                    "at_s": round(self.period_start - self.t0, 1),
                    "seconds": round(length, 1),
                    "said_after_s": None if said_after is None else round(said_after, 1),
                    "said_within_60s": said_after is not None and said_after <= self.silence,
                    "waiting_for": self.said[:300],
                }
            )
        self.period_start, self.said_at, self.said = now, None, ""


_WORTH = re.compile(r"ERROR|Error|Traceback|failed|rlmesh up:|waiting|lost the run|taken again")


def log_excerpt(stack, offsets: dict[str, int], run_id: str, lines: int = 4) -> list[str]:
    """The services' log lines since the run started that tell what went wrong (errors,
    restarts, waits): each service's newest `lines` of them, prefixed with its name."""
    found = []
    for name, offset in offsets.items():
        path: Path = stack.log_file(name)
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                text = f.read(2_000_000).decode(errors="replace")
        except OSError:
            continue
        worth = [f"{name}: {line[:300]}" for line in text.splitlines() if _WORTH.search(line)]
        found += worth[-lines:]
    return found
