"""Buffer service settings (flags, RLMESH_BUFFER_* environment variables, or YAML)."""

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from services.common.settings import ServiceSettings


class Settings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="RLMESH_BUFFER_", extra="forbid")

    port: int = Field(50051, description="gRPC port (0 = any free port).")
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="The Redis that holds all buffer state.")
    key_prefix: str = Field("rlmesh", description="Prefix of every Redis key (runs live under <prefix>:run:<id>:).")
    prompt_lease_seconds: float = Field(600.0, gt=0, description="Default lease on prompts handed to a rollout worker.")
    batch_lease_seconds: float = Field(600.0, gt=0, description="Default lease on a training batch until its ack.")
    poll_interval_seconds: float = Field(0.02, gt=0, description="How often a waiting LeaseBatch checks the queue.")
