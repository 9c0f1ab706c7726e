"""The three training modes: how one RL iteration generates, trains and publishes weights.
Each mode owns its iteration and whatever of it runs in the background between iterations:

- sync: generate a batch -> train it -> publish weights;
- one_step_off: train batch k while batch k+1 is generated with the same weights, then
  publish (nothing is in flight then, so the engines need no pause);
- fully_async: the rollout service generates continuously (StartAsyncRollout, kept alive
  by a heartbeat); each iteration trains the next batch, pauses the engines, publishes,
  and lets them continue (weight_sync.background: the push runs beside the next train step).

An iteration returns the iteration's metric record; the run driver adds the buffer's and
the evaluation's figures and keeps it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import TypeVar

import grpc

from rlmesh.common.metrics import merge_sample_metrics
from rlmesh.common.retry import OutageTooLong
from rlmesh.common.run_config import oldest_weight_version
from rlmesh.common.tasks import cancel_and_wait
from rlmesh.coordinator import requests
from rlmesh.coordinator.calls import RunCalls, StopRequested
from rlmesh.coordinator.trajectory import Environment, batch_minimums
from rlmesh.v1 import rollout_pb2, trainer_pb2

log = logging.getLogger(__name__)
T = TypeVar("T")
U = TypeVar("U")

# one_step_off: how often to look whether the train step has leased its batch.
LEASE_POLL_SECONDS = 0.05


# The parts of a step's time the split names (docs/metrics.md); the run driver adds "other".
SPLIT = ("generate", "reward", "train", "update")


def iteration_record(
    rollout_id: int,
    generation: dict,
    train: trainer_pb2.TrainStepResponse,
    weights: dict,
    phases: dict[str, float],
    started: float,
    waited: dict[str, float],
) -> dict:
    """`waited`: how long the iteration waited on each part of SPLIT, for the step's time
    split. Unless given, reward is taken out of generate: the rollout's wait for rewards
    (rollout/reward_seconds) is part of its generate call, other groups generating meanwhile."""
    record = {
        "rollout_id": rollout_id + 1,
        "time": time.time(),
        "step": train.step,
        **generation,
        **{f"train/{k}": v for k, v in train.metrics.items()},
        **weights,
        **{f"phase/{k}_seconds": v for k, v in phases.items()},
        "iteration/seconds": time.monotonic() - started,
    }
    generate = waited.get("generate", 0.0)
    reward = waited.get("reward", min(float(generation.get("rollout/reward_seconds", 0.0)), generate))
    split = {"generate": generate - reward, "reward": reward, "train": waited.get("train", 0.0)}
    split["update"] = waited.get("update", 0.0)
    record.update({f"split/{k}_seconds": split[k] for k in SPLIT})
    return record


async def alongside(main: Awaitable[T], side: Awaitable[U]) -> tuple[T, U]:
    """Both at once (two round trips that need not wait for each other); if main fails,
    side is cancelled."""
    task = asyncio.ensure_future(side)
    try:
        result = await main
    except BaseException:
        task.cancel()
        raise
    return result, await task


async def publish_and_buffer_metrics(calls: RunCalls) -> tuple[dict, dict]:
    """The push, and the buffer's figures for the record read meanwhile: nothing generates
    during a push in these modes, so the buffer stands as it will after it."""
    return await alongside(calls.publish(), calls.buffer_metrics())


def step_split(record: dict, step_seconds: float, eval_seconds: float) -> dict:
    """The rest of a step's time split: its wall time (from where the step before it ended),
    an evaluation taken in it, and "other": the time in none of the parts (the calls and
    bookkeeping between them)."""
    parts = sum(record.get(f"split/{k}_seconds", 0.0) for k in SPLIT) + eval_seconds
    other = max(step_seconds - parts, 0.0)
    out = {"split/step_seconds": step_seconds, "split/other_seconds": other}
    out["split/other_fraction"] = other / step_seconds if step_seconds > 0 else 0.0
    if eval_seconds:
        out["split/eval_seconds"] = eval_seconds
    return out


class RunMode:
    """How a run's RL iterations go; the hooks say what of it runs in the background between
    iterations (nothing, unless a mode says otherwise)."""

    def __init__(self, calls: RunCalls, heartbeat_seconds: float) -> None:
        self.calls = calls
        self.heartbeat_seconds = heartbeat_seconds

    async def iteration(self, rollout_id: int) -> dict:
        """RL iteration `rollout_id` (0-based): its metric record."""
        raise NotImplementedError

    async def on_no_batch(self) -> str:
        """The trainer found no full batch of fresh groups within a short wait (say, a
        restart's rollback requeued groups that are now too old, and they were dropped as
        stale): generate what is missing. Returns what it did, for the run's waiting_for."""
        stats = await self.calls.stats()
        # (an expired lease's groups are queued again by the next lease)
        held = stats.queued_groups + stats.leased_groups + stats.expired_lease_groups
        if held >= self.calls.cfg.rollout.rollout_batch_size:
            return ""
        await self.calls.generate_batch()
        return "generated the missing groups"

    async def settle(self, keep_metrics: bool = False) -> None:
        """Between steps (a pause, the warm start's steps, the end of training): nothing of the
        run generates in the background; keep_metrics keeps what it measured for the next
        iteration's record."""

    async def weights_published(self) -> None:
        """Before an evaluation between steps: the engines hold the weights of the last step's
        push (a mode that pushes in the background waits for it)."""

    async def close(self) -> None:
        """The run ends (stopped or failed): background work stopped, best effort."""

    def cancel(self) -> None:
        """The coordinator shuts down: background tasks cancelled, nothing asked of the services
        (the run stays active and resumes on restart)."""


