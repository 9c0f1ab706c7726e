"""The Atropos-compatible trajectory API, under /atropos/<capability>/: the routes an
unmodified atroposlib environment calls in `serve` mode (register-env, info, status-env,
scored_data, scored_data_list, disconnect-env ...), with atroposlib's bodies, so that
pointing its `rollout_server_url` at this path is the only change. Thin over trajectory.py;
posted groups go to the active run's buffer with PutGroups.

Trust: the capability in the path is the run's (a random secret made when the run is
created, shown by GET /runs/{id} as trajectory_api to holders of the stack's token), since
an Atropos client sends no token header; these paths are exempt from the token check."""

from __future__ import annotations

import logging
import secrets
import uuid
import zlib
from dataclasses import dataclass

import grpc
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from rlmesh.common.errors import RlmeshError
from rlmesh.common.run_config import RunConfig
from rlmesh.common.sample import group_to_proto
from rlmesh.coordinator.config import Settings
from rlmesh.coordinator.store import RunStore
from rlmesh.coordinator.trajectory import (
    API_PREFIX,
    BadGroup,
    EnvIdentifier,
    Environment,
    Environments,
    RegisterEnv,
    Registration,
    RunView,
    ScoredData,
    scored_group,
)
from rlmesh.v1 import buffer_pb2

log = logging.getLogger(__name__)

# Run record fields counting the trajectory API's posts.
RECEIVED, REFUSED, LAST_REFUSAL = "environment_groups_received", "environment_groups_refused", "environment_refusal"


def is_trajectory_path(path: str) -> bool:
    return path.startswith(API_PREFIX + "/")


class TrajectoryError(RlmeshError):
    """An answer of the trajectory API other than 200, with its status and detail."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.http_status = status


@dataclass
class Run:
    run_id: str
    rec: dict
    cfg: RunConfig


class GzipBody:
    """ASGI middleware: a trajectory API body sent with Content-Encoding: gzip (atroposlib
    compresses bodies of 1 KiB and more) is decompressed, to at most max_bytes (413 past it:
    a small compressed body may expand without bound)."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        headers = dict(scope.get("headers") or [])
        if scope["type"] != "http" or b"gzip" not in headers.get(b"content-encoding", b"").lower():
            return await self.app(scope, receive, send)
        if not is_trajectory_path(scope["path"]):
            return await self.app(scope, receive, send)
        chunks = []
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
        try:
            body = inflate.decompress(b"".join(chunks), self.max_bytes + 1)
        except zlib.error:
            return await JSONResponse(status_code=400, content={"detail": "the body is not valid gzip"})(
                scope, receive, send
            )
        if len(body) > self.max_bytes or inflate.unconsumed_tail:
            detail = f"the decompressed body is larger than the limit of {self.max_bytes} bytes (max_request_bytes)"
            return await JSONResponse(status_code=413, content={"detail": detail})(scope, receive, send)
        scope = dict(scope)
        scope["headers"] = [(k, v) for k, v in scope["headers"] if k not in (b"content-encoding", b"content-length")]
        scope["headers"].append((b"content-length", str(len(body)).encode()))
        sent = False

        async def replay():
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


