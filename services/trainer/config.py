"""Settings of the trainer service (the process), as opposed to a run's settings
(rlmesh.common.run_config.TrainerRunConfig, sent with InitRun)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from rlmesh.common.settings import GrpcServiceSettings


class Settings(GrpcServiceSettings):
    model_config = SettingsConfigDict(env_prefix="RLMESH_TRAINER_", extra="forbid")

    port: int = Field(50054, description="gRPC port (0 = any free port).")
    buffer_address: str = Field("", description="host:port of the buffer service (TrainStep leases batches there).")
    rollout_address: str = Field(
        "", description="host:port of the rollout service (PublishWeights pushes weights through it)."
    )
    work_dir: Path = Field(
        Path(".rlmesh/trainer"),
        description="The only directory the trainer writes to: default checkpoints (<run>/checkpoints), disk "
        "weight pushes (<run>/weights), and any checkpoint path a request or run config names (relative paths "
        "are taken under it). A save replaces only a checkpoint rlmesh wrote; a run resumes only from a "
        "checkpoint under it.",
    )
    model_roots: list[Path] = Field(
        [Path("models")],
        min_length=1,
        description="Directories a run may load models from (model_path, kl_reference, reference_model_path), "
        "besides work_dir (checkpoints and final models of earlier runs): a path elsewhere is refused, with the "
        "same answer whether or not it exists. A relative path is taken under the first; relative roots are "
        "from the working directory.",
    )
    health_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="Port of this rank's HTTP GET /health (0 = off), answered by every rank, rank 0 and the "
        "torchrun ranks that serve no gRPC: 200 once the rank has joined the trainer's process group (and on rank "
        "0 serves gRPC), 503 while it joins or once the group has failed. Under torchrun local rank i listens on "
        "health_port + i. No token: like gRPC health, for probes.",
    )
    health_host: str = Field(
        "127.0.0.1", description="Address GET /health binds to (0.0.0.0 where Kubernetes probes the pod)."
    )
    # Plain str (checked below), not Literal: the CLI flag helper parses non-scalar types as JSON.
    device: str = Field("auto", description="Device when the run config says 'auto': auto, cpu or cuda.")
    mixed_precision: bool = Field(
        True, description="On CUDA, run forward passes under bfloat16 autocast (weights stay float32)."
    )
    lease_seconds: float = Field(
        0.0,
        ge=0,
        description="How long a leased batch stays ours before the buffer redelivers it (0 = buffer default).",
    )
    buffer_timeout_seconds: float = Field(
        60.0, gt=0, description="Deadline of a buffer call, added to TrainStep's wait_seconds."
    )
    buffer_outage_seconds: float = Field(
        300.0,
        gt=0,
        description="How long an acknowledgment (or rejection) is retried while the buffer is down "
        "or restarting, with backoff, before the step fails (its batch then waits for its lease to expire).",
    )
    weight_sync_master_address: str = Field(
        "127.0.0.1",
        description="Address the engines use to reach this trainer's rendezvous store when joining the weight group.",
    )
    weight_sync_bind_address: str = Field(
        "",
        description="Interface the weight group's rendezvous store listens on ('' = weight_sync_master_address); "
        "never all interfaces.",
    )
    weight_sync_dtype: str = Field(
        "", description="Dtype weights are sent in: float32, bfloat16, float16 ('' = the parameters' own)."
    )
    weight_file_dir: Path | None = Field(
        None,
        description="Colocated pushes (weight_sync.method 'colocated'): where the run's rlmesh weight file is "
        "written, shared with the engines on this machine (their weight_file_dir); empty means /dev/shm/rlmesh "
        "(or <tmp>/rlmesh without /dev/shm).",
    )
    weight_sync_timeout_seconds: float = Field(
        300.0, gt=0, description="Deadline of each weight-update call and of the weight group's collectives."
    )

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        if value not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {value!r}")
        return value

    @field_validator("weight_sync_dtype")
    @classmethod
    def _known_dtype(cls, value: str) -> str:
        if value not in ("", "float32", "bfloat16", "float16"):
            raise ValueError(f"weight_sync_dtype must be float32, bfloat16, float16 or empty, got {value!r}")
        return value
