"""The coordinator's REST API (FastAPI): thin handlers over RunStore and RunDriver.
OpenAPI docs at /docs."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import Annotated, Literal

import grpc
import redis.asyncio as aioredis
import uvicorn
from fastapi import FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from google.protobuf.json_format import MessageToDict
from pydantic import BaseModel, Field
from redis import exceptions as redis_errors
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff

from rlmesh.common import auth
from rlmesh.common.errors import HTTP_STATUS_BY_GRPC_CODE, RlmeshError
from rlmesh.common.grpc_server import aio_channel
from rlmesh.common.http_guard import guard
from rlmesh.common.paths import RUN_ID_PATTERN
from rlmesh.common.prometheus import metrics_response
from rlmesh.common.run_config import RunConfig, StrictModel, limit_violations
from rlmesh.coordinator.config import Settings
from rlmesh.coordinator.observe import CoordinatorMetrics
from rlmesh.coordinator.page import group_for_people, is_page_path, mount_page
from rlmesh.coordinator.runs import (
    Clients,
    RunDriver,
    RunStore,
    check_reward_service_change,
    generate_function_spec,
)
from rlmesh.reward import remote
from rlmesh.v1 import (
    buffer_pb2,
    buffer_pb2_grpc,
    reward_pb2,
    reward_pb2_grpc,
    rollout_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)

# Probes and the API's own description need no token; they reveal nothing about runs.
OPEN_PATHS = frozenset({"/health", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
RUN_ID = Path(pattern=RUN_ID_PATTERN, description="The run's id (from POST /runs).")


class Problem(BaseModel):
    detail: str = Field(description="What went wrong and what to do about it.")
    code: str = Field("", description="The gRPC status of a service the coordinator relayed to, if one failed.")


def _errors(*statuses: int) -> dict:
    """OpenAPI entries for the error statuses a route can answer (each with a JSON body)."""
    meaning = {
        400: "The body is not JSON, or a service refused the request's values.",
        404: "No such run or reward service.",
        409: "Conflicts with the current state (e.g. another run is active, the run is not finished, or it "
             "has finished and cannot be paused or resumed).",
        413: "The request body is larger than max_request_bytes.",
        429: "A service is out of capacity; retry later.",
        501: "A service does not implement this.",
        502: "A service answered with an unexpected error.",
        503: "A service the coordinator relays to is unavailable (restarting?); retry later.",
        504: "A service did not answer in time.",
    }
    return {status: {"model": Problem, "description": meaning[status]} for status in statuses}


# What a route that relays to a service can answer besides its own statuses.
RELAYED = (400, 404, 409, 429, 501, 502, 503, 504)


class RunCreated(BaseModel):
    id: str
    status: str


class RunDeleted(BaseModel):
    id: str
    deleted: bool


class RunSummary(BaseModel):
    id: str
    name: str
    status: str
    phase: str
    rollout_id: int
    num_rollouts: int
    weight_version: int
    created_at: float
    updated_at: float
    error: str
    waiting_for: str = Field("", description="While the run rides out a service outage: the service it waits "
                             "for and its last error (its calls are retried until max_outage_seconds); else empty.")
    held: bool = Field(False, description="A paused run has come to rest at a step boundary (nothing of it is "
                       "in flight); false while it finishes the step it was in when paused.")


class RunDetail(RunSummary):
    config: dict
    eval_before: dict
    eval_after: dict
    latest_metrics: dict
    metrics: list[dict]


class MetricRecords(BaseModel):
    records: list[dict] = Field(description="Metric records from position `since`, oldest first (one per "
                                "iteration, evaluation or SFT step), each with only the asked-for fields.")
    next: int = Field(description="The `since` of the next call: it returns only records written after these.")
    total: int = Field(description="Records the run has.")


class RecentGroups(BaseModel):
    groups: list[dict] = Field(description="The newest stored groups, newest first: prompt, responses, rewards "
                               "and components, status, weight versions, metadata (an agent sample's tool turns "
                               "are in metadata.agent_turns); no per-token arrays.")
    offset: int
    total: int = Field(description="Groups kept (the buffer keeps the newest recent_groups of a run).")


class CheckpointInfo(BaseModel):
    step: int
    path: str = Field(description="On the trainer's machine, under its work_dir.")
    automatic: bool = Field(description="Written every checkpoint_interval steps (pruned to keep_last); else saved "
                            "on request.")
    weight_version: int
    written_at: float = Field(description="Unix seconds.")


MetricField = Annotated[str, Field(min_length=1, max_length=200)]
# Fields every filtered metric record keeps, so that a curve knows where a point lies.
METRIC_KEYS = ("rollout_id", "sft_step", "step", "time")


def _pick(record: dict, fields: list[str]) -> dict | None:
    """The record's asked-for fields ('name', or 'prefix*'), plus METRIC_KEYS; None without any."""
    picked = {k: v for k, v in record.items() if any(k == f or (f.endswith("*") and k.startswith(f[:-1]))
                                                     for f in fields)}
    return {**{k: record[k] for k in METRIC_KEYS if k in record}, **picked} if picked else None


