"""The REST API's bodies and documented error statuses (the run config, the body of
POST /runs, is declared in rlmesh.common.run_config; a reward service's registration in
rlmesh.common.reward_service)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import Path
from pydantic import BaseModel, ConfigDict, Field

from rlmesh.common.paths import RUN_ID_PATTERN
from rlmesh.common.reward_service import SERVICE_NAME_PATTERN, RemoteServiceSpec

RUN_ID = Path(pattern=RUN_ID_PATTERN, description="The run's id (from POST /runs).")
SERVICE_NAME = Path(pattern=SERVICE_NAME_PATTERN, description="The reward service's name (its component name).")


class Problem(BaseModel):
    detail: str = Field(description="What went wrong and what to do about it.")
    code: str = Field("", description="The gRPC status of a service the coordinator relayed to, if one failed.")


def error_responses(*statuses: int) -> dict:
    """OpenAPI entries for the error statuses a route can answer (each with a JSON body)."""
    meaning = {
        400: "The body is not JSON, or a service refused the request's values.",
        404: "No such run or reward service.",
        409: "Conflicts with the current state (e.g. the run queue is full, the run is not finished, it "
        "has finished and cannot be paused or resumed, or it is not queued and cannot be moved).",
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


QUEUE_POSITION_DESCRIPTION = (
    "While the run waits in the queue (status 'queued'): its place, 1 = the next to start; null otherwise."
)


class RunCreated(BaseModel):
    id: str
    status: str


class RunQueued(RunCreated):
    """The answer of POST /runs and POST /runs/{id}/queue-position."""

    queue_position: int | None = Field(None, description=QUEUE_POSITION_DESCRIPTION)


class QueuePosition(BaseModel):
    """The body of POST /runs/{id}/queue-position."""

    model_config = ConfigDict(extra="forbid")  # (a misspelt field is refused, as in a run config)

    position: int = Field(
        ge=1, le=10_000, description="The run's new place in the queue: 1 = next; past the end = last."
    )


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
    waiting_for: str = Field(
        "",
        description="While the run rides out a service outage: the service it waits "
        "for and its last error (its calls are retried until max_outage_seconds); else empty.",
    )
    held: bool = Field(
        False,
        description="A paused run has come to rest at a step boundary (nothing of it is "
        "in flight); false while it finishes the step it was in when paused.",
    )
    queue_position: int | None = Field(None, description=QUEUE_POSITION_DESCRIPTION)


def run_summary(rec: dict) -> dict:
    """A run record's fields a RunSummary shows."""
    return {k: rec[k] for k in RunSummary.model_fields if k in rec}


class RunDetail(RunSummary):
    config: dict
    final_model: str = Field(
        "",
        description="Once the run has completed or stopped: its final policy, a Hugging Face model directory "
        "(transformers' from_pretrained, SGLang's --model-path) on the trainer's machine, relative to the "
        "trainer's work_dir; also in GET /runs/{id}/checkpoints (final: true).",
    )
    warnings: list[str] = Field(
        default_factory=list,
        description="What the run's metrics say may go wrong (say, samples of older weights far off the "
        "trainer's, a collapse's early sign), oldest first; see docs/training-modes.md#off-policy-correction.",
    )
    trajectory_api: str = Field(
        "",
        description="A run fed by environments (source: environments): the path of its Atropos-compatible "
        "trajectory API on this coordinator, a per-run capability in it; an environment's rollout_server_url "
        "is this coordinator's address followed by it (docs/environments.md). '' for other runs.",
    )
    environment_groups_received: int = Field(0, description="Groups environments posted that went to the buffer.")
    environment_groups_refused: int = Field(
        0, description="Groups environments posted that were refused (422), the run going on."
    )
    environment_refusal: str = Field("", description="Why the latest refused post was refused.")
    eval_before: dict
    eval_after: dict
    latest_metrics: dict
    metrics: list[dict]


class MetricRecords(BaseModel):
    records: list[dict] = Field(
        description="Metric records from position `since`, oldest first (one per "
        "iteration, evaluation or SFT step), each with only the asked-for fields."
    )
    next: int = Field(description="The `since` of the next call: it returns only records written after these.")
    total: int = Field(description="Records the run has.")


MetricField = Annotated[str, Field(min_length=1, max_length=200)]
# Fields every filtered metric record keeps, so that a curve knows where a point lies.
METRIC_KEYS = ("rollout_id", "sft_step", "step", "time", "retaken", "metrics_lost")


def pick_fields(record: dict, fields: list[str]) -> dict | None:
    """The record's asked-for fields ('name', or 'prefix*'), plus METRIC_KEYS; None without any."""
    picked = {
        k: v for k, v in record.items() if any(k == f or (f.endswith("*") and k.startswith(f[:-1])) for f in fields)
    }
    return {**{k: record[k] for k in METRIC_KEYS if k in record}, **picked} if picked else None


SampleStatus = Literal["pending", "completed", "truncated", "aborted", "failed"]


class RecentGroups(BaseModel):
    groups: list[dict] = Field(
        description="The newest stored groups, newest first: prompt, responses, rewards "
        "and components, status, weight versions, metadata (an agent sample's tool turns "
        "are in metadata.agent_turns); no per-token arrays."
    )
    offset: int
    total: int = Field(
        description="Groups kept (the buffer keeps the newest recent_groups of a run), or with a "
        "filter the kept groups that match."
    )
    kept: int = Field(0, description="Groups kept, filter or not.")


class CheckpointInfo(BaseModel):
    step: int
    path: str = Field(
        description="Relative to the trainer's work_dir, as final_model: a model_path (or kl_reference) takes it as it is."
    )
    automatic: bool = Field(
        description="Written every checkpoint_interval steps (pruned to keep_last); else saved on request."
    )
    weight_version: int
    written_at: float = Field(description="Unix seconds.")
    final: bool = Field(False, description="The run's final model: a model directory, not a checkpoint to resume.")


class RewardServiceRegistration(RemoteServiceSpec):
    """The body of POST /reward-services: the registration, and whether it replaces one."""

    replace: bool = Field(
        False,
        description="Replace a service registered under this name (409 otherwise); "
        "refused (409) while the active run uses it.",
    )
