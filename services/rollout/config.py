"""Rollout service settings (flags, RLMESH_ROLLOUT_* environment variables, or YAML)."""

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_settings import SettingsConfigDict

from rlmesh.common.plugins import PluginPath
from rlmesh.common.settings import GrpcServiceSettings
from rlmesh.rollout.discovery import DiscoveryConfig

# The generate functions every rollout service has; `generate_functions` adds the operator's.
BUILTIN_GENERATE_FUNCTIONS = {
    "default": "rlmesh.rollout.generation:default_generate",
    "agent": "rlmesh.rollout.agents.loop:agent_generate",
    "openai_agent": "rlmesh.rollout.agents.openai_agent:openai_agent_generate",
}


class HttpTool(BaseModel):
    """A tool served over HTTP: the agent loop POSTs the call's arguments as a JSON object
    and gives the model the answer's body as the tool's output."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$", description="Name the model calls it by.")
    url: str = Field(max_length=2048, description="http:// or https:// URL that takes the call's arguments.")
    description: str = Field("", max_length=4096, description="What the tool does (shown to the model).")
    parameters: dict[str, Any] = Field(
        default_factory=lambda: {"type": "object", "properties": {}},
        description="JSON schema of the arguments (shown to the model through the chat template).",
    )
    timeout_seconds: float = Field(10.0, gt=0, le=600, description="Deadline of one call.")
    retries: int = Field(
        2, ge=0, le=10, description="Retries of a call that failed to connect, timed out or got a 5xx."
    )
    max_concurrency: int = Field(16, ge=1, le=1024, description="Calls of this tool in flight at once.")


class Settings(GrpcServiceSettings):
    model_config = SettingsConfigDict(env_prefix="RLMESH_ROLLOUT_", extra="forbid")

    port: int = Field(50052, description="gRPC port (0 = any free port).")
    buffer_address: str = Field("127.0.0.1:50051", description="host:port of the buffer service.")
    reward_address: str = Field("127.0.0.1:50053", description="host:port of the reward service.")
    engine_urls: list[str] = Field(
        default_factory=lambda: ["http://127.0.0.1:30000"],
        description="Inference engines (SGLang servers or the reference engine), by base URL "
        "(engine_discovery source 'static', the default).",
    )
    engine_discovery: DiscoveryConfig = Field(
        default_factory=DiscoveryConfig,
        description="Where the engines are found while the service runs: 'static' (engine_urls), 'dns' (every "
        "address of a headless Service, re-resolved), 'router' (a router's worker list), e.g. "
        '{"source": "dns", "dns_address": "engine:30000"}. New engines generate once the trainer\'s next '
        "push gave them the run's weights; vanished ones take no new request (see DiscoveryConfig).",
    )
    router_url: str = Field(
        "", description="An SGLang router: generation goes through it; weight calls go to its workers (GET /workers)."
    )
    engine_api_key: str = Field(
        "",
        description="API key the engines demand (SGLang's --api-key), sent as a bearer token; "
        "best set through the environment (RLMESH_ROLLOUT_ENGINE_API_KEY); empty = the stack's token.",
        repr=False,
    )
    tokenizer_path: str = Field("", description="Tokenizer directory; default: the engines' tokenizer_path.")
    max_concurrency: int = Field(256, ge=1, description="Default cap on in-flight /generate requests.")
    request_timeout_seconds: float = Field(
        30.0,
        gt=0,
        description="Timeout of an engine control call (model info, abort, pause): a frozen engine "
        "is noticed within it.",
    )
    generate_timeout_seconds: float = Field(
        120.0,
        gt=0,
        description="Base timeout of one /generate call; generate_seconds_per_token is added per "
        "max_new_tokens. A frozen engine is noticed within it and the sample retried on another engine.",
    )
    generate_seconds_per_token: float = Field(
        0.2, ge=0, description="Timeout added to a /generate call per token it may generate (max_new_tokens)."
    )
    peer_outage_seconds: float = Field(
        120.0,
        gt=0,
        description="How long one generation or scoring call keeps retrying engines or the reward "
        "service that are down, restarting or frozen (backoff with jitter; another engine when there are several) "
        "before the rollout fails UNAVAILABLE (the coordinator then retries it within the run's outage budget).",
    )
    reward_timeout_seconds: float = Field(
        600.0,
        gt=0,
        description="Deadline of one ScoreGroups call to the "
        "reward service (past it the call is retried, as for UNAVAILABLE).",
    )
    weight_update_timeout_seconds: float = Field(600.0, gt=0, description="Timeout of a weight-update call.")
    buffer_timeout_seconds: float = Field(
        60.0,
        gt=0,
        description="Deadline of one call to the buffer (a write "
        "waiting on the buffer's queue cap is retried, not cut short).",
    )
    sample_timeout_seconds: float = Field(
        900.0,
        gt=0,
        description="Longest one sample's generate function may take (all its turns and retries); "
        "past it the sample is FAILED with the reason and the rollout goes on.",
    )
    generate_function: PluginPath = Field(
        "rlmesh.rollout.generation:default_generate",
        description="Generate function of runs that choose none (rollout.generate.name empty), by import path "
        "(module:function): async (ctx, sample, sampling_params) -> Sample or list of Samples.",
    )
    generate_functions: dict[str, PluginPath] = Field(
        default_factory=dict,
        max_length=256,
        description="Named generate functions runs may choose (rollout.generate.name), besides the built-in "
        "'default', 'agent' and 'openai_agent': name -> import path of async (ctx, sample, sampling_params) -> "
        "Sample or list of Samples. A function's `options_model` attribute (a pydantic model) validates the run's "
        "rollout.generate.options; it reads them as ctx.options. Requests pick names, never import paths.",
    )
    tools: dict[str, PluginPath] = Field(
        default_factory=dict,
        max_length=256,
        description="Python tools the agent loop may call: name -> import path of a function (plain or async) "
        "that takes the call's arguments as keyword arguments and returns text (anything else is sent as JSON). "
        "Its schema is its `tool_schema` attribute (OpenAI function format) or is built from its signature and "
        "docstring.",
    )
    http_tools: list[HttpTool] = Field(
        default_factory=list, max_length=256, description="Tools served over HTTP, by URL (see HttpTool)."
    )
    agents: dict[str, PluginPath] = Field(
        default_factory=dict,
        max_length=256,
        description="Agents the 'openai_agent' generate function may run (its option `agent` names one): name -> "
        "import path of async (base_url, sample) -> None that talks to the OpenAI-compatible endpoint at base_url "
        "with any OpenAI client; what it generates there becomes the sample.",
    )
    openai_host: str = Field("127.0.0.1", description="Interface of the OpenAI-compatible endpoint agents call.")
    openai_port: int = Field(0, ge=0, le=65535, description="Its port (0 = any free port).")

    @model_validator(mode="after")
    def _one_engine_source(self) -> "Settings":
        if self.router_url and self.engine_discovery.source != "static":
            raise ValueError(
                "router_url sends generation through a router that lists its workers itself; "
                "engine_discovery (which sends it to each engine) cannot be used with it"
            )
        return self
