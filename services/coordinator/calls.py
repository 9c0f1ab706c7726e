"""One run's calls to the services. Each has a deadline and is retried with backoff while
its service is unavailable, restarting or past the deadline, for up to the run's
max_outage_seconds (the run record's waiting_for says what the run waits for); a trainer
that lost the run (it restarted) is set up again before the call is retried."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc

from rlmesh.common.retry import Backoff, OutageTooLong, retry, transient_grpc_error
from rlmesh.common.run_config import RunConfig, oldest_weight_version
from rlmesh.coordinator import requests
from rlmesh.coordinator.config import Settings
from rlmesh.coordinator.engine_control import EngineControl
from rlmesh.coordinator.store import RunStore
from rlmesh.v1 import buffer_pb2, buffer_pb2_grpc, rollout_pb2, rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc

log = logging.getLogger(__name__)
T = TypeVar("T")

# A train step asks the trainer for its batch with waits this long, acting between them.
BATCH_POLL_SECONDS = 5.0
# While a long call is under way its service is asked this often, with this deadline, what
# it waits for: an outage is named within a minute wherever it is absorbed.
WATCH_SECONDS = 10.0
PROBE_DEADLINE_SECONDS = 10.0


@dataclass
class Clients:
    buffer: buffer_pb2_grpc.BufferStub
    rollout: rollout_pb2_grpc.RolloutStub
    trainer: trainer_pb2_grpc.TrainerStub


class StopRequested(Exception):
    pass


class _StepInFlight(Exception):
    """A failed TrainStep's batch is still leased: its step may yet finish (and be
    acknowledged), or the lease expires and the groups are queued again."""


class _TrainerLostRun(Exception):
    """The trainer answered NOT_FOUND for the run (it restarted): the run was set up on it again."""


class _EnginesWereBehind(Exception):
    """The rollout service found the engines on older weights than the run's (they restarted
    on their base weights): the trainer's weights were pushed to them again."""


def _transient(e: BaseException) -> str | None:
    """Why a failed call is worth retrying (a peer down, restarting or past its deadline; a
    step still in flight; a trainer set up again; engines brought up to date), or None."""
    if isinstance(e, (_StepInFlight, _TrainerLostRun, _EnginesWereBehind)):
        return str(e)
    return transient_grpc_error(e)


def _push_metrics(version: int, r: trainer_pb2.PublishWeightsResponse) -> dict:
    return {"weights/version": version, "weights/seconds": r.seconds, "weights/bytes": r.bytes}