class Trajectory:
    """What the routes share: the active run found by its capability, its environments (in
    Redis with the run: they survive a coordinator restart, and any coordinator answers),
    its posts."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    async def run_of(self, request: Request, capability: str) -> Run:
        """The active run whose capability this is; 404 otherwise (a finished run's path
        answers nothing: its environments stop)."""
        rec = await request.app.state.store.active_record()
        if rec is None or not rec.get("capability") or not secrets.compare_digest(rec["capability"], capability):
            raise TrajectoryError(404, "no active run has this trajectory API path (GET /runs/{id}: trajectory_api)")
        return Run(rec["id"], rec, RunConfig.model_validate(rec["config"]))

    async def registry(self, request: Request, run: Run) -> Environments:
        stored = await request.app.state.store.environments(run.run_id)
        envs = [Environment.from_json(raw) for raw in stored]
        return Environments(run.run_id, run.cfg.environments.max_environments, envs)

    async def disconnect(self, request: Request, run: Run, env_id: int) -> dict:
        env = (await self.registry(request, run)).get(env_id)
        if env is None:
            return {"status": "failure", "error": f"env_id {env_id} is not registered"}
        env.connected = False
        await request.app.state.store.set_environment(run.run_id, env_id, env.to_json())
        return {"status": "success"}

    async def stats(self, request: Request, run_id: str) -> buffer_pb2.BufferStats:
        return await request.app.state.driver.clients.buffer.GetStats(
            buffer_pb2.GetStatsRequest(run_id=run_id), timeout=self.settings.call_deadline_seconds
        )

    def view(self, run: Run) -> RunView:
        return RunView(
            vocab_size=int(run.rec.get("vocab_size") or 0),
            max_token_length=run.cfg.environments.max_token_length,
            max_group_size=self.settings.limits.max_samples_per_prompt,
            weight_version=run.rec["weight_version"],
        )

    def groups(self, run: Run, envs: Environments, posted: list[ScoredData]) -> list:
        """Every posted group checked and converted (BadGroup names the first that is wrong)."""
        most = run.cfg.environments.max_groups_per_post
        if not 1 <= len(posted) <= most:
            raise BadGroup(
                f"the post holds {len(posted)} groups; 1..{most} (the run's environments.max_groups_per_post)"
            )
        view, groups = self.view(run), []
        for i, data in enumerate(posted):
            try:
                groups.append(scored_group(data, view, envs.poster(data.env_id)))
            except BadGroup as e:
                raise BadGroup(f"group {i}: {e}" if len(posted) > 1 else str(e)) from None
        return groups

    async def put(self, request: Request, run: Run, posted: list[ScoredData]) -> None:
        """Every posted group checked, then all written in one PutGroups (all or nothing); a
        refusal is counted on the run and answered 4xx, and the run goes on."""
        store: RunStore = request.app.state.store
        if run.rec["phase"] != "rl":
            # (a warm start's steps lease whatever is queued: an environment's group must not be
            # trained as SFT data; 503, which atroposlib retries, as it waits to register)
            raise TrajectoryError(
                503, f"the run is in its {run.rec['phase']} phase; it takes groups once RL begins (register-env)"
            )
        envs = await self.registry(request, run)
        try:
            groups = self.groups(run, envs, posted)
        except BadGroup as e:
            await store.count(run.run_id, REFUSED, len(posted))
            await store.update(run.run_id, **{LAST_REFUSAL: str(e)[:1000]})
            raise TrajectoryError(422, str(e)) from None
        put = buffer_pb2.PutGroupsRequest(run_id=run.run_id, groups=[group_to_proto(g) for g in groups])
        try:
            await request.app.state.driver.clients.buffer.PutGroups(put, timeout=self.settings.call_deadline_seconds)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # (5xx: atroposlib retries those, drops 4xx)
                raise TrajectoryError(503, f"the run's buffer is full, retry later: {e.details()}") from None
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise TrajectoryError(422, e.details()) from None
            raise
        await store.count(run.run_id, RECEIVED, len(groups))
        await store.environments_heard(run.run_id, {p.env_id for p in posted if p.env_id is not None})

    async def register_env(self, request: Request, run: Run, body: RegisterEnv) -> dict:
        """/register-env: an environment registered once the run trains (before that it is
        told to wait, as Atropos tells it before its trainer starts)."""
        if run.rec["status"] not in ("running", "paused") or run.rec["phase"] != "rl":
            return {"status": "wait for trainer to start"}
        limit, most = run.cfg.environments.max_environments, self.settings.limits.max_samples_per_prompt

        def make(stored: list[bytes]) -> tuple[str, Environment]:
            envs = Environments(run.run_id, limit, [Environment.from_json(raw) for raw in stored])
            env = envs.register(body, most)
            return env.to_json(), env

        try:
            env = await request.app.state.store.add_environment(run.run_id, make)
        except BadGroup as e:
            raise TrajectoryError(422, str(e)) from None
        log.info("run %s: environment %s registered (env_id %d)", run.run_id, env.real_name, env.env_id)
        return {
            "status": "success",
            "env_id": env.env_id,
            "wandb_name": env.real_name,
            # (no checkpoint_dir: an environment would write its own state files there)
            "checkpoint_dir": "",
            "starting_step": run.rec["rollout_id"],
            "checkpoint_interval": -1,
            "num_steps": run.cfg.num_rollouts,
        }

    async def status_env(self, request: Request, run: Run, env_id: int) -> dict:
        queued = (await self.stats(request, run.run_id)).queued_samples
        try:
            status = (await self.registry(request, run)).status(env_id, run.rec["rollout_id"], queued)
        except BadGroup as e:
            raise TrajectoryError(404, str(e)) from None
        await request.app.state.store.environments_heard(run.run_id, {env_id})
        return status


def trajectory_router(settings: Settings) -> APIRouter:
    router = APIRouter(prefix=API_PREFIX + "/{capability}", include_in_schema=False)
    t = Trajectory(settings)

    @router.get("/")
    async def root(capability: str, request: Request):
        await t.run_of(request, capability)
        return {"message": "AtroposLib API"}

    @router.post("/register")
    async def register(body: Registration, capability: str, request: Request):
        """An Atropos trainer's registration: rlmesh trains the run itself, so its settings
        are not used; answered as Atropos does (a trainer id)."""
        await t.run_of(request, capability)
        return {"uuid": uuid.uuid4().int}

    @router.post("/register-env")
    async def register_env(body: RegisterEnv, capability: str, request: Request):
        return await t.register_env(request, await t.run_of(request, capability), body)

    @router.post("/disconnect-env")
    async def disconnect_env(body: EnvIdentifier, capability: str, request: Request):
        return await t.disconnect(request, await t.run_of(request, capability), body.env_id)

    @router.get("/wandb_info")
    async def wandb_info(capability: str, request: Request):
        run = await t.run_of(request, capability)
        wandb = run.cfg.logging.wandb
        return {"group": run.run_id, "project": wandb.project if wandb else "rlmesh"}

    @router.get("/info")
    async def info(capability: str, request: Request):
        run = await t.run_of(request, capability)
        ro = run.cfg.rollout
        # Atropos counts a batch in sequences.
        return {
            "batch_size": ro.rollout_batch_size * ro.n_samples_per_prompt,
            "max_token_len": run.cfg.environments.max_token_length,
        }

    @router.get("/status")
    async def status(capability: str, request: Request):
        run = await t.run_of(request, capability)
        return {"current_step": run.rec["rollout_id"], "queue_size": (await t.stats(request, run.run_id)).queued_groups}

    @router.get("/status-env")
    async def status_env(body: EnvIdentifier, capability: str, request: Request):
        return await t.status_env(request, await t.run_of(request, capability), body.env_id)

    @router.get("/batch")
    async def batch(capability: str, request: Request):
        await t.run_of(request, capability)
        raise TrajectoryError(409, "rlmesh's trainer takes this run's batches itself; there is no batch to fetch")

    @router.get("/latest_example")
    async def latest_example(capability: str, request: Request):
        await t.run_of(request, capability)
        return {"tokens": [], "masks": [], "scores": [], "advantages": [], "ref_logprobs": [], "messages": []}

    @router.get("/reset_data")
    async def reset_data(capability: str, request: Request):
        await t.run_of(request, capability)
        raise TrajectoryError(
            409, "an rlmesh run is not reset through its trajectory API; stop it (POST /runs/{id}/stop)"
        )

    @router.post("/scored_data")
    async def scored_data(body: ScoredData, capability: str, request: Request):
        await t.put(request, await t.run_of(request, capability), [body])
        return {"status": "received"}

    @router.post("/scored_data_list")
    async def scored_data_list(body: list[ScoredData], capability: str, request: Request):
        await t.put(request, await t.run_of(request, capability), body)
        return {"status": "received", "groups_processed": len(body)}

    return router
