"""The run driver: takes one run through the services, in its lifecycle of an optional SFT
warm start, the evaluation before RL, RL iterations in the run's mode (modes.py) with an
evaluation at the configured interval, the final checkpoint and the evaluation after RL.
Its state is in Redis (store.py), so a restarted coordinator carries on; its calls are
retried through a service's outage (calls.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import grpc
from redis.exceptions import RedisError

from rlmesh.common.errors import FailedPrecondition, NotFound
from rlmesh.common.retry import Backoff, OutageTooLong, retry
from rlmesh.common.run_config import RunConfig
from rlmesh.common.tasks import cancel_and_wait
from rlmesh.coordinator import requests
from rlmesh.coordinator.calls import Clients, RunCalls, StopRequested
from rlmesh.coordinator.colocation import mode_class
from rlmesh.coordinator.config import Settings
from rlmesh.coordinator.modes import RunMode, step_split
from rlmesh.coordinator.observe import CoordinatorMetrics, RunLoggers
from rlmesh.coordinator.off_policy_watch import record_warnings
from rlmesh.coordinator.store import ACTIVE, FINAL, QUEUED, Created, RunStore
from rlmesh.v1 import buffer_pb2, trainer_pb2

log = logging.getLogger(__name__)

# How often a paused run's loop looks whether it was resumed or stopped.
PAUSE_POLL_SECONDS = 0.2


class RunDriver:
    """Drives runs; one run trains at a time (the trainer holds one policy)."""

    def __init__(
        self,
        store: RunStore,
        clients: Clients,
        train_wait_seconds: float,
        max_finished_runs: int = 100,
        settings: Settings | None = None,
        metrics: CoordinatorMetrics | None = None,
    ) -> None:
        self.store = store
        self.clients = clients
        self.train_wait_seconds = train_wait_seconds
        self.max_finished_runs = max_finished_runs
        self.settings = settings or Settings()
        self.backoff = Backoff(self.settings.retry_backoff_base_seconds, self.settings.retry_backoff_max_seconds)
        self.tasks: dict[str, asyncio.Task] = {}
        self.metrics = metrics
        self.run_logs = RunLoggers(self.settings.log_dir, metrics.log_failures if metrics is not None else None)

    async def submit(self, config: RunConfig) -> Created:
        """A new run, started at once when the trainer is free, else queued (Created says which)."""
        created = await self.store.create(config)
        # (after a restart the queue's head may be promoted by this call, even this very run)
        for run_id in {created.id if created.status == "pending" else "", created.promoted} - {""}:
            if run_id not in self.tasks:
                self.start(run_id)
        return created

    async def move(self, run_id: str, position: int) -> int:
        return await self.store.move(run_id, position)

    async def delete(self, run_id: str) -> None:
        """Forget a finished or queued run: its record, metrics and buffer data (checkpoints
        stay on disk)."""
        status = await self.store.status(run_id)
        if status == QUEUED:
            status = await self.store.delete_queued(run_id)
            if status == "deleted":
                return
        if status == "stopping":
            raise FailedPrecondition(f"run {run_id} is stopping; delete it once it has stopped (GET /runs/{run_id})")
        if status not in FINAL:
            raise FailedPrecondition(
                f"run {run_id} is {status}; stop it first (POST /runs/{run_id}/stop), then delete it"
            )
        try:
            await self.clients.buffer.DeleteRun(
                buffer_pb2.DeleteRunRequest(run_id=run_id), timeout=self.settings.call_deadline_seconds
            )
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:
                raise
        await self.store.delete(run_id)

    async def _close_in_buffer(self, run_id: str) -> None:
        """The buffer deletes what only a live run needs (its copies of the datasets, prompts,
        acknowledged ids); after the trainer's EndRun, whose commit of acknowledgments must
        land first. Best effort: what a failed call leaves goes when the run is pruned."""
        try:
            await self.clients.buffer.CloseRun(
                buffer_pb2.CloseRunRequest(run_id=run_id), timeout=self.settings.call_deadline_seconds
            )
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:
                log.warning(
                    "run %s: the buffer could not close it (its data stays until the run is deleted): %s",
                    run_id,
                    e.details(),
                )

    async def _prune(self) -> None:
        """Keep the newest max_finished_runs finished runs."""
        finished = [r["id"] for r in await self.store.list() if r["status"] in FINAL]
        for run_id in finished[: max(len(finished) - self.max_finished_runs, 0)]:
            try:
                await self.delete(run_id)
            except (grpc.aio.AioRpcError, FailedPrecondition, NotFound) as e:
                log.warning("could not delete old run %s: %s", run_id, e)

    def start(self, run_id: str) -> None:
        task = asyncio.create_task(self._drive(run_id), name=f"run-{run_id}")
        self.tasks[run_id] = task
        # A finished run's task is forgotten (the coordinator serves for months, one run after another).
        task.add_done_callback(lambda done: self.tasks.pop(run_id) if self.tasks.get(run_id) is done else None)

    async def resume_active(self) -> None:
        """After a coordinator restart, carry on with runs that were active; with none, start
        the queue's next run (the last run may have ended while this coordinator was down)."""
        for rec in await self.store.list():
            if rec["status"] in ACTIVE and rec["id"] not in self.tasks:
                log.info("resuming run %s at rollout %d", rec["id"], rec["rollout_id"])
                await self.store.reclaim(rec["id"])
                self.start(rec["id"])
        await self._start_next("")

    async def pause(self, run_id: str) -> str:
        """Ask a pending or running run to hold at its next step boundary (what is in flight
        finishes first); idempotent. FailedPrecondition (409) for a stopping or finished run."""
        status = await self.store.transition(run_id, ("pending", "running"), "paused")
        if status != "paused":
            raise FailedPrecondition(f"run {run_id} is {status}; only a pending or running run can be paused")
        return status

    async def resume(self, run_id: str) -> str:
        """Let a paused run carry on; idempotent for a pending or running run.
        FailedPrecondition (409) for a stopping or finished run."""
        status = await self.store.transition(run_id, ("paused",), "running")
        if status not in ("pending", "running"):
            raise FailedPrecondition(f"run {run_id} is {status}; only a paused run can be resumed")
        return status

    async def stop(self, run_id: str) -> str:
        """Ask an active run to stop; a finished one answers its final status (atomically: a
        run that finishes at this moment is not left 'stopping' forever)."""
        return await self.store.mark_stopping(run_id)

    async def close(self) -> None:
        await asyncio.gather(*(cancel_and_wait(t) for t in self.tasks.values()))
        await self.run_logs.close_all()

    async def _append(self, run_id: str, cfg: RunConfig, record: dict) -> None:
        """Keep a metric record (the API serves it) and hand it to the run's loggers."""
        await self.store.append_metrics(run_id, record)
        await self.run_logs.log(run_id, cfg, record)

    # ---- the lifecycle ----------------------------------------------------------------------

    async def _drive(self, run_id: str) -> None:
        """The run from where its record says it stands to its end: completed, stopped or failed."""
        mode: RunMode | None = None
        try:
            rec = await self.store.get(run_id)
            cfg = RunConfig.model_validate(rec["config"])
            calls = RunCalls(
                run_id, cfg, self.store, self.clients, self.settings, self.backoff, self.train_wait_seconds
            )
            # (before anything can fail: its end stops what a previous coordinator left running)
            mode = mode_class(cfg)(calls, self.settings.async_heartbeat_seconds)
            if rec["status"] == "stopping":  # stopped while the coordinator was down
                raise StopRequested
            if rec["waiting_for"]:  # (a wait of the coordinator that died: this one says it again if it waits)
                await self.store.update(run_id, waiting_for="")
            await self.store.transition(run_id, ("pending",), "running")  # (a paused run stays paused)
            await self._train(calls, mode, rec["phase"])
            after, error = await self._evaluate_after(calls)
            await self._append(run_id, cfg, {"rollout_id": cfg.num_rollouts, "time": time.time(), **after})
            await self.run_logs.close(run_id)  # (flushed before the run says it is done)
            await self.store.update(
                run_id, phase="done", status="completed", eval_after=after, error=error, waiting_for=""
            )
            await self._end(run_id, mode)
        except StopRequested:
            await self._record_end(run_id, mode, status="stopped")
        except asyncio.CancelledError:
            if mode is not None:  # coordinator shutting down: the run stays active and resumes on restart
                mode.cancel()
            raise
        except grpc.aio.AioRpcError as e:
            log.error("run %s failed: %s", run_id, e.details())
            await self._record_end(run_id, mode, status="failed", error=f"{e.code().name}: {e.details()}")
        except Exception as e:
            log.exception("run %s failed", run_id)
            await self._record_end(run_id, mode, status="failed", error=f"{type(e).__name__}: {e}")

    async def _record_end(self, run_id: str, mode: RunMode | None, **fields) -> None:
        """The run's end recorded, even through a Redis outage longer than the store's own
        retries (a driver that gave up here left the run 'running' with its claim held until
        the coordinator restarted), then the trainer freed for the next run (_end). The trainer
        ends the run first, so a run that reads stopped (or failed) names its final model."""
        if mode is not None:
            await mode.close()
        calls = mode.calls if mode is not None and fields["status"] == "stopped" else None
        ended = await self._end_in_trainer(run_id, calls)
        if ended is not None:
            fields.update(await self._final_model_fields(run_id, ended))
        fields.setdefault("waiting_for", "")  # (an ended run waits for nothing; `error` says why it failed)
        while True:
            try:
                await self.store.update(run_id, **fields)
                break
            except NotFound:  # (Redis lost it: wiped, or a failover to a replica without it)
                log.error("run %s: its end (%s) cannot be recorded: its record is gone", run_id, fields["status"])
                break
            except RedisError as e:
                log.error("run %s: its end (%s) cannot be recorded yet, Redis fails: %s", run_id, fields["status"], e)
                await asyncio.sleep(self.backoff.max_seconds)
        await self._end(run_id, None)

    async def _train(self, calls: RunCalls, mode: RunMode, phase: str) -> None:
        """The run's train steps in order: the SFT warm start's, the evaluation before RL, then
        RL's iterations, until the trainer's model holds every one in a checkpoint. Where the
        run stands is the trainer's step (the run record's train_steps say which of the run's
        steps it holds): a trainer that restarted from an older checkpoint has the steps after
        it done again, so the final model holds every step of the run, each once."""
        cfg = calls.cfg
        sft_steps, total = cfg.sft_warmup.steps, cfg.sft_warmup.steps + cfg.num_rollouts
        done = await self._realign(calls, await calls.setup(), answered=False)
        await self._record_lost_steps(calls, done)
        step_start = None  # when the RL step under way began: where the one before it ended
        while True:
            if done < sft_steps:
                await mode.settle()  # (RL groups must not reach the warm start's steps)
                if phase != "sft":
                    phase = "sft"
                    await self.store.update(calls.run_id, phase=phase)
                record = await self._sft_step(calls, mode, done)
                done = await self._realign(calls, record["step"])
                await self._append_step(calls, record, done)
            elif phase != "rl":  # (also for a run of no RL iterations)
                phase = await self._start_rl(calls)
            elif done == total:
                # Every step taken: the last ones made durable before the run says it is done
                # (a trainer that lost them takes them again).
                await mode.settle()
                done = await self._finish_training(calls)
                if done == total:
                    return
            else:
                step_start = step_start or time.monotonic()
                if await self._step_boundary(calls, mode):
                    step_start = time.monotonic()  # (the time paused is no step's)
                done, step_start = await self._rl_iteration(calls, mode, done - sft_steps, step_start)

    async def _evaluate_after(self, calls: RunCalls) -> tuple[dict, str]:
        """The evaluation after RL, and what went wrong with it: every step is trained and in a
        checkpoint by now, so an evaluation that cannot be taken does not fail the run."""
        try:
            return await calls.evaluate(), ""
        except (grpc.aio.AioRpcError, OutageTooLong) as e:
            reason = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.aio.AioRpcError) else str(e)
            log.error("run %s: the evaluation after RL failed: %s", calls.run_id, reason)
            return {}, f"the evaluation after RL failed (the run trained every step): {reason}"

    async def _step_boundary(self, calls: RunCalls, mode: RunMode) -> bool:
        """Between steps, where nothing of the run is in flight: stop when asked; while paused,
        hold here (held=1 tells the API the run has come to rest). The mode's background work
        is settled first (fully_async: the continuous generation stops, its unfinished prompts
        go back to the buffer and its finished groups stay queued; it restarts on resume).
        Returns whether the run was paused here."""
        run_id = calls.run_id
        status = await self.store.status(run_id)
        if status == "stopping":
            raise StopRequested
        if status != "paused":
            return False
        log.info("run %s paused", run_id)
        await mode.settle(keep_metrics=True)
        await self.store.update(run_id, held=1)
        while (status := await self.store.status(run_id)) == "paused":
            await asyncio.sleep(PAUSE_POLL_SECONDS)
        await self.store.update(run_id, held=0)
        if status == "stopping":
            raise StopRequested
        log.info("run %s resumed", run_id)
        return True

    async def _rl_iteration(
        self, calls: RunCalls, mode: RunMode, rollout_id: int, step_start: float
    ) -> tuple[int, float]:
        """RL iteration `rollout_id` (0-based), recorded; how many of the run's train steps the
        trainer holds after it, and when its record was complete (where the next step's time
        begins: the bookkeeping after a record counts in the next step's split)."""
        cfg = calls.cfg
        record = await mode.iteration(rollout_id)
        if "buffer/queued_groups" not in record:  # (a mode may have read them during its push)
            record.update(await calls.buffer_metrics())
        if record.get("iteration/seconds"):
            record["iteration/samples_per_second"] = record.get("train/samples", 0.0) / record["iteration/seconds"]
        eval_seconds = 0.0
        if cfg.eval.interval and (rollout_id + 1) % cfg.eval.interval == 0 and rollout_id + 1 < cfg.num_rollouts:
            evaluating = time.monotonic()
            await mode.weights_published()
            record.update(await calls.evaluate())
            eval_seconds = time.monotonic() - evaluating
        end = time.monotonic()
        record.update(step_split(record, end - step_start, eval_seconds))
        # (realigned first: the record is labelled with the step the trainer holds for it)
        done = await self._realign(calls, record["step"])
        record = await self._append_step(calls, record, done)
        await record_warnings(self.store, calls.run_id)
        if self.metrics is not None:
            self.metrics.iteration(cfg.mode, record)
        return done, end

    async def _sft_step(self, calls: RunCalls, mode: RunMode, step: int) -> dict:
        """The warm start's step `step` (0-based); its record ("step": the trainer's step after it)."""
        run_id, cfg = calls.run_id, calls.cfg
        await self._step_boundary(calls, mode)
        batch = cfg.sft_warmup.batch_groups
        await calls.generate(batch, lambda missing, _: requests.sft_rollout_request(run_id, cfg, step, missing))
        r = await calls.train_step(
            trainer_pb2.TrainStepRequest(
                run_id=run_id, num_groups=batch, wait_seconds=self.train_wait_seconds, loss="sft"
            )
        )
        return {
            "sft_step": step + 1,
            "time": time.time(),
            "step": r.step,
            **{f"sft/{k}": v for k, v in r.metrics.items()},
        }

    async def _append_step(self, calls: RunCalls, record: dict, position: int) -> dict:
        """A train step's record, labelled with the step of the run the trainer holds for it (one
        found taken after its answer was lost has no metrics: it says so)."""
        if not record.get("step"):
            record = {**record, "step": calls.trainer_step or 0, "metrics_lost": 1}
        record = at_position(record, position, calls.cfg.sft_warmup.steps, retaken=position <= calls.recorded)
        await self._append(calls.run_id, calls.cfg, record)
        calls.recorded = max(calls.recorded, position)
        return record

    async def _record_lost_steps(self, calls: RunCalls, done: int) -> None:
        """Steps the trainer holds that no record stands for (their coordinator died after the
        trainer took them, before it recorded them) get a record each, marked metrics_lost,
        so that the run's history has every step it holds."""
        run_id, sft_steps = calls.run_id, calls.cfg.sft_warmup.steps
        positions = [record_position(record, sft_steps) for record in await self.store.metrics(run_id)]
        # (after a step taken again, the newest record is not the furthest: those up to it are retaken)
        newest, calls.recorded = (positions[-1], max(positions)) if positions else (0, 0)
        steps = await self.store.train_steps(run_id)
        for position in range(newest + 1, min(done, len(steps)) + 1):
            await self._append_step(
                calls, {"time": time.time(), "step": steps[position - 1], "metrics_lost": 1}, position
            )

    async def _start_rl(self, calls: RunCalls) -> str:
        """Between the warm start and RL: the engines get the warm-started weights, and the
        evaluation before RL is taken (once: a warm start trained again after a trainer
        restart is not measured twice)."""
        run_id, cfg = calls.run_id, calls.cfg
        if cfg.sft_warmup.steps:
            await calls.publish()
        if not (await self.store.get(run_id))["eval_before"]:
            before = await calls.evaluate()
            await self.store.update(run_id, eval_before=before)
            await self._append(run_id, cfg, {"rollout_id": 0, "time": time.time(), **before})
        await self.store.update(run_id, phase="rl")
        return "rl"

    async def _finish_training(self, calls: RunCalls) -> int:
        """The trainer's last steps written to a checkpoint and their acknowledgments made final
        (EndRun), as a run that completes promises; returns how many of the run's train steps
        the trainer held then. Fewer than all when it restarted from an older checkpoint since
        the last step: it is set up again (from that checkpoint) to take the rest."""
        status = await calls.end_run()
        if fields := await self._final_model_fields(calls.run_id, status):
            await self.store.update(calls.run_id, **fields)
        done = await self._realign(calls, status.step, answered=False)
        if done < calls.cfg.sft_warmup.steps + calls.cfg.num_rollouts:
            await calls.set_up_trainer()
            await calls.publish()
        return done

    async def _realign(self, calls: RunCalls, step: int, answered: bool = True) -> int:
        """Record where the trainer stands: at `step`, the answer of the run's latest train step
        (`answered`) or of InitRun; returns how many of the run's train steps (SFT, then RL
        iterations) its model holds. A step's answer is not trusted when the trainer was set
        up again meanwhile (it may have resumed from an older checkpoint) or was lost (0):
        the trainer is asked."""
        run_id = calls.run_id
        if answered and (calls.trainer_reset or not step):
            calls.trainer_reset = False
            step, answered = (await calls.trainer_status()).step, False
        # (the rule of steps_after_train_step / steps_held, applied in Redis to the run's list)
        before, after = await self.store.realign(run_id, step, answered)
        if after < before:
            log.warning(
                "run %s: the trainer stands at step %d: the run's train steps from number %d on are taken "
                "again (the groups they trained are handed out again)",
                run_id,
                step,
                after + 1,
            )
        return after

    async def _final_model_fields(self, run_id: str, ended: trainer_pb2.TrainerStatus) -> dict:
        """What the run's record says of its final model after EndRun: where it is, or a warning
        saying why there is none."""
        if ended.final_model:
            return {"final_model": ended.final_model}
        if not ended.final_model_problem:
            return {}
        log.warning("run %s: no final model: %s", run_id, ended.final_model_problem)
        try:
            warnings = (await self.store.get(run_id))["warnings"]
        except (RedisError, NotFound):  # (the run's log has said it)
            return {}
        return {"warnings": [*warnings, f"no final model: {ended.final_model_problem}"]}

    async def _end_in_trainer(self, run_id: str, stopping: RunCalls | None = None) -> trainer_pb2.TrainerStatus | None:
        """EndRun (the trainer writes the final model and lets the run go); its answer, None
        when it failed. A run that stops (`stopping`: its calls) keeps its model whatever the
        trainer is doing: a trainer down or restarting is waited for (up to
        stop_trainer_wait_seconds), and one that lost the run (restarted) is set up again,
        from its last checkpoint, to write it."""

        def end() -> Awaitable[trainer_pb2.TrainerStatus]:
            return self.clients.trainer.EndRun(
                trainer_pb2.EndRunRequest(run_id=run_id), timeout=self.settings.setup_deadline_seconds
            )

        async def on_wait(reason: str) -> None:
            log.warning("run %s stops: waiting for the trainer to write its final model: %s", run_id, reason)
            await self.store.update(run_id, waiting_for=f"the trainer, to write the final model ({reason})")

        try:
            if stopping is None:
                return await end()
            status = await retry(
                lambda: self._end_lost_run(stopping, end),
                service=stopping.service("trainer"),
                budget_seconds=min(stopping.cfg.max_outage_seconds, self.settings.stop_trainer_wait_seconds),
                on_wait=on_wait,
                backoff=self.backoff,
            )
        except (grpc.aio.AioRpcError, OutageTooLong) as e:
            log.warning("EndRun for %s: %s", run_id, e.details() if isinstance(e, grpc.aio.AioRpcError) else e)
            return None
        await self._hold_final_steps(stopping, status.step)
        return status

    async def _end_lost_run(
        self, calls: RunCalls, end: Callable[[], Awaitable[trainer_pb2.TrainerStatus]]
    ) -> trainer_pb2.TrainerStatus:
        """EndRun; a trainer that lost a run it had trained (it restarted) is set up again first."""
        try:
            return await end()
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND or not await self.store.train_steps(calls.run_id):
                raise
        log.warning(
            "run %s stops: the trainer lost it (restarted); set up again to write its final model", calls.run_id
        )
        await calls.init_trainer()
        return await end()

    async def _hold_final_steps(self, calls: RunCalls, step: int) -> None:
        """A stopped run's train steps and history made those its final model (the trainer at
        `step`) holds: a step the trainer took after the last record (whose coordinator died
        first) is added, steps a restarted trainer lost are dropped."""
        try:
            await self._record_lost_steps(calls, await self._realign(calls, step, answered=False))
        except RedisError as e:  # (the run's end is recorded all the same)
            log.warning("run %s: its train steps could not be realigned to its final model: %s", calls.run_id, e)

    async def _end(self, run_id: str, mode: RunMode | None) -> None:
        if mode is not None:
            await mode.close()
        await self._close_in_buffer(run_id)
        await self._start_next(run_id)
        await self.run_logs.close(run_id)
        await self._prune()

    async def _start_next(self, ended: str) -> None:
        """The claim released by the run that ended (if any), and the queue's next run
        started when no run is active: one script in the store, so no submission comes between."""
        promoted = await self.store.release_and_promote(ended)
        if promoted and promoted not in self.tasks:
            log.info("run %s starts (it was first in the queue)", promoted)
            self.start(promoted)


