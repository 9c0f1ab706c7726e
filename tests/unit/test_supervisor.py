"""The supervisor's decisions with a fake clock and fake processes: what exits is started
again after a delay that doubles up to a cap and falls back once a process stayed up;
each exit and restart is said on the console and in the process's log file."""

from __future__ import annotations

import itertools
import signal

import pytest

from rlmesh.cli.launcher import Supervisor, exit_reason

_pids = itertools.count(100)


class FakeProcess:
    def __init__(self) -> None:
        self.pid = next(_pids)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Harness:
    """One supervised fake service; `started` lists every process its start made."""

    def __init__(self, tmp_path, **backoff) -> None:
        self.clock, self.lines, self.started = Clock(), [], []
        self.log_file = tmp_path / "svc.log"
        self.supervisor = Supervisor(clock=self.clock, echo=self.lines.append, **backoff)
        self.process = FakeProcess()
        self.supervisor.watch("svc", self.process, self.start, self.log_file)
        self.fail_starts = 0

    def start(self) -> FakeProcess:
        if self.fail_starts:
            self.fail_starts -= 1
            raise RuntimeError("port not free yet")
        self.process = FakeProcess()
        self.started.append(self.process)
        return self.process

    def at(self, t: float) -> None:
        self.clock.now = t
        self.supervisor.check_once()

    def crash(self, t: float, code: int = -signal.SIGKILL) -> None:
        self.process.returncode = code
        self.at(t)


def restart_times(h: Harness, crashes: int, step: float = 0.25) -> list[float]:
    """Crash the service right after each restart; the times at which restarts happened."""
    times = []
    t = h.clock.now
    for _ in range(crashes):
        h.crash(t)
        before = len(h.started)
        while len(h.started) == before:
            t += step
            h.at(t)
        times.append(t)
    return times


def test_a_running_process_is_left_alone(tmp_path):
    h = Harness(tmp_path)
    for t in range(0, 600, 10):
        h.at(t)
    assert h.started == [] and h.lines == []


def test_an_exited_process_is_restarted_after_the_delay_not_before(tmp_path):
    h = Harness(tmp_path)
    h.crash(5.0, code=1)
    h.at(5.5)
    assert h.started == []
    h.at(6.0)
    assert len(h.started) == 1 and h.supervisor.watched["svc"].process is h.started[0]


def test_delays_double_up_to_the_cap_and_the_supervisor_never_gives_up(tmp_path):
    h = Harness(tmp_path, initial=1.0, maximum=30.0, stable_after=60.0)
    times = restart_times(h, crashes=10)
    gaps = [b - a for a, b in zip([0.0, *times], times)]
    assert gaps == [1, 2, 4, 8, 16, 30, 30, 30, 30, 30]


def test_the_delay_falls_back_once_the_process_stayed_up(tmp_path):
    h = Harness(tmp_path, initial=1.0, maximum=30.0, stable_after=60.0)
    restart_times(h, crashes=4)  # next delay would be 16 s
    t = h.clock.now
    h.crash(t + 59)  # up 59 s: still flapping
    h.at(t + 59 + 15.75)
    assert len(h.started) == 4
    h.at(t + 59 + 16)
    assert len(h.started) == 5
    t = h.clock.now
    h.crash(t + 60)  # up 60 s: stable, back to the first delay
    h.at(t + 61)
    assert len(h.started) == 6
    assert "restart attempt 1 in 1 s" in h.lines[-2]


def test_a_start_that_fails_counts_as_an_attempt_and_is_retried(tmp_path):
    h = Harness(tmp_path)
    h.fail_starts = 2
    h.crash(0.0)
    for t in (1.0, 3.0):  # fails at 1 (next in 2 s), at 3 (next in 4 s)
        h.at(t)
    assert h.started == []
    h.at(6.9)
    assert h.started == []
    h.at(7.0)
    assert len(h.started) == 1
    assert any("did not start again (port not free yet); restart attempt 3 in 4 s" in line for line in h.lines)


def test_each_exit_and_restart_is_said_on_the_console_and_in_the_log_file(tmp_path):
    h = Harness(tmp_path)
    h.crash(12.0)
    h.at(13.0)
    pid = h.started[0].pid
    assert h.lines == [
        "svc exited (killed by SIGKILL) after 12 s; restart attempt 1 in 1 s",
        f"svc restarted (pid {pid}, attempt 1)",
    ]
    log = h.log_file.read_text().splitlines()
    assert [line.split(" rlmesh up: ")[1] for line in log] == h.lines


def test_only_the_process_that_exited_is_restarted(tmp_path):
    clock, lines = Clock(), []
    supervisor = Supervisor(clock=clock, echo=lines.append)
    procs = {name: FakeProcess() for name in ("a", "b", "c")}
    restarted = []
    for name, proc in procs.items():
        supervisor.watch(name, proc, lambda n=name: restarted.append(n) or FakeProcess())
    procs["b"].returncode = 0  # even a clean exit is restarted: `up` keeps every service running
    supervisor.check_once()
    clock.now = 1.0
    supervisor.check_once()
    assert restarted == ["b"]
    assert supervisor.watched["a"].process is procs["a"] and supervisor.watched["c"].process is procs["c"]


@pytest.mark.parametrize(
    ("code", "words"),
    [
        (0, "exit code 0"),
        (3, "exit code 3"),
        (-signal.SIGKILL, "killed by SIGKILL"),
        (-signal.SIGTERM, "killed by SIGTERM"),
    ],
)
def test_exit_reasons_name_the_code_or_the_signal(code, words):
    assert exit_reason(code) == words
