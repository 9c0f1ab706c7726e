"""Runs: their state in Redis (so a restarted coordinator carries on) and the loop that
drives one run through the services: optional SFT warm start, evaluation, then RL
iterations in the run's mode, evaluating at the configured interval:

- sync: generate a batch -> train it -> publish weights;
- one_step_off: train batch k while batch k+1 is generated with the same weights, then
  publish (nothing is in flight then, so the engines need no pause);
- fully_async: the rollout service generates continuously (StartAsyncRollout, kept alive
  by a heartbeat); each iteration trains the next batch, pauses the engines, publishes,
  and lets them continue."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
import redis.asyncio as aioredis

from rlmesh.common.dataset_spec import dataset_to_proto
from rlmesh.common.errors import FailedPrecondition, NotFound
from rlmesh.common.metrics import merge_sample_metrics
from rlmesh.common.retry import Backoff, OutageTooLong, retry, transient_grpc_error
from rlmesh.common.run_config import RunConfig
from rlmesh.common.sampling import sampling_to_proto
from rlmesh.coordinator.config import Settings
from rlmesh.coordinator.observe import CoordinatorMetrics, RunLoggers
from rlmesh.v1 import (
    buffer_pb2,
    buffer_pb2_grpc,
    reward_pb2,
    rollout_pb2,
    rollout_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)

log = logging.getLogger(__name__)

ACTIVE = ("pending", "running", "paused", "stopping")
# one_step_off: how often to look whether the train step has leased its batch.
LEASE_POLL_SECONDS = 0.05
FINAL = ("completed", "stopped", "failed")
# How often a paused run's loop looks whether it was resumed or stopped.
PAUSE_POLL_SECONDS = 0.2


# Compare-and-delete: release the active-run claim only if this run holds it.
_RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


# Set status 'stopping' unless the run has finished; returns the status it now has.
_MARK_STOPPING = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return false end
for i = 1, #ARGV - 1 do if status == ARGV[i] then return status end end
redis.call('HSET', KEYS[1], 'status', 'stopping', 'updated_at', ARGV[#ARGV])
return 'stopping'
"""