class RunCalls:
    """The calls of run `run_id` (config `cfg`), each retried through its service's outage."""

    def __init__(
        self,
        run_id: str,
        cfg: RunConfig,
        store: RunStore,
        clients: Clients,
        settings: Settings,
        backoff: Backoff,
        train_wait_seconds: float,
    ) -> None:
        self.run_id = run_id
        self.cfg = cfg
        self.store = store
        self.clients = clients
        self.settings = settings
        self.backoff = backoff
        self.train_wait_seconds = train_wait_seconds
        # Set up again on a restarted trainer since the run's last train step: that step's
        # answer is not where the trainer stands.
        self.trainer_reset = False
        self.trainer_step: int | None = None  # the trainer's step at its last answer (None: not known)
        self.recorded = 0  # the newest of the run's train steps (SFT, then RL) its metric records stand for
        self.engines = EngineControl(clients.rollout, run_id, settings.call_deadline_seconds, self.rollout_call)

    def service(self, name: str) -> str:
        return f"{name} at {getattr(self.settings, name + '_address')}"

    def deadline(self, groups: int = 0) -> float:
        """A generation, evaluation or train call's deadline: a base plus an allowance per group."""
        return self.settings.work_deadline_seconds + self.settings.per_group_deadline_seconds * groups

    async def check_stop(self) -> None:
        if await self.store.status(self.run_id) == "stopping":
            raise StopRequested

    async def patiently(self, service: str, call: Callable[[], Awaitable]):
        """call(), retried with backoff while `service` is unavailable or past a deadline, for
        up to the run's max_outage_seconds; meanwhile the run record's waiting_for says why."""
        waited = False

        async def on_wait(reason: str) -> None:
            nonlocal waited
            waited = True
            log.warning("run %s: %s", self.run_id, reason)
            await self.store.update(self.run_id, waiting_for=reason)
            await self.check_stop()  # a stop request ends the wait

        try:
            return await retry(
                call,
                service=service,
                budget_seconds=self.cfg.max_outage_seconds,
                transient=_transient,
                on_wait=on_wait,
                backoff=self.backoff,
            )
        finally:
            if waited:
                await self.store.update(self.run_id, waiting_for="")

    async def watched(self, call: Awaitable[T], service: str, probe: Callable[[], Awaitable[list[str]]]) -> T:
        """A long call (generate, evaluate, train, push). Meanwhile `service` is asked every
        WATCH_SECONDS what it waits for (`probe`) and the run's waiting_for says it: an outage
        it absorbs (its engines or its buffer down) or the service itself not answering
        (frozen, say SIGSTOPped) is named within a minute, not at the call's deadline."""
        task = asyncio.ensure_future(call)
        said = False
        try:
            while not (await asyncio.wait([task], timeout=WATCH_SECONDS))[0]:
                try:
                    reasons = await probe()
                    reason = f"{service}: {'; '.join(reasons)}" if reasons else ""
                except grpc.aio.AioRpcError as e:
                    if e.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
                        continue  # (it answers; say, a version without the probe)
                    reason = f"{service} does not answer ({e.code().name}): stopped, overloaded or cut off?"
                if reason or said:
                    await self.store.update(self.run_id, waiting_for=reason)
                    said = bool(reason)
            return task.result()
        finally:
            task.cancel()  # (nothing, once done)
            if said:
                await self.store.update(self.run_id, waiting_for="")

    async def _rollout_waits(self) -> list[str]:
        reply = await self.clients.rollout.GetWaiting(rollout_pb2.GetWaitingRequest(), timeout=PROBE_DEADLINE_SECONDS)
        return list(reply.reasons)

    async def _trainer_waits(self) -> list[str]:
        request = trainer_pb2.GetStatusRequest(run_id=self.run_id)
        return list((await self.clients.trainer.GetStatus(request, timeout=PROBE_DEADLINE_SECONDS)).waiting_for)

    # ---- the trainer ------------------------------------------------------------------------

    async def on_trainer(self, call: Callable[[], Awaitable]):
        """A trainer call; a trainer that lost the run (restarted) gets it again: InitRun,
        then the engines get its weights, then the call is retried."""
        try:
            return await call()
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:
                raise
            log.warning("run %s: the trainer lost the run (%s); setting it up again", self.run_id, e.details())
            self.trainer_reset = True
            await self.init_trainer()
            await self._publish_once()
            raise _TrainerLostRun(
                f"{self.service('trainer')} had lost the run (restarted?) and was set up again: {e.details()}"
            ) from None

    async def _patient_trainer(self, call: Callable[[], Awaitable]):
        return await self.patiently(self.service("trainer"), lambda: self.on_trainer(call))

    async def init_trainer(self) -> trainer_pb2.TrainerStatus:
        """InitRun. A trainer that still holds a run that has ended (its EndRun never landed:
        the coordinator died first, or the call failed) lets that run go first."""
        status = await self._init_run()
        self.trainer_step = status.step
        return status

    async def _init_run(self) -> trainer_pb2.TrainerStatus:

        def init() -> Awaitable[trainer_pb2.TrainerStatus]:
            request = requests.init_run_request(self.run_id, self.cfg)
            return self.clients.trainer.InitRun(request, timeout=self.settings.setup_deadline_seconds)

        try:
            return await init()
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            held = await self.clients.trainer.GetStatus(
                trainer_pb2.GetStatusRequest(held_run=True), timeout=self.settings.call_deadline_seconds
            )
            if not held.run_id or held.run_id == self.run_id or await self.store.is_active(held.run_id):
                raise
        log.warning(
            "run %s: the trainer still holds run %s, which has ended: ending it there", self.run_id, held.run_id
        )
        await self.clients.trainer.EndRun(
            trainer_pb2.EndRunRequest(run_id=held.run_id), timeout=self.settings.setup_deadline_seconds
        )
        return await init()

    async def setup(self) -> int:
        """The run in the buffer and on the trainer; returns the trainer's step."""
        request = requests.create_run_request(self.run_id, self.cfg)
        await self.patiently(
            self.service("buffer"),
            lambda: self.clients.buffer.CreateRun(request, timeout=self.settings.call_deadline_seconds),
        )
        status = await self.set_up_trainer()
        if self.cfg.source == "environments":  # (the trajectory API refuses ids past it)
            await self.store.update(self.run_id, vocab_size=status.vocab_size)
        if (await self.store.get(self.run_id))["weight_version"] == 0:
            await self.engines.wake()
            # The engines may hold another run's weights: start from the run's own.
            await self.publish()
        else:
            # A run resumed by a new coordinator: a push the last one died in may have left the
            # engines with part of the new weights under the old version's label, and paused (a
            # fully_async loop would generate on them as soon as they continue). The trainer's
            # weights go out again, the engines paused meanwhile, before anything samples (under
            # the same version when nothing was trained since: groups made on it stay fresh).
            await self.engines.resume()
            await self.publish_paused(self.cfg.pause_mode, again=True)
        return status.step

    async def set_up_trainer(self) -> trainer_pb2.TrainerStatus:
        return await self.patiently(self.service("trainer"), self.init_trainer)

    async def trainer_status(self) -> trainer_pb2.TrainerStatus:
        return await self._patient_trainer(
            lambda: self.clients.trainer.GetStatus(
                trainer_pb2.GetStatusRequest(run_id=self.run_id), timeout=self.settings.call_deadline_seconds
            )
        )

    async def end_run(self) -> trainer_pb2.TrainerStatus:
        """EndRun: the trainer's last steps written to a checkpoint and their acknowledgments made final."""
        status = await self._patient_trainer(
            lambda: self.clients.trainer.EndRun(
                trainer_pb2.EndRunRequest(run_id=self.run_id), timeout=self.settings.setup_deadline_seconds
            )
        )
        self.trainer_reset = False  # (its answer is where the trainer stands)
        return status

    async def _publish_once(self, again: bool = False, pause_mode: str = "") -> tuple[dict, bool]:
        version = (await self.store.get(self.run_id))["weight_version"] + 1
        if self.cfg.weight_sync.method == "colocated":
            # In place: the engines' weights must hold memory (they may be released for training).
            await self.engines.memory_occupation(resume=True, tags=["weights"])
        r = await self.watched(
            self.clients.trainer.PublishWeights(
                trainer_pb2.PublishWeightsRequest(
                    run_id=self.run_id, version=version, again=again, pause_mode=pause_mode
                ),
                timeout=self.settings.setup_deadline_seconds,
            ),
            self.service("trainer"),
            self._trainer_waits,
        )
        version = r.version or version  # (again: the last push's, when nothing was trained since)
        await self.store.update(self.run_id, weight_version=version)
        return _push_metrics(version, r), r.engines_continued

    async def publish(self, again: bool = False) -> dict:
        """The trainer's weights to every engine, as the next weight version; its metrics.
        `again` (to engines that fell behind): under the last version if nothing was trained since."""
        metrics, _ = await self._patient_trainer(lambda: self._publish_once(again))
        return metrics

    async def publish_paused(self, pause_mode: str, again: bool = False) -> dict:
        """publish() to generating engines: the trainer pauses them (pause_mode) while it lists
        them and lets them continue once all have the new weights. They are let continue here
        when it did not: a push that failed for good (left paused, trainer.proto) or whose
        continue did not reach them."""
        continued = False
        try:
            metrics, continued = await self._patient_trainer(lambda: self._publish_once(again, pause_mode))
            return metrics
        finally:
            if not continued:
                await self.engines.let_continue(patiently=True)

    async def publish_in_background(self, pause_mode: str) -> tuple[int, float]:
        """PublishWeights(background): the trainer copies its weights and pushes them from the
        copy, the engines paused in pause_mode, while the next step trains. Returns the push's
        version, made the run's by wait_for_push, and how long the trainer took to copy."""

        async def start() -> trainer_pb2.PublishWeightsResponse:
            version = (await self.store.get(self.run_id))["weight_version"] + 1  # (a retry after a reset: anew)
            request = trainer_pb2.PublishWeightsRequest(
                run_id=self.run_id, version=version, pause_mode=pause_mode, background=True
            )
            return await self.clients.trainer.PublishWeights(request, timeout=self.settings.setup_deadline_seconds)

        r = await self._patient_trainer(start)
        return r.version, r.seconds

    async def wait_for_push(self, version: int, pause_mode: str) -> dict:
        """The background push of `version` ended: now the run's weight version; its metrics.
        One that failed, or that the trainer no longer knows (restarted), is pushed again
        at once (publish_paused): the engines may be paused, holding part of it."""

        def wait() -> Awaitable[trainer_pb2.PublishWeightsResponse]:
            request = trainer_pb2.WaitForPushRequest(run_id=self.run_id, version=version)
            return self.clients.trainer.WaitForPush(request, timeout=self.settings.setup_deadline_seconds)

        try:
            r = await self.patiently(
                self.service("trainer"), lambda: self.watched(wait(), self.service("trainer"), self._trainer_waits)
            )
        except grpc.aio.AioRpcError as e:
            log.warning("run %s: %s; pushing the weights again", self.run_id, e.details())
            return await self.publish_paused(pause_mode)
        await self.store.update(self.run_id, weight_version=version)
        if not r.engines_continued:
            await self.engines.let_continue(patiently=True)
        return _push_metrics(version, r)

    async def on_current_engines(self, call: Callable[[], Awaitable]):
        """A generation or evaluation call. When it fails because the engines hold older
        weights than the run's (ABORTED: one restarted on its base weights), the trainer's
        weights are pushed to them again before the call is retried: no sample is ever
        generated on weights the run has left behind."""
        try:
            return await call()
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.ABORTED:
                raise
            log.warning("run %s: %s; pushing the weights again", self.run_id, e.details())
            await self.on_trainer(lambda: self._publish_once(again=True))
            raise _EnginesWereBehind(
                f"the engines held older weights than the run's; pushed again: {e.details()}"
            ) from None

    async def engines_behind(self) -> list[str]:
        """The engines that answer with older weights than the run's last push ('url (version)')."""
        version = (await self.store.get(self.run_id))["weight_version"]
        reply = await self.rollout_call(
            lambda: self.clients.rollout.ListEngines(
                rollout_pb2.ListEnginesRequest(), timeout=self.settings.call_deadline_seconds
            )
        )
        return [
            f"{e.url} (version {e.weight_version})"
            for e in reply.engines
            if e.healthy and (int(e.weight_version) if e.weight_version.isdigit() else 0) < version
        ]

    async def train_step(
        self, request: trainer_pb2.TrainStepRequest, before_retry: Callable[[], Awaitable] | None = None
    ) -> trainer_pb2.TrainStepResponse:
        """A train step, retried only while its batch was not trained: the trainer finishes and
        acknowledges a started step even when the caller is gone. So before a retry, the
        trainer tells whether that step (or its acknowledgment) is still under way (wait), and
        then the buffer whether its batch was acknowledged (nothing queued or leased: done);
        otherwise the step is taken again (`before_retry` first: a restarted trainer set up
        again had the run's weights pushed): a lease left from the failed step is given back by
        the trainer's next step, a dead trainer's by the restarted one set up again."""
        tried, before = False, self.trainer_step
        # (a step found taken answers no step: the run asks the trainer where it stands)

        async def attempt():
            nonlocal tried
            if tried:
                # (past the step it stood at, or, where the buffer holds no other groups (sync), with
                # nothing queued or leased: an async mode's buffer always holds the next batch)
                stood = (await self._wait_for_a_step_in_flight()).step
                self.trainer_step = stood
                stats = await self.stats()
                if (before is not None and stood > before) or not (
                    stats.queued_groups or stats.leased_groups or stats.expired_lease_groups
                ):
                    log.warning("run %s: the interrupted train step was taken (its metrics are lost)", self.run_id)
                    return trainer_pb2.TrainStepResponse()
                if before_retry is not None:
                    await before_retry()
            tried = True
            return await self.on_trainer(
                lambda: self.watched(
                    self.clients.trainer.TrainStep(
                        request, timeout=request.wait_seconds + self.deadline(request.num_groups)
                    ),
                    self.service("trainer"),
                    self._trainer_waits,
                )
            )

        answer = await self.patiently(self.service("trainer"), attempt)
        if answer.step:
            self.trainer_step = answer.step
        return answer

    async def _wait_for_a_step_in_flight(self) -> trainer_pb2.TrainerStatus:
        """The trainer's status once no step of it, nor its acknowledgment, is under way
        (_StepInFlight meanwhile: another TrainStep would take a second step)."""
        status = await self.on_trainer(
            lambda: self.clients.trainer.GetStatus(
                trainer_pb2.GetStatusRequest(run_id=self.run_id), timeout=self.settings.call_deadline_seconds
            )
        )
        if status.unacknowledged_step:
            raise _StepInFlight(
                f"step {status.unacknowledged_step} is trained; waiting for the buffer to take its acknowledgment"
            )
        if status.step_in_flight:
            raise _StepInFlight("the trainer's step is still under way")
        return status

    async def train_batch(
        self,
        on_no_batch: Callable[[], Awaitable[str]] | None = None,
        minimums: Callable[[], Awaitable[dict[str, int]]] | None = None,
        before_retry: Callable[[], Awaitable] | None = None,
    ) -> tuple[trainer_pb2.TrainStepResponse, float]:
        """An RL train step on the next batch; its answer and how long it took. The trainer is
        asked with short waits: between them the mode acts (`on_no_batch`: generate what is
        missing, push weights to engines that fell behind; it says what it found) and the run
        record says what it waits for. `minimums`: the batch's least groups of each dataset,
        asked again at each wait (environments register and leave meanwhile); `before_retry`:
        see train_step. No batch for train_wait_seconds + max_outage_seconds: OutageTooLong."""
        t0 = time.monotonic()
        batch = self.cfg.rollout.rollout_batch_size
        request = trainer_pb2.TrainStepRequest(
            run_id=self.run_id,
            num_groups=batch,
            wait_seconds=min(self.train_wait_seconds, BATCH_POLL_SECONDS),
            answer_without_batch=True,
        )
        give_up = t0 + self.train_wait_seconds + self.cfg.max_outage_seconds
        dropped, waited = 0, False
        try:
            while True:
                if minimums is not None:
                    request.min_groups_by_dataset.clear()
                    request.min_groups_by_dataset.update(await minimums())
                t = await self.train_step(request, before_retry)
                if not t.no_batch:
                    return t, time.monotonic() - t0
                dropped += t.stale_groups_dropped
                stats = await self.stats()
                least = ", ".join(f"{n} of {name}" for name, n in sorted(request.min_groups_by_dataset.items()))
                reason = (
                    f"a full batch of {batch} fresh groups for the trainer"
                    + (f" holding at least {least}" if least else "")
                    + f" ({stats.queued_groups} queued, {dropped} dropped as stale while waiting)"
                )
                found = await on_no_batch() if on_no_batch is not None else ""
                reason += f"; {found}" if found else ""
                if time.monotonic() > give_up:
                    raise OutageTooLong(f"no batch for {time.monotonic() - t0:.0f} s: waited for {reason}")
                waited = True
                await self.store.update(self.run_id, waiting_for=reason)
                await self.check_stop()
        finally:
            if waited:
                await self.store.update(self.run_id, waiting_for="")

    # ---- the rollout service -----------------------------------------------------------------

    async def generate(
        self,
        batch: int,
        request: Callable[[int, int], rollout_pb2.GenerateRolloutRequest],
        oldest: Callable[[int], int] | None = None,
    ) -> rollout_pb2.GenerateRolloutResponse:
        """Generate what the batch still misses (`request(missing, weight_version)`), on engines
        holding the run's weights. Safe to retry: groups an interrupted call wrote stay queued
        and are counted, unless the batch's lease will drop them as too old (`oldest(version)`:
        the oldest weight version it takes; say, groups a restarted trainer's rollback queued
        again); prompts it held are handed back (or their lease expires)."""

        async def attempt():
            version = (await self.store.get(self.run_id))["weight_version"]
            keeps_all = oldest is None or self.cfg.stale_policy == "keep"
            missing = await self.missing_groups(batch, 0 if keeps_all else oldest(version))
            if not missing:
                return rollout_pb2.GenerateRolloutResponse()
            req = request(missing, version)
            return await self.on_current_engines(
                lambda: self.watched(
                    self.clients.rollout.GenerateRollout(
                        req, timeout=self.deadline(missing + req.over_sampling_groups)
                    ),
                    self.service("rollout"),
                    self._rollout_waits,
                )
            )

        return await self.patiently(self.service("rollout"), attempt)

    async def generate_batch(self, batches: int = 1) -> tuple[dict, float]:
        """Generate what the next RL batch misses (or, batches=2, the next two: colocated
        one_step_off); its metrics and how long it took."""
        t0 = time.monotonic()
        cfg = self.cfg
        # The trainer leases this batch with the same bound; one_step_off trains it one version
        # later than the weights it is generated with.
        ahead = int(cfg.mode == "one_step_off")

        def oldest(version: int) -> int:
            return oldest_weight_version(version, cfg.staleness_bound, ahead=ahead)

        g = await self.generate(
            cfg.rollout.rollout_batch_size * batches,
            lambda missing, version: requests.rollout_request(self.run_id, cfg, missing, oldest(version), version),
            oldest,
        )
        return dict(g.metrics), time.monotonic() - t0

    async def rollout_call(self, call: Callable[[], Awaitable]):
        """A quick call to the rollout service, retried through its outage."""
        return await self.patiently(self.service("rollout"), call)

    async def evaluate(self) -> dict:
        """The run's evaluation metrics, each eval dataset's call with a deadline for its size."""
        cfg, out = self.cfg, {}
        rows = (await self.stats()).dataset_rows if not cfg.eval.limit else {}
        for d in cfg.eval_datasets():
            prompts = cfg.eval.limit or rows.get(d.name, 0)

            async def call(dataset: str = d.name, prompts: int = prompts):
                # (read each try: a retry after the engines were brought up to date asks for the new version)
                version = (await self.store.get(self.run_id))["weight_version"]
                request = requests.evaluate_request(self.run_id, cfg, dataset, version)
                return await self.on_current_engines(
                    lambda: self.watched(
                        self.clients.rollout.Evaluate(request, timeout=self.deadline(prompts)),
                        self.service("rollout"),
                        self._rollout_waits,
                    )
                )

            out.update((await self.patiently(self.service("rollout"), call)).metrics)
        return out

    # ---- the buffer ----------------------------------------------------------------------

    async def stats(self, min_weight_version: int = 0) -> buffer_pb2.BufferStats:
        request = buffer_pb2.GetStatsRequest(run_id=self.run_id, min_weight_version=min_weight_version)
        return await self.patiently(
            self.service("buffer"),
            lambda: self.clients.buffer.GetStats(request, timeout=self.settings.call_deadline_seconds),
        )

    async def buffer_metrics(self) -> dict[str, float]:
        """The buffer's depth and what became of groups, for the iteration's record."""
        s = await self.stats()
        out = {
            f"buffer/{name}": float(getattr(s, name))
            for name in (
                "queued_groups",
                "leased_groups",
                "partial_groups",
                "dead_letter_groups",
                "stale_groups_dropped",
                "stale_groups_kept",
                "redelivered_groups",
                "groups_written_per_second",
            )
        }
        out.update({f"buffer/dropped/{reason}": float(n) for reason, n in s.dropped_by_reason.items()})
        return out

    async def missing_groups(self, batch: int, min_weight_version: int = 0) -> int:
        """Groups to generate for a batch: an interrupted iteration (a coordinator restart, a
        failed GenerateRollout) may have written some already (queued, not lost); only the rest.
        Queued groups older than `min_weight_version` (> 0) are not counted: the batch's lease
        drops them."""
        return max(batch - (await self.stats(min_weight_version)).queued_groups_from, 0)
