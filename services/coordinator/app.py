"""The coordinator's REST API (FastAPI): thin handlers over RunStore and RunDriver.
OpenAPI docs at /docs."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import redis.asyncio as aioredis
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from rlmesh.v1 import buffer_pb2_grpc, rollout_pb2_grpc, trainer_pb2_grpc
from services.common.errors import RlmeshError
from services.common.grpc_server import aio_channel
from services.common.run_config import RunConfig
from services.coordinator.config import Settings
from services.coordinator.runs import Clients, RunDriver, RunStore


class RunCreated(BaseModel):
    id: str
    status: str


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


class RunDetail(RunSummary):
    config: dict
    eval_before: dict
    eval_after: dict
    latest_metrics: dict
    metrics: list[dict]


def _summary(rec: dict) -> dict:
    return {**{k: rec[k] for k in RunSummary.model_fields if k in rec}, "num_rollouts": rec["config"]["num_rollouts"]}


def create_app(settings: Settings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        redis = aioredis.Redis.from_url(settings.redis_url)
        clients = Clients(
            buffer=buffer_pb2_grpc.BufferStub(aio_channel(settings.buffer_address, settings.max_message_bytes)),
            rollout=rollout_pb2_grpc.RolloutStub(aio_channel(settings.rollout_address, settings.max_message_bytes)),
            trainer=trainer_pb2_grpc.TrainerStub(aio_channel(settings.trainer_address, settings.max_message_bytes)),
        )
        app.state.store = RunStore(redis, settings.key_prefix)
        app.state.driver = RunDriver(app.state.store, clients, settings.train_wait_seconds)
        await app.state.driver.resume_active()
        yield
        await app.state.driver.close()
        await redis.aclose()

    app = FastAPI(title="rlmesh coordinator", version="0.1.0", lifespan=lifespan,
                  description="Start, stop and watch RL post-training runs.")

    @app.exception_handler(RlmeshError)
    async def rlmesh_error(request: Request, exc: RlmeshError):
        return JSONResponse(status_code=exc.http_status, content={"detail": str(exc)})

    @app.post("/runs", status_code=201, response_model=RunCreated)
    async def create_run(config: RunConfig, request: Request):
        run_id = await request.app.state.driver.submit(config)
        return RunCreated(id=run_id, status="pending")

    @app.get("/runs", response_model=list[RunSummary])
    async def list_runs(request: Request):
        return [_summary(r) for r in await request.app.state.store.list()]

    @app.get("/runs/{run_id}", response_model=RunDetail)
    async def get_run(run_id: str, request: Request):
        store: RunStore = request.app.state.store
        rec = await store.get(run_id)
        metrics = await store.metrics(run_id)
        return {**rec, **_summary(rec), "metrics": metrics, "latest_metrics": metrics[-1] if metrics else {}}

    @app.post("/runs/{run_id}/stop", response_model=RunCreated)
    async def stop_run(run_id: str, request: Request):
        return RunCreated(id=run_id, status=await request.app.state.driver.stop(run_id))

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    return app


async def start(settings: Settings) -> tuple[uvicorn.Server, int]:
    """Start the API in the running loop; returns the server and its bound port."""
    config = uvicorn.Config(create_app(settings), host=settings.host, port=settings.port,
                            log_level=settings.log_level.lower(), lifespan="on")
    server = uvicorn.Server(config)
    asyncio.get_running_loop().create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, port


async def serve(settings: Settings) -> None:
    config = uvicorn.Config(create_app(settings), host=settings.host, port=settings.port,
                            log_level=settings.log_level.lower())
    await uvicorn.Server(config).serve()
