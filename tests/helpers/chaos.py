"""`rlmesh up`'s supervised stack (every service and Redis its own process) with fault points
on, the means to kill, freeze and hold its processes, and the checks a run must pass after
faults: the chaos tests (tests/e2e/test_chaos.py) and the randomized soak (bench/soak.py)
share them."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx
import redis

from rlmesh.cli.launcher import Stack, datasets_dir, start_stack, supervise
from rlmesh.common.auth import client_headers
from rlmesh.common.faults import FAULTS_DIR_ENV
from rlmesh.common.grpc_server import sync_channel
from rlmesh.trainer import trained_log
from rlmesh.v1 import buffer_pb2, buffer_pb2_grpc
from tests.helpers.runs import run_config
from tests.helpers.stack import wait_for_run

PROCESSES = ("engine", "reward", "buffer", "rollout", "trainer", "coordinator", "redis")
RECOVERY_TIMEOUT = 180.0
# The trainer gives up waiting for the buffer soon (a step's acknowledgment then lands later).
TRAINER_BUFFER_TIMEOUT, TRAINER_BUFFER_OUTAGE = 3, 6


def eventually(condition: Callable[[], bool], what: str, timeout: float = RECOVERY_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout:.0f} s"
        time.sleep(0.05)


def chaos_env(faults: Path) -> dict[str, str]:
    """What the stack's children inherit: fault points on, quick retries and short deadlines
    (a frozen peer is noticed within seconds), one torch thread each (2 cores)."""
    return {
        FAULTS_DIR_ENV: str(faults),
        "RLMESH_COORDINATOR_RETRY_BACKOFF_MAX_SECONDS": "1",
        "RLMESH_ROLLOUT_REWARD_TIMEOUT_SECONDS": "5",
        "RLMESH_ROLLOUT_REQUEST_TIMEOUT_SECONDS": "5",
        "RLMESH_ROLLOUT_GENERATE_TIMEOUT_SECONDS": "5",
        # A weight push's deadlines too (a frozen engine in the middle of one is noticed at
        # them): pushes of the tiny model take hundredths of a second.
        "RLMESH_ROLLOUT_WEIGHT_UPDATE_TIMEOUT_SECONDS": "10",
        "RLMESH_TRAINER_WEIGHT_SYNC_TIMEOUT_SECONDS": "10",
        "OMP_NUM_THREADS": "1",
        "RLMESH_TRAINER_BUFFER_TIMEOUT_SECONDS": str(TRAINER_BUFFER_TIMEOUT),
        "RLMESH_TRAINER_BUFFER_OUTAGE_SECONDS": str(TRAINER_BUFFER_OUTAGE),
    }


class Chaos:
    """The supervised stack, and the means to kill, freeze and hold its processes."""

    def __init__(self, stack: Stack, faults: Path) -> None:
        self.stack, self.faults = stack, faults
        self.api = httpx.Client(base_url=stack.coordinator_url, timeout=30, headers=client_headers())
        self.buffer = buffer_pb2_grpc.BufferStub(sync_channel(stack.address("buffer")))

    def process(self, name: str):
        return self.stack.redis.process if name == "redis" else self.stack.processes[name]

    def kill(self, name: str, wait: bool = True) -> None:
        """SIGKILL, then (`wait`) wait until the supervisor has it running again."""
        victim = self.process(name)
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=30)
        if wait:
            self.wait_restarted(name, victim)

    def wait_restarted(self, name: str, victim) -> None:
        eventually(lambda: self.process(name) is not victim, f"{name} restarted")

    def hold(self, point: str) -> None:
        (self.faults / f"{point}.reached").unlink(missing_ok=True)
        (self.faults / f"{point}.hold").touch()

    def is_armed(self, point: str) -> bool:
        """Whether a process that reaches `point` will be held there."""
        return (self.faults / f"{point}.hold").exists()

    def is_held(self, point: str) -> bool:
        """Whether a process is held at `point` now."""
        return (self.faults / f"{point}.reached").exists()

    def wait_reached(self, point: str) -> None:
        eventually(lambda: self.is_held(point), f"fault point {point} reached")

    def release(self, point: str) -> None:
        (self.faults / f"{point}.hold").unlink(missing_ok=True)

    def release_all(self) -> None:
        for hold in self.faults.glob("*.hold"):
            hold.unlink(missing_ok=True)

    def stats(self, run_id: str, timeout: float = 30) -> buffer_pb2.BufferStats:
        """The buffer's figures, asked again while it answers UNAVAILABLE ("retry shortly", as
        every service's client does: its Redis may be restarting after a fault)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.buffer.GetStats(buffer_pb2.GetStatsRequest(run_id=run_id), timeout=timeout)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def wait_rollout(self, run_id: str, done: int = 1) -> None:
        """Until the run has done this many rollouts (the next generation is starting)."""

        def past() -> bool:
            try:
                run = self.api.get(f"/runs/{run_id}").json()
            except httpx.HTTPError:  # the coordinator restarting
                return False
            if "status" not in run:  # 503 while a dependency restarts
                return False
            assert run["status"] in ("pending", "running"), run["error"]
            return run["rollout_id"] >= done

        eventually(past, f"rollout {done}")

    def start_run(self, config: dict) -> str:
        r = self.api.post("/runs", json=config)
        assert r.status_code == 201, r.text
        return r.json()["id"]

    def ensure_finished(self, run_id: str) -> None:
        """A scenario that failed must not leave its run active for the next one."""
        try:
            if self.api.get(f"/runs/{run_id}").json()["status"] not in ("completed", "failed", "stopped"):
                self.api.post(f"/runs/{run_id}/stop")
                wait_for_run(self.api, run_id, timeout=RECOVERY_TIMEOUT)
        except (httpx.HTTPError, AssertionError, KeyError):
            pass

    def run(self, run_id: str, timeout: float = RECOVERY_TIMEOUT * 2) -> dict:
        """The run once it has ended. The coordinator (or its Redis: 503) may be restarting:
        ask again until it answers."""

        def answer():
            try:
                return wait_for_run(self.api, run_id, timeout=timeout)
            except (httpx.HTTPError, KeyError, ValueError):
                return None

        for _ in range(int(RECOVERY_TIMEOUT)):
            if (run := answer()) is not None:
                return run
            time.sleep(1)
        raise AssertionError("the coordinator never answered again")