class SyncMode(RunMode):
    async def iteration(self, rollout_id: int) -> dict:
        t0 = time.monotonic()
        generation, generate_seconds = await self.calls.generate_batch()
        t, train_seconds = await self.calls.train_batch(self.on_no_batch)
        t1 = time.monotonic()
        w, buffer = await publish_and_buffer_metrics(self.calls)
        phases = {"generate": generate_seconds, "train": train_seconds}
        waited = {**phases, "update": time.monotonic() - t1}
        return {**iteration_record(rollout_id, generation, t, w, phases, t0, waited), **buffer}


class OneStepOffMode(RunMode):
    def __init__(self, calls: RunCalls, heartbeat_seconds: float) -> None:
        super().__init__(calls, heartbeat_seconds)
        self.upcoming: asyncio.Task | None = None  # the next batch's generation, finished by the iteration's end

    async def iteration(self, rollout_id: int) -> dict:
        """Train batch k while batch k+1 is generated with the same weights (it starts once
        batch k is leased, so it cannot count k's groups as its own); publish after both."""
        t0 = time.monotonic()
        generating, self.upcoming = self.upcoming, None
        generation, generate_seconds = await generating if generating else await self.calls.generate_batch()
        waited_generate = time.monotonic() - t0  # (what of the batch's generation the step waited for)
        training = asyncio.create_task(self.calls.train_batch(self.on_no_batch))
        upcoming = None
        try:
            if rollout_id + 1 < self.calls.cfg.num_rollouts:
                await self._leased_or_done(training)
                upcoming = asyncio.create_task(self.calls.generate_batch())
            t, train_seconds = await training
            t1 = time.monotonic()
            if upcoming is not None:
                await asyncio.wait([upcoming])  # weights change only when nothing is generating
            waited_generate += time.monotonic() - t1
        except BaseException:
            for task in (training, upcoming):
                if task is not None:
                    task.cancel()
            raise
        self.upcoming = upcoming
        t2 = time.monotonic()
        w, buffer = await publish_and_buffer_metrics(self.calls)
        waited = {"generate": waited_generate, "train": train_seconds, "update": time.monotonic() - t2}
        phases = {"generate": generate_seconds, "train": train_seconds}
        return {**iteration_record(rollout_id, generation, t, w, phases, t0, waited), **buffer}

    async def _leased_or_done(self, training: asyncio.Task) -> None:
        """Until the train step holds its batch (or has finished)."""
        while not training.done():
            if (await self.calls.stats()).leased_groups:
                return
            await asyncio.wait([training], timeout=LEASE_POLL_SECONDS)

    async def close(self) -> None:
        self.cancel()
        if self.upcoming is not None:
            await asyncio.gather(self.upcoming, return_exceptions=True)
            self.upcoming = None

    def cancel(self) -> None:
        if self.upcoming is not None:
            self.upcoming.cancel()