# Set status ARGV[#ARGV - 1] if the status is one of ARGV[1 .. #ARGV - 2]; returns the status
# the run now has (false: no such run).
_TRANSITION = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return false end
for i = 1, #ARGV - 2 do
  if status == ARGV[i] then
    redis.call('HSET', KEYS[1], 'status', ARGV[#ARGV - 1], 'updated_at', ARGV[#ARGV])
    return ARGV[#ARGV - 1]
  end
end
return status
"""


class RunStore:
    """Run records: hash <prefix>:coord:run:<id>, metric history list ...:metrics, an
    index zset <prefix>:coord:runs (by creation time), and <prefix>:coord:active, the id of
    the one run that may train (claimed atomically, so concurrent submissions cannot both win)."""

    def __init__(self, redis: aioredis.Redis, prefix: str) -> None:
        self.redis = redis
        self.prefix = f"{prefix}:coord:"
        self.active_key = self.prefix + "active"

    def _key(self, run_id: str) -> str:
        return f"{self.prefix}run:{run_id}"

    async def create(self, config: RunConfig) -> str:
        """A new pending run, if no other run is active (else FailedPrecondition, 409)."""
        run_id = uuid.uuid4().hex[:12]
        now = time.time()
        # The record exists before its claim, so a claim whose record is gone is surely stale.
        await self.redis.hset(self._key(run_id), mapping={
            "id": run_id, "name": config.name, "config": config.model_dump_json(), "status": "pending",
            "phase": "setup", "weight_version": 0, "created_at": now, "updated_at": now,
            "error": "", "waiting_for": "", "eval_before": "{}", "eval_after": "{}", "held": 0,
            "train_steps": "[]",
        })
        try:
            await self._claim(run_id)
        except BaseException:
            await self.redis.delete(self._key(run_id))
            raise
        await self.redis.zadd(self.prefix + "runs", {run_id: now})
        return run_id

    async def _claim(self, run_id: str) -> None:
        for _ in range(2):
            if await self.redis.set(self.active_key, run_id, nx=True):
                return
            holder = (await self.redis.get(self.active_key) or b"").decode()
            status = (await self.redis.hget(self._key(holder), "status") or b"").decode()
            if status in ACTIVE:
                raise FailedPrecondition(f"run {holder} is still active; stop it first (one run trains at a time)")
            await self.release(holder)  # a claim left by a coordinator that died as its run ended
        raise FailedPrecondition("another run was submitted at the same moment; try again")

    async def mark_stopping(self, run_id: str) -> str:
        status = await self.redis.eval(_MARK_STOPPING, 1, self._key(run_id), *FINAL, time.time())
        if not status:
            raise NotFound(f"unknown run {run_id!r}")
        return status.decode()

    async def transition(self, run_id: str, from_statuses: tuple[str, ...], to: str) -> str:
        """Atomically set status `to` if the run's status is one of `from_statuses`; returns
        the status it has now (NotFound for an unknown run)."""
        status = await self.redis.eval(_TRANSITION, 1, self._key(run_id), *from_statuses, to, time.time())
        if not status:
            raise NotFound(f"unknown run {run_id!r}")
        return status.decode()

    async def release(self, run_id: str) -> None:
        await self.redis.eval(_RELEASE, 1, self.active_key, run_id)

    async def reclaim(self, run_id: str) -> None:
        """An active run found after a restart holds the claim (state written before claims existed)."""
        await self.redis.set(self.active_key, run_id, nx=True)

    async def active(self) -> tuple[str, RunConfig] | None:
        """The active run (the claim's holder, if still active) and its configuration."""
        holder = (await self.redis.get(self.active_key) or b"").decode()
        if not holder:
            return None
        try:
            rec = await self.get(holder)
        except NotFound:
            return None
        return (holder, RunConfig.model_validate(rec["config"])) if rec["status"] in ACTIVE else None

    async def delete(self, run_id: str) -> None:
        await self.redis.delete(self._key(run_id), self._key(run_id) + ":metrics")
        await self.redis.zrem(self.prefix + "runs", run_id)

    async def get(self, run_id: str) -> dict:
        raw = await self.redis.hgetall(self._key(run_id))
        if not raw:
            raise NotFound(f"unknown run {run_id!r}")
        rec = {k.decode(): v.decode() for k, v in raw.items()}
        rec["weight_version"] = int(rec["weight_version"])
        rec["held"] = rec.get("held", "0") == "1"  # (records written before pausing existed lack it)
        for k in ("created_at", "updated_at"):
            rec[k] = float(rec[k])
        for k in ("config", "eval_before", "eval_after"):
            rec[k] = json.loads(rec[k])
        rec["train_steps"] = json.loads(rec.get("train_steps", "[]"))
        # RL iterations the trainer's model holds (the train steps past the warm start's)
        rec["rollout_id"] = max(len(rec["train_steps"]) - rec["config"]["sft_warmup"]["steps"], 0)
        return rec

    async def update(self, run_id: str, **fields) -> None:
        fields = {k: json.dumps(v) if isinstance(v, (dict, list)) else v for k, v in fields.items()}
        await self.redis.hset(self._key(run_id), mapping={**fields, "updated_at": time.time()})

    async def status(self, run_id: str) -> str:
        s = await self.redis.hget(self._key(run_id), "status")
        if s is None:
            raise NotFound(f"unknown run {run_id!r}")
        return s.decode()

    async def append_metrics(self, run_id: str, record: dict) -> None:
        await self.redis.rpush(self._key(run_id) + ":metrics", json.dumps(record))

    async def metrics_since(self, run_id: str, since: int, limit: int) -> tuple[list[dict], int]:
        """Up to `limit` metric records from position `since` (0 = the first ever written),
        and how many records the run has: the next call's `since` is since + len(records)."""
        key = self._key(run_id) + ":metrics"
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.lrange(key, since, since + limit - 1)
            pipe.llen(key)
            raw, total = await pipe.execute()
        return [json.loads(r) for r in raw], total

    async def metrics(self, run_id: str, last: int | None = None) -> list[dict]:
        """The run's metric records, oldest first; only the newest `last` when given."""
        start = -last if last else 0
        if last == 0:
            return []
        return [json.loads(r) for r in await self.redis.lrange(self._key(run_id) + ":metrics", start, -1)]

    async def list(self) -> list[dict]:
        ids = [r.decode() for r in await self.redis.zrange(self.prefix + "runs", 0, -1)]
        records = []
        for run_id in ids:
            try:
                records.append(await self.get(run_id))
            except NotFound:  # deleted between the two reads
                pass
        return records


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


class RunDriver:
    """Drives runs; one run trains at a time (the trainer holds one policy)."""

    def __init__(self, store: RunStore, clients: Clients, train_wait_seconds: float,
                 max_finished_runs: int = 100, settings: Settings | None = None,
                 metrics: CoordinatorMetrics | None = None) -> None:
        self.store = store
        self.clients = clients
        self.train_wait_seconds = train_wait_seconds
        self.max_finished_runs = max_finished_runs
        self.settings = settings or Settings()
        self.backoff = Backoff(self.settings.retry_backoff_base_seconds, self.settings.retry_backoff_max_seconds)
        self.tasks: dict[str, asyncio.Task] = {}
        self._async_metrics: dict[str, dict[str, float]] = {}  # fully_async: generation metrics since the last record
        self._trainer_reset: set[str] = set()  # runs set up again on a restarted trainer since their last step
        self.metrics = metrics
        self.run_logs = RunLoggers(self.settings.log_dir, metrics.log_failures if metrics is not None else None)

    async def submit(self, config: RunConfig) -> str:
        run_id = await self.store.create(config)
        self.start(run_id)
        return run_id

    async def delete(self, run_id: str) -> None:
        """Forget a finished run: its record, metrics and buffer data (checkpoints stay on disk)."""
        status = await self.store.status(run_id)
        if status not in FINAL:
            raise FailedPrecondition(f"run {run_id} is {status}; stop it first (POST /runs/{run_id}/stop), then delete it")
        try:
            await self.clients.buffer.DeleteRun(buffer_pb2.DeleteRunRequest(run_id=run_id),
                                                timeout=self.settings.call_deadline_seconds)
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:
                raise
        await self.store.delete(run_id)

    async def _prune(self) -> None:
        """Keep the newest max_finished_runs finished runs."""
        finished = [r["id"] for r in await self.store.list() if r["status"] in FINAL]
        for run_id in finished[:max(len(finished) - self.max_finished_runs, 0)]:
            try:
                await self.delete(run_id)
            except (grpc.aio.AioRpcError, FailedPrecondition, NotFound) as e:
                log.warning("could not delete old run %s: %s", run_id, e)

    def start(self, run_id: str) -> None:
        self.tasks[run_id] = asyncio.create_task(self._drive(run_id), name=f"run-{run_id}")

    async def resume_active(self) -> None:
        """After a coordinator restart, carry on with runs that were active."""
        for rec in await self.store.list():
            if rec["status"] in ACTIVE and rec["id"] not in self.tasks:
                log.info("resuming run %s at rollout %d", rec["id"], rec["rollout_id"])
                await self.store.reclaim(rec["id"])
                self.start(rec["id"])

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
        for t in self.tasks.values():
            t.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        await self.run_logs.close_all()

    async def _append(self, run_id: str, cfg: RunConfig, record: dict) -> None:
        """Keep a metric record (the API serves it) and hand it to the run's loggers."""
        await self.store.append_metrics(run_id, record)
        await self.run_logs.log(run_id, cfg, record)

    # ---- the loop -----------------------------------------------------------------------

    async def _check_stop(self, run_id: str) -> None:
        if await self.store.status(run_id) == "stopping":
            raise StopRequested

    async def _step_boundary(self, run_id: str, cfg: RunConfig, heartbeat: asyncio.Task | None) -> asyncio.Task | None:
        """Between steps, where nothing of the run is in flight: stop when asked; while paused,
        hold here (held=1 tells the API the run has come to rest). In fully_async the
        continuous generation is stopped first: its unfinished prompts go back to the buffer
        and its finished groups stay queued, so nothing is lost; it restarts on resume.
        Returns the heartbeat task to keep (a new one after a resume)."""
        status = await self.store.status(run_id)
        if status == "stopping":
            raise StopRequested
        if status != "paused":
            return heartbeat
        log.info("run %s paused", run_id)
        await self._stop_async_generation(run_id, cfg, heartbeat, keep_metrics=True)
        await self.store.update(run_id, held=1)
        while (status := await self.store.status(run_id)) == "paused":
            await asyncio.sleep(PAUSE_POLL_SECONDS)
        await self.store.update(run_id, held=0)
        if status == "stopping":
            raise StopRequested
        log.info("run %s resumed", run_id)
        if heartbeat is None:
            return None
        return asyncio.create_task(self._async_heartbeat(run_id, cfg), name=f"heartbeat-{run_id}")

    async def _drive(self, run_id: str) -> None:
        """The run's train steps in order: the SFT warm start's, the evaluation before RL, then
        RL's iterations. Where the run stands is the trainer's step (the run record's
        train_steps say which of the run's steps it holds): a trainer that restarted from an
        older checkpoint has the steps after it done again, so the final model holds every
        step of the run, each once."""
        heartbeat: asyncio.Task | None = None
        try:
            rec = await self.store.get(run_id)
            cfg = RunConfig.model_validate(rec["config"])
            if rec["status"] == "stopping":  # stopped while the coordinator was down
                raise StopRequested
            await self.store.transition(run_id, ("pending",), "running")  # (a paused run stays paused)
            done = await self._realign(run_id, cfg, await self._setup(run_id, cfg), answered=False)
            iteration = {"sync": self._rl_iteration, "one_step_off": self._one_step_off_iteration,
                         "fully_async": self._fully_async_iteration}[cfg.mode]
            sft_steps, next_generation, phase = cfg.sft_warmup.steps, None, rec["phase"]
            try:
                while True:
                    if done < sft_steps:
                        if heartbeat is not None:  # (RL groups must not reach the warm start's steps)
                            await self._stop_async_generation(run_id, cfg, heartbeat)
                            heartbeat = None
                        if phase != "sft":
                            phase = "sft"
                            await self.store.update(run_id, phase=phase)
                        done = await self._realign(run_id, cfg, await self._sft_step(run_id, cfg, done))
                        continue
                    if phase != "rl":  # (also for a run of no RL iterations)
                        phase = await self._start_rl(run_id, cfg)
                    if done == sft_steps + cfg.num_rollouts:
                        # Every step taken: the last ones made durable before the run says it
                        # is done (a trainer that lost them takes them again).
                        await self._stop_async_generation(run_id, cfg, heartbeat)
                        heartbeat = None
                        done = await self._finish_training(run_id, cfg)
                        if done == sft_steps + cfg.num_rollouts:
                            break
                        continue
                    if cfg.mode == "fully_async" and heartbeat is None:
                        heartbeat = asyncio.create_task(self._async_heartbeat(run_id, cfg), name=f"heartbeat-{run_id}")
                    heartbeat = await self._step_boundary(run_id, cfg, heartbeat)
                    rollout_id = done - sft_steps
                    record, next_generation = await iteration(run_id, cfg, rollout_id, next_generation)
                    record.update(await self._buffer_metrics(run_id, cfg))
                    if record.get("iteration/seconds"):
                        record["iteration/samples_per_second"] = record.get("train/samples", 0.0) / record["iteration/seconds"]
                    if cfg.eval.interval and (rollout_id + 1) % cfg.eval.interval == 0 and rollout_id + 1 < cfg.num_rollouts:
                        record.update(await self._evaluate(run_id, cfg))
                    await self._append(run_id, cfg, record)
                    done = await self._realign(run_id, cfg, record["step"])
                    if self.metrics is not None:
                        self.metrics.iteration(cfg.mode, record)
            finally:
                if next_generation is not None:
                    next_generation.cancel()
                    await asyncio.gather(next_generation, return_exceptions=True)
            after = await self._evaluate(run_id, cfg)
            await self._append(run_id, cfg, {"rollout_id": cfg.num_rollouts, "time": time.time(), **after})
            await self.run_logs.close(run_id)  # (flushed before the run says it is done)
            await self.store.update(run_id, phase="done", status="completed", eval_after=after)
            await self._end(run_id, trainer_ended=True)
        except StopRequested:
            await self.store.update(run_id, status="stopped")
            await self._end(run_id, heartbeat)
        except asyncio.CancelledError:
            if heartbeat is not None:  # coordinator shutting down: the run stays active and resumes on restart
                heartbeat.cancel()
            raise
        except grpc.aio.AioRpcError as e:
            log.error("run %s failed: %s", run_id, e.details())
            await self.store.update(run_id, status="failed", error=f"{e.code().name}: {e.details()}")
            await self._end(run_id, heartbeat)  # free the trainer for the next run
        except Exception as e:
            log.exception("run %s failed", run_id)
            await self.store.update(run_id, status="failed", error=f"{type(e).__name__}: {e}")
            await self._end(run_id, heartbeat)

    # ---- calls: each with a deadline, retried through a service's outage ----------------

    def _service(self, name: str) -> str:
        return f"{name} at {getattr(self.settings, name + '_address')}"

    def _deadline(self, groups: int = 0) -> float:
        """A generation, evaluation or train call's deadline: a base plus an allowance per group."""
        return self.settings.work_deadline_seconds + self.settings.per_group_deadline_seconds * groups

    async def _patiently(self, run_id: str, cfg: RunConfig, service: str, call: Callable[[], Awaitable]):
        """call(), retried with backoff while `service` is unavailable or past a deadline, for
        up to the run's max_outage_seconds; meanwhile the run record's waiting_for says why."""
        waited = False

        async def on_wait(reason: str) -> None:
            nonlocal waited
            waited = True
            log.warning("run %s: %s", run_id, reason)
            await self.store.update(run_id, waiting_for=reason)
            await self._check_stop(run_id)  # a stop request ends the wait

        try:
            return await retry(call, service=service, budget_seconds=cfg.max_outage_seconds,
                               transient=_transient, on_wait=on_wait, backoff=self.backoff)
        finally:
            if waited:
                await self.store.update(run_id, waiting_for="")

    async def _on_trainer(self, run_id: str, cfg: RunConfig, call: Callable[[], Awaitable]):
        """A trainer call; a trainer that lost the run (restarted) gets it again: InitRun,
        then the engines get its weights, then the call is retried."""
        try:
            return await call()
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:
                raise
            log.warning("run %s: the trainer lost the run (%s); setting it up again", run_id, e.details())
            self._trainer_reset.add(run_id)
            await self._init_trainer(run_id, cfg)
            await self._publish_once(run_id)
            raise _TrainerLostRun(f"{self._service('trainer')} had lost the run (restarted?) and was set up "
                                  f"again: {e.details()}") from None

    async def _init_trainer(self, run_id: str, cfg: RunConfig) -> trainer_pb2.TrainerStatus:
        return await self.clients.trainer.InitRun(trainer_pb2.InitRunRequest(
            run_id=run_id, config_json=cfg.trainer_config().model_dump_json()),
            timeout=self.settings.setup_deadline_seconds)

    async def _setup(self, run_id: str, cfg: RunConfig) -> int:
        """The run in the buffer and on the trainer; returns the trainer's step."""
        request = buffer_pb2.CreateRunRequest(
            run_id=run_id, n_samples_per_prompt=cfg.rollout.n_samples_per_prompt,
            max_queued_groups=cfg.queue_cap,
            datasets=[dataset_to_proto(d) for d in cfg.buffer_datasets()],
            tokenizer_path=cfg.model_path,
            apply_chat_template=cfg.rollout.apply_chat_template,
        )
        await self._patiently(run_id, cfg, self._service("buffer"), lambda: self.clients.buffer.CreateRun(
            request, timeout=self.settings.call_deadline_seconds))
        status = await self._patiently(run_id, cfg, self._service("trainer"), lambda: self._init_trainer(run_id, cfg))
        if (await self.store.get(run_id))["weight_version"] == 0:
            # The engines may hold another run's weights: start from the run's own.
            await self._publish(run_id, cfg)
        return status.step

    async def _end(self, run_id: str, heartbeat: asyncio.Task | None = None, trainer_ended: bool = False) -> None:
        if heartbeat is not None:
            await self._stop_async_generation(run_id, None, heartbeat)
        if not trainer_ended:
            try:
                await self.clients.trainer.EndRun(trainer_pb2.EndRunRequest(run_id=run_id),
                                                  timeout=self.settings.setup_deadline_seconds)
            except grpc.aio.AioRpcError as e:
                log.warning("EndRun for %s: %s", run_id, e.details())
        await self.store.release(run_id)
        await self.run_logs.close(run_id)
        await self._prune()

    async def _finish_training(self, run_id: str, cfg: RunConfig) -> int:
        """The trainer's last steps written to a checkpoint and their acknowledgments made final
        (EndRun), as a run that completes promises; returns how many of the run's train steps
        the trainer held then. Fewer than all when it restarted from an older checkpoint since
        the last step: it is set up again (from that checkpoint) to take the rest."""
        status = await self._patiently(run_id, cfg, self._service("trainer"), lambda: self._on_trainer(
            run_id, cfg, lambda: self.clients.trainer.EndRun(trainer_pb2.EndRunRequest(run_id=run_id),
                                                             timeout=self.settings.setup_deadline_seconds)))
        self._trainer_reset.discard(run_id)  # (its answer is where the trainer stands)
        done = await self._realign(run_id, cfg, status.step, answered=False)
        if done < cfg.sft_warmup.steps + cfg.num_rollouts:
            await self._patiently(run_id, cfg, self._service("trainer"), lambda: self._init_trainer(run_id, cfg))
            await self._publish(run_id, cfg)
        return done

    async def _publish_once(self, run_id: str) -> dict:
        version = (await self.store.get(run_id))["weight_version"] + 1
        r = await self.clients.trainer.PublishWeights(trainer_pb2.PublishWeightsRequest(run_id=run_id, version=version),
                                                      timeout=self.settings.setup_deadline_seconds)
        await self.store.update(run_id, weight_version=version)
        return {"weights/version": version, "weights/seconds": r.seconds, "weights/bytes": r.bytes}

    async def _publish(self, run_id: str, cfg: RunConfig) -> dict:
        return await self._patiently(run_id, cfg, self._service("trainer"),
                                     lambda: self._on_trainer(run_id, cfg, lambda: self._publish_once(run_id)))

    async def _generate(self, run_id: str, cfg: RunConfig, batch: int,
                        request: Callable[[int], rollout_pb2.GenerateRolloutRequest]) -> rollout_pb2.GenerateRolloutResponse:
        """Generate what the batch still misses. Safe to retry: groups an interrupted call wrote
        stay queued and are counted; prompts it held are handed back (or their lease expires)."""
        async def attempt():
            missing = await self._missing_groups(run_id, cfg, batch)
            if not missing:
                return rollout_pb2.GenerateRolloutResponse()
            req = request(missing)
            return await self.clients.rollout.GenerateRollout(
                req, timeout=self._deadline(missing + req.over_sampling_groups))

        return await self._patiently(run_id, cfg, self._service("rollout"), attempt)

    async def _train_step(self, run_id: str, cfg: RunConfig,
                          request: trainer_pb2.TrainStepRequest) -> trainer_pb2.TrainStepResponse:
        """A train step, retried only while its batch was not trained: the trainer finishes and
        acknowledges a started step even when the caller is gone, so before a retry the buffer
        tells whether the failed call's batch was acknowledged (nothing queued or leased: done),
        is still leased (wait for the ack, or for a restarted trainer to be set up again, which
        releases it) or is queued (train it)."""
        tried = False

        async def attempt():
            nonlocal tried
            if tried:
                stats = await self._stats(run_id, cfg)
                if not stats.queued_groups and not stats.leased_groups:
                    log.warning("run %s: the interrupted train step was taken (its metrics are lost)", run_id)
                    return trainer_pb2.TrainStepResponse()
                if stats.leased_groups and stats.queued_groups < request.num_groups:
                    # A trainer that restarted has lost the run: set up again, it releases
                    # the dead trainer's lease (RollbackToCheckpoint) instead of waiting it out.
                    await self._on_trainer(run_id, cfg, lambda: self.clients.trainer.GetStatus(
                        trainer_pb2.GetStatusRequest(run_id=run_id), timeout=self.settings.call_deadline_seconds))
                    raise _StepInFlight(f"{stats.leased_groups} groups are leased by an interrupted train step: "
                                        "waiting for its acknowledgment or for the lease to expire")
            tried = True
            return await self._on_trainer(run_id, cfg, lambda: self.clients.trainer.TrainStep(
                request, timeout=request.wait_seconds + self._deadline(request.num_groups)))

        return await self._patiently(run_id, cfg, self._service("trainer"), attempt)

    async def _sft_step(self, run_id: str, cfg: RunConfig, step: int) -> int:
        """The warm start's step `step` (0-based); the trainer's step after it."""
        await self._step_boundary(run_id, cfg, None)
        batch = cfg.sft_warmup.batch_groups
        await self._generate(run_id, cfg, batch, lambda missing: rollout_pb2.GenerateRolloutRequest(
            run_id=run_id, num_groups=missing, mode="sft", apply_chat_template=cfg.rollout.apply_chat_template,
            # (the rows the step still misses: an interrupted call may have written some)
            dataset=cfg.sft_warmup.dataset, dataset_offset=step * batch + batch - missing))
        r = await self._train_step(run_id, cfg, trainer_pb2.TrainStepRequest(
            run_id=run_id, num_groups=batch, wait_seconds=self.train_wait_seconds, loss="sft"))
        await self._append(run_id, cfg, {"sft_step": step + 1, "time": time.time(), "step": r.step,
                                         **{f"sft/{k}": v for k, v in r.metrics.items()}})
        return r.step

    async def _start_rl(self, run_id: str, cfg: RunConfig) -> str:
        """Between the warm start and RL: the engines get the warm-started weights, and the
        evaluation before RL is taken (once: a warm start trained again after a trainer
        restart is not measured twice)."""
        if cfg.sft_warmup.steps:
            await self._publish(run_id, cfg)
        if not (await self.store.get(run_id))["eval_before"]:
            before = await self._evaluate(run_id, cfg)
            await self.store.update(run_id, eval_before=before)
            await self._append(run_id, cfg, {"rollout_id": 0, "time": time.time(), **before})
        await self.store.update(run_id, phase="rl")
        return "rl"

    async def _realign(self, run_id: str, cfg: RunConfig, step: int, answered: bool = True) -> int:
        """Record where the trainer stands: at `step`, the answer of the run's latest train step
        (`answered`) or of InitRun; returns how many of the run's train steps (SFT, then RL
        iterations) its model holds. A step's answer is not trusted when the trainer was set
        up again meanwhile (it may have resumed from an older checkpoint) or was lost (0):
        the trainer is asked."""
        if answered and (run_id in self._trainer_reset or not step):
            self._trainer_reset.discard(run_id)
            status = await self._patiently(run_id, cfg, self._service("trainer"), lambda: self._on_trainer(
                run_id, cfg, lambda: self.clients.trainer.GetStatus(
                    trainer_pb2.GetStatusRequest(run_id=run_id), timeout=self.settings.call_deadline_seconds)))
            step, answered = status.step, False
        before = (await self.store.get(run_id))["train_steps"]
        steps = steps_after_train_step(before, step) if answered else steps_held(before, step)
        if len(steps) < len(before):
            log.warning("run %s: the trainer stands at step %d: the run's train steps from number %d on are taken "
                        "again (the groups they trained are handed out again)", run_id, step, len(steps) + 1)
        await self.store.update(run_id, train_steps=steps)
        return len(steps)

    async def _evaluate(self, run_id: str, cfg: RunConfig) -> dict:
        out: dict = {}
        for d in cfg.eval_datasets():
            request = rollout_pb2.EvaluateRequest(
                run_id=run_id, dataset=d.name, n_samples_per_prompt=cfg.eval.n_samples_per_prompt,
                sampling=sampling_to_proto(cfg.eval.sampling), reward=_reward_spec(cfg), limit=cfg.eval.limit,
                apply_chat_template=cfg.rollout.apply_chat_template, generate=generate_function_spec(cfg))
            r = await self._patiently(run_id, cfg, self._service("rollout"), lambda request=request: self.clients.rollout.Evaluate(
                request, timeout=self._deadline(cfg.eval.limit)))
            out.update(r.metrics)
        return out

    async def _stats(self, run_id: str, cfg: RunConfig) -> buffer_pb2.BufferStats:
        return await self._patiently(run_id, cfg, self._service("buffer"), lambda: self.clients.buffer.GetStats(
            buffer_pb2.GetStatsRequest(run_id=run_id), timeout=self.settings.call_deadline_seconds))

    async def _buffer_metrics(self, run_id: str, cfg: RunConfig) -> dict[str, float]:
        """The buffer's depth and what became of groups, for the iteration's record."""
        s = await self._stats(run_id, cfg)
        out = {f"buffer/{name}": float(getattr(s, name)) for name in (
            "queued_groups", "leased_groups", "partial_groups", "dead_letter_groups", "stale_groups_dropped",
            "stale_groups_kept", "redelivered_groups", "groups_written_per_second")}
        out.update({f"buffer/dropped/{reason}": float(n) for reason, n in s.dropped_by_reason.items()})
        return out

    async def _missing_groups(self, run_id: str, cfg: RunConfig, batch: int) -> int:
        """Groups to generate for a batch: an interrupted iteration (a coordinator restart, a
        failed GenerateRollout) may have written some already (queued, not lost); only the rest."""
        return max(batch - (await self._stats(run_id, cfg)).queued_groups, 0)

    def _rollout_request(self, run_id: str, cfg: RunConfig, num_groups: int,
                         min_weight_version: int = 0) -> rollout_pb2.GenerateRolloutRequest:
        ro = cfg.rollout
        return rollout_pb2.GenerateRolloutRequest(
            run_id=run_id, num_groups=num_groups, sampling=sampling_to_proto(ro.sampling),
            reward=_reward_spec(cfg), group_filter=ro.group_filter, over_sampling_groups=ro.over_sampling_groups,
            partial_rollout=ro.partial_rollout, mode="rl", max_concurrency=ro.max_concurrency,
            apply_chat_template=ro.apply_chat_template, generate=generate_function_spec(cfg),
            min_weight_version=min_weight_version)

    async def _generate_batch(self, run_id: str, cfg: RunConfig) -> tuple[dict, float]:
        """Generate what the next batch misses; its metrics and how long it took."""
        t0 = time.monotonic()
        # The trainer leases this batch with min_weight_version = its version then - the bound;
        # one_step_off trains it one version later than the weights it is generated with.
        bound = cfg.staleness_bound
        oldest = 0 if bound is None else max(
            (await self.store.get(run_id))["weight_version"] + (cfg.mode == "one_step_off") - bound, 0)
        g = await self._generate(run_id, cfg, cfg.rollout.rollout_batch_size,
                                 lambda missing: self._rollout_request(run_id, cfg, missing, oldest))
        return dict(g.metrics), time.monotonic() - t0

    async def _timed_train_step(self, run_id: str, cfg: RunConfig) -> tuple[trainer_pb2.TrainStepResponse, float]:
        t0 = time.monotonic()
        t = await self._train_step(run_id, cfg, trainer_pb2.TrainStepRequest(
            run_id=run_id, num_groups=cfg.rollout.rollout_batch_size, wait_seconds=self.train_wait_seconds))
        return t, time.monotonic() - t0

    @staticmethod
    def _record(rollout_id: int, generation: dict, train: trainer_pb2.TrainStepResponse, weights: dict,
                phases: dict[str, float], started: float) -> dict:
        return {"rollout_id": rollout_id + 1, "time": time.time(), "step": train.step, **generation,
                **{f"train/{k}": v for k, v in train.metrics.items()}, **weights,
                **{f"phase/{k}_seconds": v for k, v in phases.items()},
                "iteration/seconds": time.monotonic() - started}

    async def _rl_iteration(self, run_id: str, cfg: RunConfig, rollout_id: int,
                            _: asyncio.Task | None) -> tuple[dict, None]:
        t0 = time.monotonic()
        generation, generate_seconds = await self._generate_batch(run_id, cfg)
        t, train_seconds = await self._timed_train_step(run_id, cfg)
        w = await self._publish(run_id, cfg)
        return self._record(rollout_id, generation, t, w, {"generate": generate_seconds, "train": train_seconds},
                            t0), None

    async def _one_step_off_iteration(self, run_id: str, cfg: RunConfig, rollout_id: int,
                                      generating: asyncio.Task | None) -> tuple[dict, asyncio.Task | None]:
        """Train batch k while batch k+1 is generated with the same weights (it starts once
        batch k is leased, so it cannot count k's groups as its own); publish after both."""
        t0 = time.monotonic()
        generation, generate_seconds = await generating if generating else await self._generate_batch(run_id, cfg)
        training = asyncio.create_task(self._timed_train_step(run_id, cfg))
        upcoming = None
        try:
            if rollout_id + 1 < cfg.num_rollouts:
                await self._leased_or_done(run_id, cfg, training)
                upcoming = asyncio.create_task(self._generate_batch(run_id, cfg))
            t, train_seconds = await training
            if upcoming is not None:
                await asyncio.wait([upcoming])  # weights change only when nothing is generating
        except BaseException:
            for task in (training, upcoming):
                if task is not None:
                    task.cancel()
            raise
        w = await self._publish(run_id, cfg)
        return self._record(rollout_id, generation, t, w, {"generate": generate_seconds, "train": train_seconds},
                            t0), upcoming

    async def _leased_or_done(self, run_id: str, cfg: RunConfig, training: asyncio.Task) -> None:
        """Until the train step holds its batch (or has finished)."""
        while not training.done():
            if (await self._stats(run_id, cfg)).leased_groups:
                return
            await asyncio.wait([training], timeout=LEASE_POLL_SECONDS)

    async def _fully_async_iteration(self, run_id: str, cfg: RunConfig, rollout_id: int,
                                     _: asyncio.Task | None) -> tuple[dict, None]:
        """Train the next batch the continuous generation wrote, then push the new weights
        with the engines paused (pause_mode)."""
        t0 = time.monotonic()
        await self._start_async_generation(run_id, cfg)
        t, train_seconds = await self._timed_train_step(run_id, cfg)
        t1 = time.monotonic()
        await self._patiently(run_id, cfg, self._service("rollout"), lambda: self.clients.rollout.PauseGeneration(
            rollout_pb2.PauseGenerationRequest(mode=cfg.pause_mode), timeout=self.settings.call_deadline_seconds))
        try:
            w = await self._publish(run_id, cfg)
        finally:
            await self._patiently(run_id, cfg, self._service("rollout"), lambda: self.clients.rollout.ContinueGeneration(
                rollout_pb2.ContinueGenerationRequest(), timeout=self.settings.call_deadline_seconds))
        generation = self._async_metrics.pop(run_id, {})
        return self._record(rollout_id, generation, t, w, {"train": train_seconds, "pause": time.monotonic() - t1},
                            t0), None

    # ---- fully_async: the rollout service's continuous generation -----------------------

    async def _start_async_generation(self, run_id: str, cfg: RunConfig) -> None:
        """StartAsyncRollout: starts the run's generation loop, or (already running) is a
        heartbeat; either way it returns the loop's metrics since the previous call."""
        r = await self._patiently(run_id, cfg, self._service("rollout"), lambda: self.clients.rollout.StartAsyncRollout(
            self._rollout_request(run_id, cfg, cfg.rollout.rollout_batch_size),
            timeout=self.settings.call_deadline_seconds))
        self._collect_async(run_id, r)

    def _collect_async(self, run_id: str, reply: rollout_pb2.AsyncRolloutResponse) -> None:
        if reply.error:
            log.warning("run %s: the rollout service's generation loop reports: %s", run_id, reply.error)
        merge_sample_metrics(self._async_metrics.setdefault(run_id, {}), dict(reply.metrics), "rollout/samples")

    async def _async_heartbeat(self, run_id: str, cfg: RunConfig) -> None:
        """Keeps the generation loop running while the run waits on other services: a
        restarted rollout service gets its loop back within a heartbeat."""
        while True:
            await asyncio.sleep(self.settings.async_heartbeat_seconds)
            try:
                await self._start_async_generation(run_id, cfg)
            except (StopRequested, grpc.aio.AioRpcError, OutageTooLong) as e:
                log.warning("run %s: generation heartbeat: %s", run_id, e)

    async def _stop_async_generation(self, run_id: str, cfg: RunConfig | None, heartbeat: asyncio.Task | None,
                                     keep_metrics: bool = False) -> None:
        """Stop the continuous generation (its unfinished prompts go back to the buffer).
        Best effort when the run is ending anyway (cfg None): a rollout service that is
        down has no loop to stop."""
        if heartbeat is None:
            return
        heartbeat.cancel()
        await asyncio.gather(heartbeat, return_exceptions=True)

        def call():
            return self.clients.rollout.StopAsyncRollout(rollout_pb2.StopAsyncRolloutRequest(run_id=run_id),
                                                         timeout=self.settings.call_deadline_seconds)
        try:
            reply = await (self._patiently(run_id, cfg, self._service("rollout"), call) if cfg else call())
            self._collect_async(run_id, reply)
        except grpc.aio.AioRpcError as e:
            log.warning("run %s: could not stop the generation loop: %s", run_id, e.details())
        if not keep_metrics:  # (a pause keeps them for the next iteration's record)
            self._async_metrics.pop(run_id, None)


# The run record's train_steps: the trainer's step after each of the run's train steps
# (SFT steps, then RL iterations), oldest first. Checkpoints are taken only between train
# steps, so a trainer that resumed from one stands where one of them ended.

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


def _transient(e: BaseException) -> str | None:
    """Why a failed call is worth retrying (a peer down, restarting or past its deadline; a
    step still in flight; a trainer set up again), or None."""
    if isinstance(e, (_StepInFlight, _TrainerLostRun)):
        return str(e)
    return transient_grpc_error(e)


def check_reward_service_change(run_id: str, config: RunConfig, name: str, registered: dict[str, float],
                                removes: bool, new_weight: float = 0.0) -> None:
    """FailedPrecondition (409) when a change to the registered reward services would change
    the rewards of the active run `run_id`: deleting or replacing (`removes`) a registered
    service that its reward spec names ("judge" or "judge/<score>"); for a spec without
    components (it takes every service registered with a weight), deleting or replacing one
    with a weight, or registering one with a weight. registered: name -> weight."""
    removes = removes and name in registered
    components = config.reward.components
    if components:
        uses = removes and name in {c.split("/", 1)[0] for c in components}
    else:
        uses = (removes and bool(registered[name])) or bool(new_weight)
    if uses:
        raise FailedPrecondition(
            f"run {run_id} is active and its reward uses the reward service '{name}' (or would take it in); "
            f"stop the run first (POST /runs/{run_id}/stop), or register the new service under another name")


def generate_function_spec(cfg: RunConfig) -> rollout_pb2.GenerateFunction:
    g = cfg.rollout.generate
    return rollout_pb2.GenerateFunction(name=g.name, options_json=json.dumps(g.options) if g.options else "")


def _reward_spec(cfg: RunConfig) -> reward_pb2.RewardSpec:
    return reward_pb2.RewardSpec(components=cfg.reward.components, reward_key=cfg.reward.reward_key)
