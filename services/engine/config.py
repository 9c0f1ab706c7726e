"""Settings of the CPU reference inference engine (an HTTP server that speaks SGLang's
native API over a Hugging Face causal LM). `rlmesh serve engine --help` prints them."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from rlmesh.common.settings import ServiceSettings


class Settings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="RLMESH_ENGINE_", extra="forbid")

    model_path: str = Field("", description="Local Hugging Face checkpoint directory of a causal LM (required).")
    tokenizer_path: str = Field("", description="Tokenizer directory; empty means model_path.")
    served_model_name: str = Field("", description="Name reported by /get_model_info; empty means model_path.")
    device: str = Field(
        "cpu", description="Torch device the model runs on; built and tested for 'cpu' ('cuda' is untested)."
    )
    dtype: str = Field(
        "float32", description="Parameter dtype: float32, bfloat16, float16, or 'auto' for the checkpoint's own."
    )
    attn_implementation: str = Field("sdpa", description="transformers attention implementation: sdpa or eager.")
    max_batch_size: int = Field(
        64, ge=1, description="Most sequences decoded together (SGLang's max_running_requests)."
    )
    context_length: int = Field(
        0, ge=0, description="Longest prompt + output in tokens; 0 means the model's max_position_embeddings."
    )
    num_threads: int = Field(
        1,
        ge=0,
        description="torch.set_num_threads for the engine process; 0 leaves torch's "
        "default. One by default: a decode step of a small model is too little work to split, and "
        "two threads on two cores shared with the rollout and trainer spent 17x the CPU "
        "(bench.async); raise it for a large model on many cores.",
    )
    prefix_cache_mb: float = Field(
        256.0,
        ge=0,
        description="Memory (MiB) of the prefix cache: the KV of prompts and finished sequences, so that requests "
        "sharing a prefix (a GRPO group's samples, an agent's turns) compute it once; least recently used first "
        "out. 0 turns it off. Emptied by every weight update.",
    )
    weight_version: str = Field("default", description="Weight version reported until the first weight update.")
    seed: int | None = Field(None, description="Seed of the sampling random generator; empty means random.")
    weight_delta: bool = Field(
        True,
        description="Accept rlmesh delta weight updates (only changed elements; docs/engine-api.md) and "
        "advertise them in /get_server_info. Off, the engine behaves like SGLang, which has none: pushes come in full.",
    )
    weight_group_timeout_s: float = Field(
        300.0, gt=0, description="How long joining a weight-update group or receiving a broadcast may take."
    )
    health_generate_timeout_s: float = Field(
        20.0, gt=0, description="/health_generate answers 503 when a one-token generation takes longer than this."
    )
    shutdown_grace_s: float = Field(
        30.0,
        ge=0,
        description="On SIGTERM, in-flight requests are aborted (answering with their partial output); "
        "this bounds how long the server then waits for their responses to be sent.",
    )
    max_request_bytes: int = Field(
        64 * 1024 * 1024,
        ge=1024,
        description="Largest request body read (larger ones get 413): batches of token "
        "ids and weight-update bodies fit well under the default.",
    )
    api_key: str = Field(
        "",
        description="As SGLang's --api-key: every route but /health* needs 'Authorization: Bearer <key>' "
        "(empty = the stack's token). Best set through the environment (RLMESH_ENGINE_API_KEY), not a flag.",
        repr=False,
    )
    enable_metrics: bool = Field(
        False,
        description="As SGLang's --enable-metrics: serve Prometheus metrics at GET /metrics, with SGLang's "
        "names (sglang:num_running_reqs, sglang:num_queue_reqs, sglang:gen_throughput, sglang:prompt_tokens_total, "
        "sglang:generation_tokens_total; label model_name), open like SGLang's.",
    )
    weight_roots: list[str] = Field(
        [],
        description="Directories whose checkpoints /update_weights_from_disk loads (where trainers that share "
        "this machine's file system write them: their work_dir); a model_path elsewhere is refused, with the same "
        "answer whether or not it exists. Empty means only model_path itself (reloading the served model).",
    )
    weight_file_dir: str = Field(
        "",
        description="Colocated mode: the only directory whose rlmesh weight files /update_weights_from_tensor "
        "maps (shared with the trainer on this machine); empty means /dev/shm/rlmesh (or <tmp>/rlmesh without "
        "/dev/shm). Paths outside it are refused.",
    )
    reported_version: str = Field(
        "0.5.23", description="SGLang version reported by /get_server_info (the API level this engine mimics)."
    )
