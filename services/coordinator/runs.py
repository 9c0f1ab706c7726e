"""Runs: their state in Redis (so a restarted coordinator carries on) and the loop that
drives one run through the services: optional SFT warm start, evaluation, then
generate -> train -> publish weights, evaluating at the configured interval."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass

import grpc
import redis.asyncio as aioredis

from rlmesh.common.dataset_spec import dataset_to_proto
from rlmesh.common.errors import FailedPrecondition, NotFound
from rlmesh.common.run_config import RunConfig
from rlmesh.common.sampling import sampling_to_proto
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

ACTIVE = ("pending", "running", "stopping")
FINAL = ("completed", "stopped", "failed")


# Compare-and-delete: release the active-run claim only if this run holds it.
_RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


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
            "phase": "setup", "rollout_id": 0, "weight_version": 0, "created_at": now, "updated_at": now,
            "error": "", "eval_before": "{}", "eval_after": "{}",
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
        for k in ("rollout_id", "weight_version"):
            rec[k] = int(rec[k])
        for k in ("created_at", "updated_at"):
            rec[k] = float(rec[k])
        for k in ("config", "eval_before", "eval_after"):
            rec[k] = json.loads(rec[k])
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

    async def metrics(self, run_id: str) -> list[dict]:
        return [json.loads(r) for r in await self.redis.lrange(self._key(run_id) + ":metrics", 0, -1)]

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


class RunDriver:
    """Drives runs; one run trains at a time (the trainer holds one policy)."""

    def __init__(self, store: RunStore, clients: Clients, train_wait_seconds: float,
                 max_finished_runs: int = 100) -> None:
        self.store = store
        self.clients = clients
        self.train_wait_seconds = train_wait_seconds
        self.max_finished_runs = max_finished_runs
        self.tasks: dict[str, asyncio.Task] = {}

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
            await self.clients.buffer.DeleteRun(buffer_pb2.DeleteRunRequest(run_id=run_id), timeout=30)
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

    async def stop(self, run_id: str) -> str:
        status = await self.store.status(run_id)
        if status in FINAL:
            return status
        await self.store.update(run_id, status="stopping")
        return "stopping"

    async def close(self) -> None:
        for t in self.tasks.values():
            t.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)

    # ---- the loop -----------------------------------------------------------------------

    async def _check_stop(self, run_id: str) -> None:
        if await self.store.status(run_id) == "stopping":
            raise StopRequested

    async def _drive(self, run_id: str) -> None:
        try:
            rec = await self.store.get(run_id)
            cfg = RunConfig.model_validate(rec["config"])
            if rec["status"] == "stopping":  # stopped while the coordinator was down
                raise StopRequested
            await self.store.update(run_id, status="running")
            await self._setup(run_id, cfg)
            if rec["phase"] in ("setup", "sft"):  # (a restart mid-warm-start redoes it)
                await self._sft_warmup(run_id, cfg)
                before = await self._evaluate(run_id, cfg)
                await self.store.update(run_id, phase="rl", eval_before=before)
                await self.store.append_metrics(run_id, {"rollout_id": 0, "time": time.time(), **before})
            rec = await self.store.get(run_id)
            for rollout_id in range(rec["rollout_id"], cfg.num_rollouts):
                await self._check_stop(run_id)
                record = await self._rl_iteration(run_id, cfg, rollout_id)
                if cfg.eval.interval and (rollout_id + 1) % cfg.eval.interval == 0 and rollout_id + 1 < cfg.num_rollouts:
                    record.update(await self._evaluate(run_id, cfg))
                await self.store.append_metrics(run_id, record)
                await self.store.update(run_id, rollout_id=rollout_id + 1)
            after = await self._evaluate(run_id, cfg)
            await self.store.append_metrics(run_id, {"rollout_id": cfg.num_rollouts, "time": time.time(), **after})
            await self.store.update(run_id, phase="done", status="completed", eval_after=after)
            await self._end(run_id)
        except StopRequested:
            await self.store.update(run_id, status="stopped")
            await self._end(run_id)
        except asyncio.CancelledError:
            raise  # coordinator shutting down: the run stays active and resumes on restart
        except grpc.aio.AioRpcError as e:
            log.error("run %s failed: %s", run_id, e.details())
            await self.store.update(run_id, status="failed", error=f"{e.code().name}: {e.details()}")
            await self._end(run_id)  # free the trainer for the next run
        except Exception as e:
            log.exception("run %s failed", run_id)
            await self.store.update(run_id, status="failed", error=f"{type(e).__name__}: {e}")
            await self._end(run_id)

    async def _setup(self, run_id: str, cfg: RunConfig) -> None:
        await self.clients.buffer.CreateRun(buffer_pb2.CreateRunRequest(
            run_id=run_id, n_samples_per_prompt=cfg.rollout.n_samples_per_prompt,
            max_queued_groups=cfg.max_queued_groups,
            datasets=[dataset_to_proto(d) for d in cfg.datasets],
            tokenizer_path=cfg.model_path,
            apply_chat_template=cfg.rollout.apply_chat_template,
        ))
        await self.clients.trainer.InitRun(trainer_pb2.InitRunRequest(
            run_id=run_id, config_json=cfg.trainer_config().model_dump_json()))
        if (await self.store.get(run_id))["weight_version"] == 0:
            # The engines may hold another run's weights: start from the run's own.
            await self._publish(run_id)

    async def _end(self, run_id: str) -> None:
        try:
            await self.clients.trainer.EndRun(trainer_pb2.EndRunRequest(run_id=run_id))
        except grpc.aio.AioRpcError as e:
            log.warning("EndRun for %s: %s", run_id, e.details())
        await self.store.release(run_id)
        await self._prune()

    async def _publish(self, run_id: str) -> dict:
        version = (await self.store.get(run_id))["weight_version"] + 1
        r = await self.clients.trainer.PublishWeights(trainer_pb2.PublishWeightsRequest(run_id=run_id, version=version))
        await self.store.update(run_id, weight_version=version)
        return {"weights/version": version, "weights/seconds": r.seconds, "weights/bytes": r.bytes}

    async def _sft_warmup(self, run_id: str, cfg: RunConfig) -> None:
        if not cfg.sft_warmup.steps:
            return
        await self.store.update(run_id, phase="sft")
        for step in range(cfg.sft_warmup.steps):
            await self._check_stop(run_id)
            missing = await self._missing_groups(run_id, cfg.sft_warmup.batch_groups)
            if missing:
                await self.clients.rollout.GenerateRollout(rollout_pb2.GenerateRolloutRequest(
                    run_id=run_id, num_groups=missing, mode="sft", apply_chat_template=cfg.rollout.apply_chat_template))
            r = await self.clients.trainer.TrainStep(trainer_pb2.TrainStepRequest(
                run_id=run_id, num_groups=cfg.sft_warmup.batch_groups, wait_seconds=self.train_wait_seconds, loss="sft"))
            await self.store.append_metrics(run_id, {"sft_step": step + 1, "time": time.time(),
                                                     **{f"sft/{k}": v for k, v in r.metrics.items()}})
        await self._publish(run_id)

    async def _evaluate(self, run_id: str, cfg: RunConfig) -> dict:
        out: dict = {}
        for d in (d for d in cfg.datasets if d.eval):
            r = await self.clients.rollout.Evaluate(rollout_pb2.EvaluateRequest(
                run_id=run_id, dataset=d.name, n_samples_per_prompt=cfg.eval.n_samples_per_prompt,
                sampling=sampling_to_proto(cfg.eval.sampling), reward=_reward_spec(cfg), limit=cfg.eval.limit,
                apply_chat_template=cfg.rollout.apply_chat_template))
            out.update(r.metrics)
        return out

    async def _missing_groups(self, run_id: str, batch: int) -> int:
        """Groups to generate for a batch: an iteration interrupted by a coordinator restart
        may have written some already (they are queued, not lost); generate only the rest."""
        stats = await self.clients.buffer.GetStats(buffer_pb2.GetStatsRequest(run_id=run_id))
        return max(batch - stats.queued_groups, 0)

    async def _rl_iteration(self, run_id: str, cfg: RunConfig, rollout_id: int) -> dict:
        ro = cfg.rollout
        t0 = time.monotonic()
        g = rollout_pb2.GenerateRolloutResponse()
        missing = await self._missing_groups(run_id, ro.rollout_batch_size)
        if missing:
            g = await self.clients.rollout.GenerateRollout(rollout_pb2.GenerateRolloutRequest(
                run_id=run_id, num_groups=missing, sampling=sampling_to_proto(ro.sampling),
                reward=_reward_spec(cfg), group_filter=ro.group_filter, over_sampling_groups=ro.over_sampling_groups,
                partial_rollout=ro.partial_rollout, mode="rl", max_concurrency=ro.max_concurrency,
                apply_chat_template=ro.apply_chat_template))
        t = await self.clients.trainer.TrainStep(trainer_pb2.TrainStepRequest(
            run_id=run_id, num_groups=ro.rollout_batch_size, wait_seconds=self.train_wait_seconds))
        w = await self._publish(run_id)
        return {"rollout_id": rollout_id + 1, "time": time.time(), "step": t.step,
                **dict(g.metrics), **{f"train/{k}": v for k, v in t.metrics.items()}, **w,
                "iteration/seconds": time.monotonic() - t0}


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


def _reward_spec(cfg: RunConfig) -> reward_pb2.RewardSpec:
    return reward_pb2.RewardSpec(components=cfg.reward.components, reward_key=cfg.reward.reward_key)