class RewardServiceSpec(StrictModel):
    """A remote reward service, registered by URL (the reward service checks it answers)."""

    name: str = Field(max_length=63, description="Component name runs use in reward.components.")
    url: str = Field(max_length=2048, description="http://, https:// or grpc:// address of the service.")
    protocol: Literal["", "http-json", "grpc"] = Field("", description="Empty = from the URL's scheme.")
    timeout_seconds: float = Field(0.0, ge=0, le=remote.MAX_TIMEOUT_SECONDS, description="Per call; 0 = the reward service's default.")
    max_concurrency: int = Field(0, ge=0, le=remote.MAX_CONCURRENCY, description="Calls in flight at once; 0 = the default.")
    weight: float = Field(0.0, ge=-1e6, le=1e6, description="Weight when a run names no components.")
    max_batch_size: int = Field(0, ge=0, le=remote.MAX_BATCH_SIZE, description="Samples per call; 0 = the default.")
    bearer_token: str = Field("", max_length=remote.MAX_TOKEN_CHARS, description="The service's own credential, sent as "
                              "'Authorization: Bearer <token>'; write-only (never listed back).")
    replace: bool = Field(False, description="Replace a service registered under this name (409 otherwise); "
                          "refused (409) while the active run uses it.")


def _service_dict(msg) -> dict:
    return MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def _summary(rec: dict) -> dict:
    return {**{k: rec[k] for k in RunSummary.model_fields if k in rec}, "num_rollouts": rec["config"]["num_rollouts"]}


log = logging.getLogger(__name__)

REDIS_RETRY_CAP_SECONDS = 2.0


def patient_redis_client(url: str, outage_seconds: float) -> aioredis.Redis:
    """A client whose commands are retried (backoff with jitter, up to 2 s apart) while Redis
    is down or restarting, for about outage_seconds."""
    return aioredis.Redis.from_url(
        url, retry=Retry(ExponentialWithJitterBackoff(cap=REDIS_RETRY_CAP_SECONDS, base=0.1),
                         retries=max(int(outage_seconds / REDIS_RETRY_CAP_SECONDS), 1)),
        retry_on_error=[redis_errors.ConnectionError, redis_errors.TimeoutError])


async def _check_generate_function(driver: RunDriver, config: RunConfig) -> None:
    """A generate function the rollout service lacks, or options it refuses, are the
    request's fault (422 naming them); a rollout service that does not answer now is not:
    the run starts and its first rollout checks again."""
    try:
        await driver.clients.rollout.CheckGenerateFunction(generate_function_spec(config),
                                                           timeout=driver.settings.call_deadline_seconds)
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
            raise RequestValidationError([{"loc": ("body", "rollout", "generate"), "msg": e.details(),
                                           "type": "generate_function"}]) from None
        log.warning("could not check the generate function with the rollout service (%s); the run starts "
                    "and its first rollout checks it", e.code().name)


