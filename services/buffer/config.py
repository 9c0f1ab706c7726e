"""Buffer service settings (flags, RLMESH_BUFFER_* environment variables, or YAML)."""

from pathlib import Path

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from rlmesh.common.plugins import PluginPath
from rlmesh.common.settings import GrpcServiceSettings


class Settings(GrpcServiceSettings):
    model_config = SettingsConfigDict(env_prefix="RLMESH_BUFFER_", extra="forbid")

    port: int = Field(50051, description="gRPC port (0 = any free port).")
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="The Redis that holds all buffer state.")
    key_prefix: str = Field("rlmesh", description="Prefix of every Redis key (runs live under <prefix>:run:<id>:).")
    prompt_lease_seconds: float = Field(600.0, gt=0, description="Default lease on prompts handed to a rollout worker.")
    batch_lease_seconds: float = Field(600.0, gt=0, description="Default lease on a training batch until its ack.")
    max_deliveries: int = Field(
        5,
        ge=1,
        description="Times a group may be leased to trainers without an acknowledgment: when its last "
        "lease expires too it goes to the run's dead-letter list (exported by ExportGroups with dead_letters) "
        "instead of being redelivered forever. A lease released because its trainer restarted from a checkpoint "
        "(RollbackToCheckpoint) does not count: see max_rollbacks.",
    )
    max_rollbacks: int = Field(
        10,
        ge=1,
        description="Times a group may be held by a trainer that died (its lease released when the trainer "
        "restarted from its checkpoint) before it goes to the run's dead-letter list: a batch that crashes every "
        "trainer that takes it must not come back forever, but a trainer preempted now and then is not its group's "
        "failure, so these count apart from max_deliveries, against their own, higher limit.",
    )
    poll_interval_seconds: float = Field(
        0.02,
        gt=0,
        description="How often a waiting LeaseBatch checks the queue. Groups written (or handed back) through "
        "the same replica wake it at once; the poll finds those written through other replicas and expired leases.",
    )
    buffer_filter: PluginPath = Field(
        "rlmesh.buffer.filters:fifo",
        description="Import path of the function choosing which queued groups a lease gets, e.g. "
        "rlmesh.buffer.filters:highest_reward_variance_first (see rlmesh.buffer.filters).",
    )
    filter_window: int = Field(4096, ge=1, description="How many of the oldest queued groups a buffer filter sees.")
    cache_megabytes: int = Field(
        256,
        ge=0,
        description="In-process copy of recently written groups, so leases skip reading them back "
        "from Redis (0 = off; Redis stays the only state).",
    )
    recent_groups: int = Field(
        512,
        ge=0,
        le=4096,
        description="Newest stored groups kept per run for people to browse (GetRecentGroups, "
        "the coordinator's GET /runs/{id}/samples and page), whatever became of them since; 0 = none kept. "
        "Each kept group's bytes (per-token arrays included) stay in Redis while it is kept: size Redis for it.",
    )
    rate_window_seconds: float = Field(60.0, gt=0, description="Window of the per-second rates in the stats.")
    data_roots: list[Path] = Field(
        [Path("data")],
        min_length=1,
        description="Directories dataset files may be read from (a run's dataset path must lie under one; a "
        "relative path is taken under the first). Relative roots are from the working directory.",
    )
    model_roots: list[Path] = Field(
        [Path("models")],
        min_length=1,
        description="Directories tokenizers may be loaded from (a dataset's tokenizer_path, or the run's model "
        "when a dataset templates or measures prompts): a path elsewhere is refused, with the same answer whether "
        "or not it exists. A relative path is taken under the first; relative roots are from the working directory.",
    )
    dataset_max_files: int = Field(
        10_000,
        ge=1,
        description="Most directory entries a dataset directory may hold (counted recursively), "
        "so a dataset path cannot make the buffer walk a whole tree.",
    )
    dataset_max_bytes: int = Field(8 * 1024**3, ge=1, description="Most bytes of files one dataset may read.")
    export_dir: Path = Field(
        Path(".rlmesh/buffer/exports"),
        description="The only directory ExportGroups writes to and ImportGroups reads from (relative request "
        "paths are taken under it); created on first export. An export never replaces an existing file.",
    )