@contextlib.contextmanager
def supervised_stack(root: Path, model_dir: Path, env: dict[str, str] | None = None) -> Iterator[Chaos]:
    """`rlmesh up`'s stack under `root`, supervised (an exited process is started again on
    its port), with fault points in `root`/faults and chaos_env (plus `env`) in its
    children's environment; stopped on exit."""
    faults = root / "faults"
    faults.mkdir(parents=True, exist_ok=True)
    wanted = {**chaos_env(faults), **(env or {})}
    saved = {name: os.environ.get(name) for name in wanted}
    os.environ.update(wanted)
    stop = threading.Event()
    supervisor = None
    try:
        stack = start_stack(root / "stack", str(model_dir), echo=lambda _: None)
        supervisor = threading.Thread(
            target=supervise, args=(stack, stop), kwargs={"interval": 0.1, "echo": lambda _: None}
        )
        supervisor.start()
        chaos = Chaos(stack, faults)
        try:
            yield chaos
        finally:
            chaos.release_all()
    finally:
        stop.set()
        if supervisor is not None:
            supervisor.join(timeout=120)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def chaos_config(stack: Stack, model_dir: Path, num_rollouts: int = 3) -> dict:
    """A short run that checkpoints every step, rides out outages of minutes, and has no
    warm start."""
    datasets = datasets_dir(stack.data_dir)  # where the stack's buffer may read
    datasets.mkdir(parents=True, exist_ok=True)
    config = run_config(datasets, model_dir, num_rollouts=num_rollouts)
    config.update(checkpoint_interval=1, keep_last=1, max_outage_seconds=300)
    config["sft_warmup"] = {"steps": 0}
    return config


# ---- what must hold after a run, whatever happened to it ----------------------------------


def trained_record(stack: Stack, run_id: str) -> list[str]:
    """Group ids in the final model's record (the newest checkpoint), one per training."""
    checkpoints = sorted((stack.data_dir / "trainer" / run_id / "checkpoints").glob("step-*"))
    if not checkpoints:
        return []
    state = json.loads((checkpoints[-1] / "trainer_state.json").read_text())
    return [gid for ids in trained_log.trained_record(checkpoints[-1], state).values() for gid in ids]


def accounting_problems(
    stack: Stack, s: buffer_pb2.BufferStats, run_id: str, min_groups: int = 0, queued_ok: bool = False
) -> list[str]:
    """What is wrong with a finished run's buffer accounting (empty: nothing): every group
    written was acknowledged or dropped as stale (`queued_ok`: or is still queued, as
    fully_async leaves what it generated past the last step), none dead-lettered, nothing
    leased or provisional, and the final model's record lists each acknowledged group
    exactly once."""
    problems = []
    unaccounted = s.groups_written - s.acknowledged_groups - s.stale_groups_dropped - s.queued_groups
    if s.acknowledged_groups < min_groups:
        problems.append(f"only {s.acknowledged_groups} groups acknowledged, expected at least {min_groups}")
    if unaccounted:
        problems.append(
            f"{s.groups_written} groups written, but {s.acknowledged_groups} acknowledged, "
            f"{s.stale_groups_dropped} dropped as stale and {s.queued_groups} queued"
        )
    if s.queued_groups and not queued_ok:
        problems.append(f"{s.queued_groups} groups still queued")
    if s.dead_letter_groups:
        problems.append(f"{s.dead_letter_groups} groups dead-lettered (never to be trained)")
    if s.leased_groups or s.expired_lease_groups or s.provisional_groups:
        problems.append(
            f"{s.leased_groups} groups still leased ({s.expired_lease_groups} more in expired leases), "
            f"{s.provisional_groups} still provisional"
        )
    trained = trained_record(stack, run_id)
    twice = sorted(g for g, n in Counter(trained).items() if n > 1)
    if twice:
        problems.append(f"groups trained more than once into the final model: {twice[:10]}")
    if len(set(trained)) != s.acknowledged_groups:
        problems.append(
            f"the final model's record holds {len(set(trained))} groups, the buffer acknowledged {s.acknowledged_groups}"
        )
    return problems