def record_position(record: dict, sft_steps: int) -> int:
    """The run's train step (counted as at_position counts) a metric record stands for."""
    return record.get("sft_step") or sft_steps + record.get("rollout_id", 0)


def at_position(record: dict, position: int, sft_steps: int, retaken: bool = False) -> dict:
    """A train step's record labelled with the run's train step the trainer holds for it
    (`position`, counted over the warm start's steps, then RL's), marked `retaken` when that
    step was recorded before (the trainer went back: it restarted from an older checkpoint,
    and the steps after it are taken again)."""
    key, value = ("sft_step", position) if position <= sft_steps else ("rollout_id", position - sft_steps)
    labelled = {k: v for k, v in record.items() if k not in ("sft_step", "rollout_id")}
    return {key: value, **labelled, **({"retaken": 1} if retaken else {})}


# The run's train steps: the trainer's step after each of the run's train steps (SFT steps,
# then RL iterations), oldest first, nondecreasing. Checkpoints are taken only between train
# steps, so a trainer that resumed from one stands where one of them ended. The store keeps
# them as a Redis list and applies these rules there (RunStore.realign); these are the rules.


def steps_after_train_step(train_steps: list[int], step: int) -> list[int]:
    """A train step answered that it left the trainer at `step` (the same step as the one
    before when it trained nothing)."""
    return [s for s in train_steps if s <= step] + [step]


def steps_held(train_steps: list[int], step: int) -> list[int]:
    """The train steps that a trainer found standing at `step` holds: those that ended at or
    before it (later ones were undone by a resume), plus one whose answer was lost if the
    trainer stands past every recorded one."""
    held = [s for s in train_steps if s <= step]
    return held + [step] if step > max(held, default=0) else held
