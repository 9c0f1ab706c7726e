"""Rollout service settings (flags, RLMESH_ROLLOUT_* environment variables, or YAML)."""

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from rlmesh.common.plugins import PluginPath
from rlmesh.common.settings import ServiceSettings


class Settings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="RLMESH_ROLLOUT_", extra="forbid")

    port: int = Field(50052, description="gRPC port (0 = any free port).")
    buffer_address: str = Field("127.0.0.1:50051", description="host:port of the buffer service.")
    reward_address: str = Field("127.0.0.1:50053", description="host:port of the reward service.")
    engine_urls: list[str] = Field(
        default_factory=lambda: ["http://127.0.0.1:30000"],
        description="Inference engines (SGLang servers or the reference engine), by base URL.",
    )
    router_url: str = Field(
        "", description="An SGLang router: generation goes through it; weight calls go to its workers (GET /workers)."
    )
    engine_api_key: str = Field(
        "", description="API key the engines demand (SGLang's --api-key), sent as a bearer token; "
        "best set through the environment (RLMESH_ROLLOUT_ENGINE_API_KEY); empty = the stack's token.", repr=False,
    )
    tokenizer_path: str = Field("", description="Tokenizer directory; default: the engines' tokenizer_path.")
    max_concurrency: int = Field(256, ge=1, description="Default cap on in-flight /generate requests.")
    request_timeout_seconds: float = Field(
        30.0, gt=0, description="Timeout of an engine control call (model info, abort, pause): a frozen engine "
        "is noticed within it.")
    generate_timeout_seconds: float = Field(
        120.0, gt=0, description="Base timeout of one /generate call; generate_seconds_per_token is added per "
        "max_new_tokens. A frozen engine is noticed within it and the sample retried on another engine.")
    generate_seconds_per_token: float = Field(
        0.2, ge=0, description="Timeout added to a /generate call per token it may generate (max_new_tokens).")
    peer_outage_seconds: float = Field(
        120.0, gt=0, description="How long one generation or scoring call keeps retrying engines or the reward "
        "service that are down, restarting or frozen (backoff with jitter; another engine when there are several) "
        "before the rollout fails UNAVAILABLE (the coordinator then retries it within the run's outage budget).")
    reward_timeout_seconds: float = Field(600.0, gt=0, description="Deadline of one ScoreGroups call to the "
                                          "reward service (past it the call is retried, as for UNAVAILABLE).")
    weight_update_timeout_seconds: float = Field(600.0, gt=0, description="Timeout of a weight-update call.")
    buffer_timeout_seconds: float = Field(60.0, gt=0, description="Deadline of one call to the buffer (a write "
                                          "waiting on the buffer's queue cap is retried, not cut short).")
    sample_timeout_seconds: float = Field(
        900.0, gt=0, description="Longest one sample's generate function may take (all its turns and retries); "
        "past it the sample is FAILED with the reason and the rollout goes on.")
    generate_function: PluginPath = Field(
        "rlmesh.rollout.generation:default_generate",
        description="Generate function by import path (module:function): async (ctx, sample, sampling_params) -> "
        "Sample or list of Samples. Set by the operator only; requests cannot.",
    )