def check_accounting(chaos: Chaos, run_id: str, min_groups: int = 4) -> buffer_pb2.BufferStats:
    # (>= 4: after a trainer restart an iteration may train the groups handed out again)
    s = chaos.stats(run_id)
    problems = accounting_problems(chaos.stack, s, run_id, min_groups)
    assert not problems, problems
    return s


def history_problems(chaos: Chaos, run_id: str, num_rollouts: int) -> list[str]:
    """What is wrong with a finished run's metric history: each RL iteration has a record (a
    step taken again after a trainer restart has one more, marked retaken, and only a repeat
    is; one whose metrics a dying coordinator lost has one marked metrics_lost), and the
    trainer's steps never go back but where a record says it took a step again."""
    records = chaos.api.get(f"/runs/{run_id}/metrics").json()["records"]
    rl = [r for r in records if r.get("rollout_id", 0) > 0 and "step" in r]  # (not the evaluation after RL's)
    problems = []
    if sorted({r["rollout_id"] for r in rl}) != list(range(1, num_rollouts + 1)):
        problems.append(f"RL records {[r['rollout_id'] for r in rl]}: not one per iteration 1..{num_rollouts}")
    for before, after in itertools.pairwise(rl):
        if after["rollout_id"] <= before["rollout_id"] and not after.get("retaken"):
            problems.append(f"rollout {after['rollout_id']} recorded after {before['rollout_id']}, not marked retaken")
    seen = set()
    for r in rl:
        if (r["rollout_id"] in seen) != bool(r.get("retaken")):
            problems.append(
                f"rollout {r['rollout_id']}: marked retaken {bool(r.get('retaken'))}, recorded before {r['rollout_id'] in seen}"
            )
        seen.add(r["rollout_id"])
    if problems:  # (the history, to see why)
        problems.append(str([{k: r.get(k) for k in ("rollout_id", "step", "retaken", "metrics_lost")} for r in rl]))
    return problems


def _closed_run_prompt_problems(stats: dict[bytes, bytes], drawn: int) -> list[str]:
    """A run that ended (CloseRun dropped its per-group sets): by the counts, every prompt
    group drawn was written once, dropped by the filter before it was, or left unfinished
    when the run ended."""
    counts = {k.decode(): int(float(v)) for k, v in stats.items()}
    filtered = sum(n for k, n in counts.items() if k.startswith("dropped:") and k != "dropped:stale")
    # (fully_async's loop hands its unfinished prompts back as the run ends: counted at close)
    accounted = counts.get("groups_written", 0) + filtered + counts.get("unfinished_at_close", 0)
    if accounted < drawn:
        return [f"{drawn - accounted} of {drawn} prompt groups drawn were neither written nor dropped by the filter"]
    if accounted > drawn:
        return [f"{accounted} groups written or filtered, but only {drawn} prompt groups drawn (counted twice)"]
    return []


def prompt_problems(redis_url: str, run_id: str, key_prefix: str = "rlmesh") -> tuple[list[str], int]:
    """Whether every prompt group the run drew (ids g0 .. g<next-1>) is somewhere in the
    buffer's Redis (the keys are described in rlmesh.buffer.store): trained (`acked`),
    dropped with a reason (`discarded`), stored, waiting to resume (`partial_groups`) or
    handed out under a lease (`prompts`): exactly one of them (by the counts, once the run
    ended: see _closed_run_prompt_problems). Also how many are still handed out (a rollout
    killed while holding them: they come back when their lease expires)."""
    base = f"{key_prefix}:run:{run_id}:"
    client = redis.Redis.from_url(redis_url)
    try:
        drawn = int(client.hget(base + "cursor", "__groups__") or 0)
        if client.exists(base + "closed"):
            return _closed_run_prompt_problems(client.hgetall(base + "stats"), drawn), 0
        states = {
            "trained": {m.decode() for m in client.smembers(base + "acked")},
            "dropped": {m.decode() for m in client.smembers(base + "discarded")},
            "stored": {m.decode() for m in client.hkeys(base + "groups")},
            "partial": {m.decode() for m in client.hkeys(base + "partial_groups")},
            "handed out": {m.decode() for m in client.hkeys(base + "prompts")},
        }
    finally:
        client.close()
    problems, lost, doubled = [], [], []
    for i in range(drawn):
        where = [name for name, ids in states.items() if f"g{i}" in ids]
        if not where:
            lost.append(f"g{i}")
        elif len(where) > 1:
            doubled.append(f"g{i} ({', '.join(where)})")
    if lost:
        problems.append(f"{len(lost)} of {drawn} prompt groups drawn are nowhere in the buffer: {lost[:10]}")
    if doubled:
        problems.append(f"prompt groups in two states at once: {doubled[:10]}")
    return problems, len(states["handed out"])
