"""Coordinator settings (flags, RLMESH_COORDINATOR_* environment variables, or YAML)."""

from pathlib import Path

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from rlmesh.common.settings import ServiceSettings


class Settings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="RLMESH_COORDINATOR_", extra="forbid")

    port: int = Field(8000, description="HTTP port of the REST API (0 = any free port).")
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Where run state is kept.")
    key_prefix: str = Field("rlmesh", description="Prefix of the coordinator's Redis keys.")
    buffer_address: str = Field("127.0.0.1:50051", description="host:port of the buffer service.")
    rollout_address: str = Field("127.0.0.1:50052", description="host:port of the rollout service.")
    reward_address: str = Field("127.0.0.1:50053", description="host:port of the reward service.")
    trainer_address: str = Field("127.0.0.1:50054", description="host:port of the trainer service.")
    train_wait_seconds: float = Field(600.0, gt=0, description="How long a train step waits for its batch.")
    redis_max_connections: int = Field(
        50,
        ge=1,
        le=10_000,
        description="Redis connections the REST API holds at most; a request that finds "
        "them all busy waits for one (up to redis_pool_wait_seconds) instead of failing.",
    )
    redis_pool_wait_seconds: float = Field(
        10.0,
        gt=0,
        description="How long a request waits for a free Redis connection before it is answered 503 (retry later).",
    )
    log_successful_reads: bool = Field(
        False,
        description="Log every answered request (uvicorn's access log). Off: a GET or HEAD answered "
        "2xx or 3xx, a dashboard's polling, is not logged; every change, refusal and error is.",
    )
    max_request_bytes: int = Field(
        1024 * 1024, ge=1024, description="Largest request body the REST API reads (larger ones get 413)."
    )
    max_queued_runs: int = Field(
        20,
        ge=0,
        le=1000,
        description="Runs that may wait in the queue while another trains (POST /runs queues a run "
        "while one is active); past it POST /runs answers 409. 0 = no queue: a second run is refused (409).",
    )
    max_finished_runs: int = Field(
        100,
        ge=1,
        description="Finished runs kept (records, metrics and buffer data); "
        "the oldest beyond this are deleted when a run ends. Checkpoints stay on disk.",
    )
    # Deadlines of the coordinator's calls. A call past its deadline counts as an outage of
    # that service and is retried within the run's max_outage_seconds, so they are generous.
    call_deadline_seconds: float = Field(
        60.0, gt=0, description="Deadline of a quick call (buffer stats, CreateRun, EndRun, DeleteRun)."
    )
    check_deadline_seconds: float = Field(
        5.0,
        gt=0,
        description="Deadline of the checks each service makes of a new run at POST /runs (datasets, models, "
        "reward components, generate function); a service that does not answer in time is not held against the "
        "run: it is accepted and checked at setup.",
    )
    stop_trainer_wait_seconds: float = Field(
        120.0,
        ge=0,
        le=86400,
        description="How long a run that stops waits for a trainer that is down, restarting or not answering, to "
        "write the run's final model (at most the run's max_outage_seconds); past it the run is stopped without one.",
    )
    setup_deadline_seconds: float = Field(
        900.0, gt=0, description="Deadline of InitRun (loads the model) and PublishWeights (pushes it to every engine)."
    )
    work_deadline_seconds: float = Field(
        600.0,
        gt=0,
        description="Base deadline of GenerateRollout, Evaluate and "
        "TrainStep (TrainStep adds train_wait_seconds); per_group_deadline_seconds "
        "is added for each group the call handles.",
    )
    per_group_deadline_seconds: float = Field(
        30.0,
        ge=0,
        description="Deadline added per group (or eval prompt) a generation, evaluation or train call handles.",
    )
    retry_backoff_base_seconds: float = Field(
        0.5,
        gt=0,
        description="First delay before retrying a call to a "
        "service that is unavailable; doubles per retry, with jitter.",
    )
    redis_outage_seconds: float = Field(
        600.0,
        gt=0,
        description="How long the run loop's Redis commands are "
        "retried while Redis is down or restarting (the API answers 503 meanwhile).",
    )
    async_heartbeat_seconds: float = Field(
        5.0,
        gt=0,
        description="fully_async runs: how often the coordinator "
        "checks that the rollout service's generation loop runs (and restarts it).",
    )
    retry_backoff_max_seconds: float = Field(10.0, gt=0, description="Longest delay between retries.")
    log_dir: Path = Field(
        Path(".rlmesh/run-logs"),
        description="Where runs that ask for TensorBoard or W&B "
        "logging (their config's `logging`) write them: <log_dir>/<run id>/tensorboard and "
        ".../wandb. Relative to the working directory.",
    )