def create_app(settings: Settings) -> FastAPI:
    metrics = CoordinatorMetrics(lambda: app.state.store.list())
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        redis = aioredis.Redis.from_url(settings.redis_url)  # the API's: a Redis outage answers 503 at once
        patient_redis = patient_redis_client(settings.redis_url, settings.redis_outage_seconds)
        channels = {name: aio_channel(address, settings.max_message_bytes) for name, address in (
            ("buffer", settings.buffer_address), ("rollout", settings.rollout_address),
            ("trainer", settings.trainer_address), ("reward", settings.reward_address))}
        clients = Clients(
            buffer=buffer_pb2_grpc.BufferStub(channels["buffer"]),
            rollout=rollout_pb2_grpc.RolloutStub(channels["rollout"]),
            trainer=trainer_pb2_grpc.TrainerStub(channels["trainer"]),
        )
        app.state.store = RunStore(redis, settings.key_prefix)
        # The loop's own client rides out a Redis restart instead of losing track of the run.
        app.state.driver = RunDriver(RunStore(patient_redis, settings.key_prefix), clients, settings.train_wait_seconds,
                                     settings.max_finished_runs, settings=settings, metrics=metrics)
        app.state.reward = reward_pb2_grpc.RewardStub(channels["reward"])
        await app.state.driver.resume_active()
        yield
        await app.state.driver.close()
        for channel in channels.values():
            await channel.close()
        await redis.aclose()
        await patient_redis.aclose()

    app = FastAPI(title="rlmesh coordinator", version="0.1.0", lifespan=lifespan,
                  description="Start, stop and watch RL post-training runs. Every route except /health and "
                  "the API docs needs `Authorization: Bearer <token>` (the stack's token).",
                  responses={401: {"model": Problem, "description": "Missing or wrong bearer token."}})
    guard(app, settings.max_request_bytes)
    token = auth.required_token()
    if token:
        auth.add_http_token_check(
            app, token, lambda path: path in OPEN_PATHS or is_page_path(path),
            lambda why: {"detail": f"this API needs the stack's token and the request carried {why}: send "
                                   f"'Authorization: Bearer <token>' ({auth.TOKEN_ENV} of the stack)"})
    metrics.http.install(app)  # (after the token check: counts the requests it refuses too)

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics(request: Request):
        """Prometheus metrics (text format), with the stack's token like every route."""
        return metrics_response(await metrics.service.render())

    @app.exception_handler(RlmeshError)
    async def rlmesh_error(request: Request, exc: RlmeshError):
        return JSONResponse(status_code=exc.http_status, content={"detail": str(exc)})

    @app.exception_handler(redis_errors.ConnectionError)
    @app.exception_handler(redis_errors.TimeoutError)
    async def redis_down(request: Request, exc: Exception):
        return JSONResponse(status_code=503, content={
            "detail": f"the coordinator's Redis is unavailable ({type(exc).__name__}); retry shortly"})

    @app.exception_handler(grpc.aio.AioRpcError)
    async def upstream_error(request: Request, exc: grpc.aio.AioRpcError):
        status = HTTP_STATUS_BY_GRPC_CODE.get(exc.code(), 502)
        return JSONResponse(status_code=status, content={"detail": exc.details(), "code": exc.code().name})

    @app.post("/runs", status_code=201, response_model=RunCreated, responses=_errors(400, 409, 413))
    async def create_run(config: RunConfig, request: Request):
        """Start a run; 409 while another run is active (one run trains at a time)."""
        violations = limit_violations(config, settings.limits)
        if violations:
            raise RequestValidationError([{"loc": ("body", *loc), "msg": msg, "type": "limit"} for loc, msg in violations])
        if config.rollout.generate.name:
            await _check_generate_function(request.app.state.driver, config)
        run_id = await request.app.state.driver.submit(config)
        return RunCreated(id=run_id, status="pending")

    @app.get("/runs", response_model=list[RunSummary])
    async def list_runs(request: Request):
        """Every kept run, oldest first (max_finished_runs finished ones, and the active one)."""
        return [_summary(r) for r in await request.app.state.store.list()]

    @app.get("/runs/{run_id}", response_model=RunDetail, responses=_errors(404))
    async def get_run(request: Request, run_id: str = RUN_ID,
                      metrics_last: int = Query(1000, ge=0, le=100_000,
                                                description="How many of the newest metric records to return.")):
        """A run: status, phase, progress, eval before/after, and its newest metric records."""
        store: RunStore = request.app.state.store
        rec = await store.get(run_id)
        metrics = await store.metrics(run_id, metrics_last)
        latest = metrics[-1] if metrics else (await store.metrics(run_id, 1) or [{}])[-1]
        return {**rec, **_summary(rec), "metrics": metrics, "latest_metrics": latest}

    @app.post("/runs/{run_id}/stop", response_model=RunCreated, responses=_errors(404))
    async def stop_run(request: Request, run_id: str = RUN_ID):
        """Ask a run to stop at its next step; a finished run answers its final status."""
        return RunCreated(id=run_id, status=await request.app.state.driver.stop(run_id))

    @app.post("/runs/{run_id}/pause", response_model=RunCreated, responses=_errors(404, 409))
    async def pause_run(request: Request, run_id: str = RUN_ID):
        """Hold a pending or running run at its next step boundary: the step in flight finishes (its
        groups are trained, its weights pushed), then generation and training wait (fully_async: the
        continuous generation stops and hands its unfinished prompts back to the buffer). `held` in
        GET /runs/{id} turns true once it rests. Survives a coordinator restart. Pausing a paused run
        is a no-op; 409 for a stopping or finished run."""
        return RunCreated(id=run_id, status=await request.app.state.driver.pause(run_id))

    @app.post("/runs/{run_id}/resume", response_model=RunCreated, responses=_errors(404, 409))
    async def resume_run(request: Request, run_id: str = RUN_ID):
        """Let a paused run carry on from where it rests; a no-op for a pending or running run,
        409 for a stopping or finished one."""
        return RunCreated(id=run_id, status=await request.app.state.driver.resume(run_id))

    @app.get("/runs/{run_id}/metrics", response_model=MetricRecords, responses=_errors(404))
    async def run_metrics(request: Request, run_id: str = RUN_ID,
                          since: int = Query(0, ge=0, le=10**12, description="Position of the first record to "
                                             "return: 0, or the `next` of the previous call (to poll for new ones)."),
                          limit: int = Query(1000, ge=1, le=10_000, description="Records to return at most."),
                          fields: list[MetricField] = Query([], max_length=100, description="Only these fields "
                                                            "(repeat the parameter; 'train/*' = every field with "
                                                            "that prefix); rollout_id, sft_step, step and time "
                                                            "always come along. Records with none are left out. "
                                                            "Empty = every field.")):
        """A run's metric records from a cursor, optionally only some fields: what a curve polls."""
        store: RunStore = request.app.state.store
        await store.get(run_id)  # 404 for an unknown run
        records, total = await store.metrics_since(run_id, since, limit)
        next_since = min(since, total) + len(records)  # (a cursor past the end answers the end)
        if fields:
            records = [r for r in (_pick(rec, fields) for rec in records) if r is not None]
        return MetricRecords(records=records, next=next_since, total=total)

    @app.get("/runs/{run_id}/samples", response_model=RecentGroups, responses=_errors(*RELAYED))
    async def run_samples(request: Request, run_id: str = RUN_ID,
                          offset: int = Query(0, ge=0, le=4096, description="Groups to skip, newest first."),
                          limit: int = Query(20, ge=1, le=100, description="Groups to return at most.")):
        """The run's newest generated groups (kept by the buffer whatever became of them since),
        paged newest first. Empty before the run's first group, and after the buffer lost its data."""
        await request.app.state.store.get(run_id)  # 404 for an unknown run
        try:
            reply = await request.app.state.driver.clients.buffer.GetRecentGroups(
                buffer_pb2.GetRecentGroupsRequest(run_id=run_id, offset=offset, limit=limit),
                timeout=settings.call_deadline_seconds)
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:  # the buffer has not set the run up (yet)
                raise
            return RecentGroups(groups=[], offset=offset, total=0)
        return RecentGroups(groups=[group_for_people(g) for g in reply.groups], offset=offset, total=reply.total)

    @app.get("/runs/{run_id}/checkpoints", response_model=list[CheckpointInfo], responses=_errors(*RELAYED))
    async def run_checkpoints(request: Request, run_id: str = RUN_ID):
        """The run's complete checkpoints in its checkpoint_dir on the trainer, oldest first (they stay
        on disk after the run ends and after DELETE)."""
        rec = await request.app.state.store.get(run_id)
        reply = await request.app.state.driver.clients.trainer.ListCheckpoints(
            trainer_pb2.ListCheckpointsRequest(run_id=run_id, checkpoint_dir=rec["config"].get("checkpoint_dir", "")),
            timeout=settings.call_deadline_seconds)
        return [CheckpointInfo(step=c.step, path=c.path, automatic=c.automatic, weight_version=c.weight_version,
                               written_at=c.written_at) for c in reply.checkpoints]

    @app.delete("/runs/{run_id}", response_model=RunDeleted, responses=_errors(*RELAYED))
    async def delete_run(request: Request, run_id: str = RUN_ID):
        """Forget a finished run: its record, metrics and buffer data; checkpoints stay on disk.
        409 while it is active: stop it first."""
        await request.app.state.driver.delete(run_id)
        return RunDeleted(id=run_id, deleted=True)

    async def refuse_if_the_active_run_uses(request: Request, name: str, removes: bool, new_weight: float = 0.0):
        """409 when the change would swap the rewards of the run training now (the reward service
        knows no runs). Checked just before the change, not atomically with it."""
        active = await request.app.state.store.active()
        if active is not None:
            listed = await request.app.state.reward.ListServices(reward_pb2.ListServicesRequest())
            check_reward_service_change(*active, name, {s.name: s.weight for s in listed.services}, removes, new_weight)

    @app.post("/reward-services", status_code=201, responses=_errors(*RELAYED, 413))
    async def register_reward_service(spec: RewardServiceSpec, request: Request):
        """Register a remote reward service by URL; refused (400) when its host is not allowed by the
        reward service's address policy, 409 when it does not answer the probe, when the name is taken
        and replace is not set, or when the active run uses the name."""
        await refuse_if_the_active_run_uses(request, spec.name, removes=spec.replace, new_weight=spec.weight)
        msg = await request.app.state.reward.RegisterService(reward_pb2.RegisterServiceRequest(
            service=reward_pb2.RemoteService(**spec.model_dump(exclude={"replace"})), replace=spec.replace))
        return _service_dict(msg)

    @app.get("/reward-services", responses=_errors(*RELAYED))
    async def list_reward_services(request: Request):
        resp = await request.app.state.reward.ListServices(reward_pb2.ListServicesRequest())
        return [_service_dict(s) for s in resp.services]

    @app.delete("/reward-services/{name}", responses=_errors(*RELAYED))
    async def unregister_reward_service(name: str, request: Request):
        """Unregister a remote reward service; 409 while the active run uses it."""
        await refuse_if_the_active_run_uses(request, name, removes=True)
        resp = await request.app.state.reward.UnregisterService(reward_pb2.UnregisterServiceRequest(name=name))
        return {"removed": resp.removed}

    @app.get("/reward-services/stats", responses=_errors(*RELAYED))
    async def reward_stats(request: Request):
        """Per remote service: calls, failures, retries, breaker state, latency."""
        return _service_dict(await request.app.state.reward.GetStats(reward_pb2.GetRewardStatsRequest()))

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    mount_page(app)

    return app


API_TASK = "rlmesh-coordinator-api"  # the task serving the API that start() runs


async def start(settings: Settings) -> tuple[uvicorn.Server, int]:
    """Start the API in the running loop; returns the server and its bound port."""
    config = uvicorn.Config(create_app(settings), host=settings.host, port=settings.port,
                            log_level=settings.log_level.lower(), lifespan="on")
    server = uvicorn.Server(config)
    asyncio.get_running_loop().create_task(server.serve(), name=API_TASK)
    while not server.started:
        await asyncio.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, port


async def serve(settings: Settings) -> None:
    config = uvicorn.Config(create_app(settings), host=settings.host, port=settings.port,
                            log_level=settings.log_level.lower())
    await uvicorn.Server(config).serve()
