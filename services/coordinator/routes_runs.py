"""Routes under /runs: start, watch, pause, resume, stop and delete runs; their metrics,
samples and checkpoints. Thin over RunStore and RunDriver (app.state.store, .driver)."""

from __future__ import annotations

import json
import logging

import grpc
from fastapi import APIRouter, Query, Request, Response
from fastapi.exceptions import RequestValidationError

from rlmesh.common.run_config import RunConfig, limit_violations
from rlmesh.coordinator.config import Settings
from rlmesh.coordinator.door import door_problems
from rlmesh.coordinator.page import filter_group, group_for_people
from rlmesh.coordinator.runs import RunDriver
from rlmesh.coordinator.schemas import (
    RELAYED,
    RUN_ID,
    CheckpointInfo,
    MetricField,
    MetricRecords,
    QueuePosition,
    RecentGroups,
    RunCreated,
    RunDeleted,
    RunDetail,
    RunQueued,
    RunSummary,
    SampleStatus,
    error_responses,
    pick_fields,
    run_summary,
)
from rlmesh.coordinator.store import RunStore
from rlmesh.coordinator.trajectory import api_path
from rlmesh.v1 import buffer_pb2, trainer_pb2

log = logging.getLogger(__name__)
# Groups read from the buffer per call while filtering the kept ones.
_SCAN_CHUNK = 100

# Lean answers by default (a reader's request costs what it shows, not the run's whole
# history: 1,000 embedded metric records were 355 KB); more is paged.
METRICS_LAST = 10  # metric records GET /runs/{id} embeds
METRICS_PAGE = 100  # records GET /runs/{id}/metrics returns
METRICS_PAGE_MAX = 10_000
RUNS_PAGE = 1000  # runs GET /runs returns, at most


def _verbatim(stored: bytes) -> bool:
    """Whether stored metric records can be answered as they are. json.dumps writes a
    non-finite float as NaN or Infinity, which is not JSON: records with one (or a name that
    looks like one) are parsed and answered as the response model writes them (null)."""
    return b"NaN" not in stored and b"Infinity" not in stored


def _run_detail(rec: dict, records: list[bytes], latest: bytes) -> Response | dict:
    """GET /runs/{id}'s answer: the run's record, and its metric records as they are stored
    after the rest (parsing and writing them again was most of what the answer cost)."""
    fields = {**rec, **run_summary(rec), "trajectory_api": api_path(rec.get("capability", ""))}
    if not (_verbatim(latest) and all(_verbatim(r) for r in records)):
        return {**fields, "metrics": [json.loads(r) for r in records], "latest_metrics": json.loads(latest)}
    head = RunDetail.model_validate({**fields, "metrics": [], "latest_metrics": {}}).model_dump_json(
        exclude={"metrics", "latest_metrics"}
    )
    body = b'%s,"metrics":[%s],"latest_metrics":%s}' % (head[:-1].encode(), b",".join(records), latest)
    return Response(body, media_type="application/json")


async def _check_runnable(request: Request, config: RunConfig, settings: Settings) -> None:
    """422 for a run config past the operator's limits, or that a service finds it cannot run
    (door.py: each service asked about its own part)."""
    violations = limit_violations(config, settings.limits)
    if violations:
        raise RequestValidationError([{"loc": ("body", *loc), "msg": msg, "type": "limit"} for loc, msg in violations])
    driver: RunDriver = request.app.state.driver
    problems = await door_problems(driver.clients, request.app.state.reward, config, settings.check_deadline_seconds)
    if problems:
        raise RequestValidationError(problems)


def _no_groups_yet(e: grpc.aio.AioRpcError, offset: int) -> RecentGroups:
    if e.code() != grpc.StatusCode.NOT_FOUND:  # (NOT_FOUND: the buffer has not set the run up yet)
        raise e
    return RecentGroups(groups=[], offset=offset, total=0, kept=0)


async def _recent_groups(recent, offset, limit, status, min_reward, max_reward) -> RecentGroups:
    """A page of the kept groups, or of those that match a filter. The buffer keeps at most
    4096 (recent_groups' bound): with a filter they are all read, a chunk at a time."""
    if min_reward is not None and max_reward is not None and min_reward > max_reward:
        raise RequestValidationError(
            [{"loc": ("query", "min_reward"), "msg": "min_reward is above max_reward", "type": "range"}]
        )
    if status is None and min_reward is None and max_reward is None:
        reply = await recent(offset, limit)
        groups = [group_for_people(g) for g in reply.groups]
        return RecentGroups(groups=groups, offset=offset, total=reply.total, kept=reply.total)
    matched: list[dict] = []
    at, kept = 0, 1
    while at < min(kept, 4096):
        reply = await recent(at, _SCAN_CHUNK)
        kept, at = reply.total, at + _SCAN_CHUNK
        picked = (filter_group(group_for_people(g), status, min_reward, max_reward) for g in reply.groups)
        matched.extend(g for g in picked if g is not None)
        if not reply.groups:
            break
    return RecentGroups(groups=matched[offset : offset + limit], offset=offset, total=len(matched), kept=kept)


