"""The coordinator's REST API (FastAPI): the app, its lifespan (Redis, the services' clients,
the run driver) and its error mapping; the routes are in routes_runs.py and
routes_reward_services.py, thin over RunStore and RunDriver. OpenAPI docs at /docs."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

import grpc
import redis.asyncio as aioredis
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from redis import exceptions as redis_errors
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff

from rlmesh.common import auth
from rlmesh.common.errors import HTTP_STATUS_BY_GRPC_CODE, RlmeshError
from rlmesh.common.grpc_server import aio_channel
from rlmesh.common.heap import freeze_long_lived
from rlmesh.common.http_guard import guard
from rlmesh.common.prometheus import metrics_response
from rlmesh.coordinator.api_docs import DOCS_PATH, declare_bearer, is_docs_asset, mount_api_docs
from rlmesh.coordinator.calls import Clients
from rlmesh.coordinator.config import Settings
from rlmesh.coordinator.driver_thread import DriverThread, close_channels
from rlmesh.coordinator.observe import CoordinatorMetrics
from rlmesh.coordinator.page import is_page_path, mount_page
from rlmesh.coordinator.routes_reward_services import reward_services_router
from rlmesh.coordinator.routes_runs import queue_router, runs_router
from rlmesh.coordinator.runs import RunDriver
from rlmesh.coordinator.schemas import Problem
from rlmesh.coordinator.store import RunStore
from rlmesh.coordinator.trajectory_api import GzipBody, is_trajectory_path, trajectory_router
from rlmesh.v1 import buffer_pb2_grpc, reward_pb2_grpc, rollout_pb2_grpc, trainer_pb2_grpc

# Probes and the API's own description need no token; they reveal nothing about runs.
OPEN_PATHS = frozenset({"/health", DOCS_PATH, "/openapi.json"})


def is_open_path(path: str) -> bool:
    # (the trajectory API checks the run's capability in its path instead: Atropos clients send no token)
    return path in OPEN_PATHS or is_page_path(path) or is_docs_asset(path) or is_trajectory_path(path)


log = logging.getLogger(__name__)

REDIS_RETRY_CAP_SECONDS = 2.0


def api_redis_client(settings: Settings) -> aioredis.Redis:
    """The API's client: at most redis_max_connections connections, for which requests queue
    (a pool that refused requests past its size answered a burst of readers 503). A Redis
    outage is answered 503 (the run loop has its own client, which rides it out)."""
    pool = aioredis.BlockingConnectionPool.from_url(
        settings.redis_url, max_connections=settings.redis_max_connections, timeout=settings.redis_pool_wait_seconds
    )
    return aioredis.Redis.from_pool(pool)  # (closes the pool when closed)


def patient_redis_client(url: str, outage_seconds: float) -> aioredis.Redis:
    """A client whose commands are retried (backoff with jitter, up to 2 s apart) while Redis
    is down or restarting, for about outage_seconds."""
    return aioredis.Redis.from_url(
        url,
        retry=Retry(
            ExponentialWithJitterBackoff(cap=REDIS_RETRY_CAP_SECONDS, base=0.1),
            retries=max(int(outage_seconds / REDIS_RETRY_CAP_SECONDS), 1),
        ),
        retry_on_error=[redis_errors.ConnectionError, redis_errors.TimeoutError],
    )


def service_channels(settings: Settings) -> dict[str, grpc.aio.Channel]:
    """Channels to the four services (for the loop that calls this)."""
    return {
        name: aio_channel(getattr(settings, f"{name}_address"), settings.max_message_bytes)
        for name in ("buffer", "rollout", "trainer", "reward")
    }


def stubs(channels: dict[str, grpc.aio.Channel]) -> Clients:
    return Clients(
        buffer=buffer_pb2_grpc.BufferStub(channels["buffer"]),
        rollout=rollout_pb2_grpc.RolloutStub(channels["rollout"]),
        trainer=trainer_pb2_grpc.TrainerStub(channels["trainer"]),
    )


def create_app(settings: Settings) -> FastAPI:
    metrics = CoordinatorMetrics(lambda: app.state.store.list())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        redis = api_redis_client(settings)
        channels = service_channels(settings)
        app.state.store = RunStore(redis, settings.key_prefix, settings.max_queued_runs)
        app.state.reward = reward_pb2_grpc.RewardStub(channels["reward"])
        driver_made: dict = {}

        async def build_driver() -> RunDriver:
            # (on the driver's own loop: its channels and Redis client belong to it)
            driver_made["channels"] = service_channels(settings)
            # The loop's own client rides out a Redis restart instead of losing track of the run.
            driver_made["redis"] = patient_redis_client(settings.redis_url, settings.redis_outage_seconds)
            return RunDriver(
                RunStore(driver_made["redis"], settings.key_prefix, settings.max_queued_runs),
                stubs(driver_made["channels"]),
                settings.train_wait_seconds,
                settings.max_finished_runs,
                settings=settings,
                metrics=metrics,
            )

        async def close_driver_clients() -> None:
            await close_channels(driver_made.get("channels", {}))
            if "redis" in driver_made:
                await driver_made["redis"].aclose()

        app.state.driver = DriverThread(settings, stubs(channels), build_driver)
        await app.state.driver.start()
        freeze_long_lived()
        yield
        await app.state.driver.close(after=close_driver_clients)
        await close_channels(channels)
        await redis.aclose()

    app = FastAPI(
        title="rlmesh coordinator",
        version="0.1.0",
        lifespan=lifespan,
        description="Start, stop and watch RL post-training runs. Every route except /health and "
        "the API docs needs `Authorization: Bearer <token>` (the stack's token).",
        responses={401: {"model": Problem, "description": "Missing or wrong bearer token."}},
        docs_url=None,  # (mount_api_docs serves it from this machine)
        redoc_url=None,
    )
    app.add_middleware(GzipBody, max_bytes=settings.max_request_bytes)  # (inside guard's size check)
    guard(app, settings.max_request_bytes)
    token = auth.required_token()
    if token:
        auth.add_http_token_check(
            app,
            token,
            is_open_path,
            lambda why: {
                "detail": f"this API needs the stack's token and the request carried {why}: send "
                f"'Authorization: Bearer <token>' ({auth.TOKEN_ENV} of the stack)"
            },
        )
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
        return JSONResponse(
            status_code=503,
            content={"detail": f"the coordinator's Redis is unavailable ({type(exc).__name__}); retry shortly"},
        )

    @app.exception_handler(grpc.aio.AioRpcError)
    async def upstream_error(request: Request, exc: grpc.aio.AioRpcError):
        status = HTTP_STATUS_BY_GRPC_CODE.get(exc.code(), 502)
        return JSONResponse(status_code=status, content={"detail": exc.details(), "code": exc.code().name})

    app.include_router(runs_router(settings))
    app.include_router(queue_router())
    app.include_router(reward_services_router(settings))
    app.include_router(trajectory_router(settings))

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    mount_page(app)
    mount_api_docs(app)
    declare_bearer(app, is_open_path, f"The stack's token ({auth.TOKEN_ENV}).")

    return app


API_TASK = "rlmesh-coordinator-api"  # the task serving the API that start() runs


class _SuccessfulReads(logging.Filter):
    """Leaves out the access log's lines of successful reads (uvicorn's record args: client,
    method, path, HTTP version, status): 200 readers polling wrote 200 lines a second, and
    formatting them was a twentieth of what a read cost the coordinator."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        return not (isinstance(args, tuple) and len(args) == 5 and args[1] in ("GET", "HEAD") and int(args[4]) < 400)


def server_config(settings: Settings, **options) -> uvicorn.Config:
    access = logging.getLogger("uvicorn.access")
    for f in [f for f in access.filters if isinstance(f, _SuccessfulReads)]:
        access.removeFilter(f)
    if not settings.log_successful_reads:
        access.addFilter(_SuccessfulReads())
    return uvicorn.Config(
        create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level.lower(), **options
    )


async def start(settings: Settings) -> tuple[uvicorn.Server, int]:
    """Start the API in the running loop; returns the server and its bound port."""
    server = uvicorn.Server(server_config(settings, lifespan="on"))
    asyncio.get_running_loop().create_task(server.serve(), name=API_TASK)
    while not server.started:
        await asyncio.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, port


async def serve(settings: Settings) -> None:
    await uvicorn.Server(server_config(settings)).serve()