class FullyAsyncMode(RunMode):
    def __init__(self, calls: RunCalls, heartbeat_seconds: float) -> None:
        super().__init__(calls, heartbeat_seconds)
        self.heartbeat: asyncio.Task | None = None  # while this coordinator keeps the generation running
        # Until stopped once: a previous coordinator of the run may have left its loop running.
        self.loop_may_run = True
        self.generation_metrics: dict[str, float] = {}  # since the last record
        self.loop_error = ""  # what the generation loop last reported going wrong ("" when all is well)
        self.pushing = 0  # the version of the weight push under way in the background (0: none)
        self.pushed_metrics: dict = {}  # of the background push that ended, for the next record

    async def iteration(self, rollout_id: int) -> dict:
        """Train the next batch the continuous generation wrote, then push the new weights
        with the engines paused (pause_mode)."""
        calls = self.calls
        t0 = time.monotonic()
        if self.heartbeat is None:
            self.heartbeat = asyncio.create_task(self._beat(), name=f"heartbeat-{calls.run_id}")
            self.loop_may_run = True
        # StartAsyncRollout (starts the loop, or is a heartbeat that collects its metrics) beside
        # the train call, which waits for its batch anyway; the buffer's figures beside the push.
        (t, train_seconds), _ = await alongside(calls.train_batch(self.on_no_batch), self._start_generation())
        t1 = time.monotonic()
        push = self._push_in_background() if calls.cfg.weight_sync.background else self._push_weights()
        (w, update_seconds), buffer = await alongside(push, calls.buffer_metrics())
        generation, self.generation_metrics = self.generation_metrics, {}
        # The generation runs beside the step: what the step waits for is a full batch, inside
        # its train call (the trainer's own step time is train/seconds).
        compute = min(float(t.metrics.get("seconds", train_seconds)), train_seconds)
        waited = {"generate": train_seconds - compute, "reward": 0.0, "train": compute, "update": update_seconds}
        phases = {"train": train_seconds, "pause": time.monotonic() - t1}
        return {**iteration_record(rollout_id, generation, t, w, phases, t0, waited), **buffer}

    async def _push_weights(self, again: bool = False) -> tuple[dict, float]:
        """The trainer's weights to the engines, paused meanwhile (pause_mode: the trainer
        pauses them while it lists them); its metrics and how long it took."""
        t0 = time.monotonic()
        return await self.calls.publish_paused(self.calls.cfg.pause_mode, again), time.monotonic() - t0

    async def _push_in_background(self) -> tuple[dict, float]:
        """weight_sync.background: the push the previous iteration started (it ran beside this
        iteration's train step) has ended, then this iteration's starts. The metrics are those
        of the push that ended, and the copy's time; the time is what the iteration waited."""
        t0 = time.monotonic()
        await self.weights_published()
        weights, self.pushed_metrics = self.pushed_metrics, {}
        self.pushing, copy_seconds = await self.calls.publish_in_background(self.calls.cfg.pause_mode)
        return {**weights, "weights/copy_seconds": copy_seconds}, time.monotonic() - t0

    async def weights_published(self) -> None:
        """The background push under way, if any, has ended (pushed again if it failed); its
        metrics are kept for the next record."""
        version, self.pushing = self.pushing, 0
        if version:
            self.pushed_metrics = await self.calls.wait_for_push(version, self.calls.cfg.pause_mode)

    async def on_no_batch(self) -> str:
        """No full batch yet. Engines that restarted on their base weights generate nothing
        the trainer would keep (the loop refuses them), and no push would ever come, since
        pushes follow train steps: push the weights to them now. Otherwise say what the
        generation loop reports. A background push under way ends first: one a restarted
        trainer lost left the engines paused, and they generate nothing until pushed again."""
        if self.pushing:
            await self.weights_published()
            return "waited for the weight push under way (pushed again if it failed)"
        behind = await self.calls.engines_behind()
        if behind:
            await self._push_weights(again=True)
            return f"engines behind the run's weights ({', '.join(behind)}) were pushed the weights again"
        return f"the generation loop reports: {self.loop_error}" if self.loop_error else ""

    async def _start_generation(self) -> None:
        """StartAsyncRollout: starts the run's generation loop, or (already running) is a
        heartbeat; either way it returns the loop's metrics since the previous call. It
        carries the run's weight version (engines behind it take no sample) and the oldest
        version a partial group may have begun under (older ones start over)."""
        calls = self.calls
        version = (await calls.store.get(calls.run_id))["weight_version"]
        request = requests.rollout_request(
            calls.run_id,
            calls.cfg,
            calls.cfg.rollout.rollout_batch_size,
            oldest_weight_version(version, calls.cfg.staleness_bound),
            version,
        )
        r = await calls.rollout_call(
            lambda: calls.clients.rollout.StartAsyncRollout(request, timeout=calls.settings.call_deadline_seconds)
        )
        self._collect(r)

    def _collect(self, reply: rollout_pb2.AsyncRolloutResponse) -> None:
        self.loop_error = reply.error
        if reply.error:
            log.warning("run %s: the rollout service's generation loop reports: %s", self.calls.run_id, reply.error)
        merge_sample_metrics(self.generation_metrics, dict(reply.metrics), "rollout/samples")

    async def _beat(self) -> None:
        """Keeps the generation loop running while the run waits on other services: a
        restarted rollout service gets its loop back within a heartbeat."""
        while True:
            await asyncio.sleep(self.heartbeat_seconds)
            try:
                await self._start_generation()
            except (StopRequested, grpc.aio.AioRpcError, OutageTooLong) as e:
                log.warning("run %s: generation heartbeat: %s", self.calls.run_id, e)

    async def settle(self, keep_metrics: bool = False) -> None:
        """The continuous generation stopped: its unfinished prompts go back to the buffer and
        its finished groups stay queued, so nothing is lost; the next iteration restarts it.
        A weight push under way in the background ends first."""
        await self.weights_published()
        await self._stop_generation(patiently=True)
        if not keep_metrics:  # (a pause keeps them for the next iteration's record)
            self.generation_metrics = {}

    async def close(self) -> None:
        # Best effort: the run is ending anyway, and a rollout service that is down has no loop
        # to stop. First the engines continue: a push cut short (a run stopped while its
        # coordinator was down ends here without a setup) left them paused, and the loop's
        # requests in flight finish, or return to the buffer, only on running engines. (A push
        # under way in the background ends there before the trainer lets the run go.)
        self.pushing = 0
        await self.calls.engines.let_continue()
        await self._stop_generation(patiently=False)

    def cancel(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.cancel()

    async def _stop_generation(self, patiently: bool) -> None:
        if not self.loop_may_run:
            return
        if self.heartbeat is not None:
            await cancel_and_wait(self.heartbeat)
        calls = self.calls

        def call():
            return calls.clients.rollout.StopAsyncRollout(
                rollout_pb2.StopAsyncRolloutRequest(run_id=calls.run_id), timeout=calls.settings.call_deadline_seconds
            )

        try:
            self._collect(await (calls.rollout_call(call) if patiently else call()))
        except grpc.aio.AioRpcError as e:
            log.warning("run %s: could not stop the generation loop: %s", calls.run_id, e.details())
        # (not when the wait above ended otherwise, say by a stop request: close() tries once more)
        self.heartbeat, self.loop_may_run = None, False


class EnvironmentsMode(FullyAsyncMode):
    """source: environments. Atropos-compatible environments generate on the engines and
    post scored groups to the trajectory API, which writes them to the buffer; nothing here
    generates. Each iteration trains the next full batch, holding each environment's
    min_batch_allocation (the buffer's lease makes it, as Atropos's /batch does), and pushes
    the new weights with the engines paused (pause_mode), as fully_async does."""

    async def iteration(self, rollout_id: int) -> dict:
        t0 = time.monotonic()
        t, train_seconds = await self.calls.train_batch(self.on_no_batch, self._minimums)
        t1 = time.monotonic()
        w, update_seconds = await self._push_weights()
        # The environments generate beside the step: what it waits for is a full batch.
        compute = min(float(t.metrics.get("seconds", train_seconds)), train_seconds)
        waited = {"generate": train_seconds - compute, "reward": 0.0, "train": compute, "update": update_seconds}
        phases = {"train": train_seconds, "pause": time.monotonic() - t1}
        return iteration_record(rollout_id, {}, t, w, phases, t0, waited)

    async def _minimums(self) -> dict[str, int]:
        store, run_id, cfg = self.calls.store, self.calls.run_id, self.calls.cfg
        envs = [Environment.from_json(raw) for raw in await store.environments(run_id)]
        seen = await store.environments_seen(run_id)
        return batch_minimums(envs, cfg.rollout.rollout_batch_size, seen, cfg.environments.silent_after_seconds)

    async def on_no_batch(self) -> str:
        found = await super().on_no_batch()
        return found or "scored groups from the environments (posted to the run's trajectory API)"

    async def settle(self, keep_metrics: bool = False) -> None:
        """Nothing of rlmesh's generates for the run (environments keep posting; their groups queue)."""

    async def close(self) -> None:
        pass

    def cancel(self) -> None:
        pass


MODES: dict[str, type[RunMode]] = {
    "sync": SyncMode,
    "one_step_off": OneStepOffMode,
    "fully_async": FullyAsyncMode,
}