def runs_router(settings: Settings) -> APIRouter:
    router = APIRouter()

    @router.post("/runs", status_code=201, response_model=RunQueued, responses=error_responses(400, 409, 413))
    async def create_run(config: RunConfig, request: Request):
        """Start a run, or queue it while another is active (one run trains at a time): 201
        either way (the run exists), with status `pending`, or `queued` and its
        `queue_position` (1 = next). A queued run starts when the runs before it have ended.
        409 when max_queued_runs runs already wait (with max_queued_runs 0: while a run is active)."""
        await _check_runnable(request, config, settings)
        created = await request.app.state.driver.submit(config)
        return RunQueued(id=created.id, status=created.status, queue_position=created.queue_position)

    @router.get("/runs", response_model=list[RunSummary])
    async def list_runs(
        request: Request,
        response: Response,
        offset: int = Query(0, ge=0, le=10**9, description="Runs to skip, oldest first."),
        limit: int = Query(RUNS_PAGE, ge=1, le=RUNS_PAGE, description="Runs to return at most."),
    ):
        """The kept runs, oldest first (max_finished_runs finished ones, and the active one), a
        page of them: header `X-Total-Count` says how many there are."""
        records, total = await request.app.state.store.page(offset, limit)
        response.headers["X-Total-Count"] = str(total)
        return [run_summary(r) for r in records]

    @router.get("/runs/{run_id}", response_model=RunDetail, responses=error_responses(404))
    async def get_run(
        request: Request,
        run_id: str = RUN_ID,
        metrics_last: int = Query(
            METRICS_LAST,
            ge=0,
            le=METRICS_PAGE_MAX,
            description="How many of the newest metric records to return (GET "
            "/runs/{id}/metrics pages through all of them).",
        ),
    ):
        """A run: status, phase, progress, eval before/after, its newest metric record
        (`latest_metrics`) and the `metrics_last` newest ones."""
        rec, stored = await request.app.state.store.detail(run_id, max(metrics_last, 1))
        return _run_detail(rec, stored[-metrics_last:] if metrics_last else [], stored[-1] if stored else b"{}")

    @router.post("/runs/{run_id}/stop", response_model=RunCreated, responses=error_responses(404))
    async def stop_run(request: Request, run_id: str = RUN_ID):
        """Ask a run to stop at its next step; a queued run is stopped at once (it leaves the
        queue); a finished run answers its final status."""
        return RunCreated(id=run_id, status=await request.app.state.driver.stop(run_id))

    @router.post("/runs/{run_id}/pause", response_model=RunCreated, responses=error_responses(404, 409))
    async def pause_run(request: Request, run_id: str = RUN_ID):
        """Hold a pending or running run at its next step boundary: the step in flight finishes (its
        groups are trained, its weights pushed), then generation and training wait (fully_async: the
        continuous generation stops and hands its unfinished prompts back to the buffer). `held` in
        GET /runs/{id} turns true once it rests. Survives a coordinator restart. Pausing a paused run
        is a no-op; 409 for a stopping or finished run."""
        return RunCreated(id=run_id, status=await request.app.state.driver.pause(run_id))

    @router.post("/runs/{run_id}/resume", response_model=RunCreated, responses=error_responses(404, 409))
    async def resume_run(request: Request, run_id: str = RUN_ID):
        """Let a paused run carry on from where it rests; a no-op for a pending or running run,
        409 for a stopping or finished one."""
        return RunCreated(id=run_id, status=await request.app.state.driver.resume(run_id))

    @router.get("/runs/{run_id}/metrics", response_model=MetricRecords, responses=error_responses(404))
    async def run_metrics(
        request: Request,
        run_id: str = RUN_ID,
        since: int = Query(
            0,
            ge=0,
            le=10**12,
            description="Position of the first record to "
            "return: 0, or the `next` of the previous call (to poll for new ones).",
        ),
        limit: int = Query(METRICS_PAGE, ge=1, le=METRICS_PAGE_MAX, description="Records to return at most."),
        fields: list[MetricField] = Query(
            [],
            max_length=100,
            description="Only these fields "
            "(repeat the parameter; 'train/*' = every field with "
            "that prefix); rollout_id, sft_step, step and time "
            "always come along. Records with none are left out. "
            "Empty = every field.",
        ),
    ):
        """A run's metric records from a cursor, optionally only some fields: what a curve polls."""
        store: RunStore = request.app.state.store
        raw, total = await store.raw_metrics_since(run_id, since, limit)
        next_since = min(since, total) + len(raw)  # (a cursor past the end answers the end)
        records = b",".join(raw)
        if not fields and _verbatim(records):
            # The stored JSON as it is: parsing and writing it again was most of a page's cost.
            body = b'{"records":[' + records + b'],"next":%d,"total":%d}' % (next_since, total)
            return Response(body, media_type="application/json")
        records = [json.loads(r) for r in raw]
        if fields:
            records = [r for r in (pick_fields(rec, fields) for rec in records) if r is not None]
        return MetricRecords(records=records, next=next_since, total=total)

    @router.get("/runs/{run_id}/samples", response_model=RecentGroups, responses=error_responses(*RELAYED))
    async def run_samples(
        request: Request,
        run_id: str = RUN_ID,
        offset: int = Query(0, ge=0, le=4096, description="Groups to skip, newest first (of those that match)."),
        limit: int = Query(20, ge=1, le=100, description="Groups to return at most."),
        status: SampleStatus | None = Query(None, description="Only samples with this status."),
        min_reward: float | None = Query(None, allow_inf_nan=False, description="Only samples rewarded at least this."),
        max_reward: float | None = Query(None, allow_inf_nan=False, description="Only samples rewarded at most this."),
    ):
        """The run's newest generated groups (kept by the buffer whatever became of them since),
        paged newest first. Empty before the run's first group, and after the buffer lost its data.
        With a filter, each group keeps only its matching samples (`samples_total` says how many
        it had), groups with none are left out, and `total` counts the groups that match."""
        await request.app.state.store.get(run_id)  # 404 for an unknown run

        async def recent(at: int, count: int) -> buffer_pb2.GetRecentGroupsResponse:
            return await request.app.state.driver.clients.buffer.GetRecentGroups(
                buffer_pb2.GetRecentGroupsRequest(run_id=run_id, offset=at, limit=count),
                timeout=settings.call_deadline_seconds,
            )

        try:
            return await _recent_groups(recent, offset, limit, status, min_reward, max_reward)
        except grpc.aio.AioRpcError as e:
            return _no_groups_yet(e, offset)

    @router.get("/runs/{run_id}/checkpoints", response_model=list[CheckpointInfo], responses=error_responses(*RELAYED))
    async def run_checkpoints(request: Request, run_id: str = RUN_ID):
        """The run's complete checkpoints in its checkpoint_dir on the trainer, oldest first (they stay
        on disk after the run ends and after DELETE)."""
        rec = await request.app.state.store.get(run_id)
        reply = await request.app.state.driver.clients.trainer.ListCheckpoints(
            trainer_pb2.ListCheckpointsRequest(run_id=run_id, checkpoint_dir=rec["config"].get("checkpoint_dir", "")),
            timeout=settings.call_deadline_seconds,
        )
        return [
            CheckpointInfo(
                step=c.step,
                path=c.path,
                automatic=c.automatic,
                weight_version=c.weight_version,
                written_at=c.written_at,
                final=c.final,
            )
            for c in reply.checkpoints
        ]

    @router.delete("/runs/{run_id}", response_model=RunDeleted, responses=error_responses(*RELAYED))
    async def delete_run(request: Request, run_id: str = RUN_ID):
        """Forget a finished or queued run (a queued one leaves the queue): its record, metrics
        and buffer data; checkpoints stay on disk. 409 while it is active: stop it first."""
        await request.app.state.driver.delete(run_id)
        return RunDeleted(id=run_id, deleted=True)

    return router


def queue_router() -> APIRouter:
    """The run queue's own route (POST /runs queues a run; stop and DELETE /runs/{id} take one off it)."""
    router = APIRouter()

    @router.post(
        "/runs/{run_id}/queue-position", response_model=RunQueued, responses=error_responses(400, 404, 409, 413)
    )
    async def move_run(body: QueuePosition, request: Request, run_id: str = RUN_ID):
        """Move a queued run to another place in the queue (1 = next to start; past the end =
        last); the others keep their order. 409 for a run that is not queued."""
        position = await request.app.state.driver.move(run_id, body.position)
        return RunQueued(id=run_id, status="queued", queue_position=position)

    return router
