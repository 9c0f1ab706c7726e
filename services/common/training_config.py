"""The trainer's part of a run's configuration (TrainingConfig, at the top level of
`POST /runs`, and TrainerRunConfig, what the trainer receives in InitRun): the model, its
optimizers, LoRA, weight sync, checkpoints and the KL reference. Re-exported by
run_config.py, where the rest of the run's configuration is declared."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StringConstraints, model_validator

from rlmesh.common.algorithm import AlgorithmConfig
from rlmesh.common.limits import INT32_MAX, INT64_MAX
from rlmesh.common.off_policy import OffPolicyCorrection, check_one_correction
from rlmesh.common.strict_model import StrictModel

StalePolicy = Literal["drop", "keep"]
# The warm start's own learning rate unless the run sets sft_optimizer.
DEFAULT_SFT_LR = 1e-5
# A crash loses at most about ten minutes of training by default: a bound in time, not in
# steps, because a step takes anything from a fraction of a second to many minutes.
DEFAULT_CHECKPOINT_SECONDS = 600.0
# kl_reference's named choices (anything else is a model directory).
KL_REFERENCES = ("after_warm_start", "initial")


class OptimizerConfig(StrictModel):
    lr: float = Field(1e-5, gt=0, le=1, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, le=10, description="AdamW weight decay.")
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = Field(
        (0.9, 0.999), description="AdamW betas."
    )
    grad_clip: float = Field(1.0, gt=0, le=1e6, description="Clip the global gradient norm to this value.")
    warmup_steps: int = Field(
        0, ge=0, le=INT32_MAX, description="Linear learning-rate warm-up over this many optimizer steps."
    )


class WeightSyncConfig(StrictModel):
    bucket_bytes: int = Field(
        256 * 1024 * 1024,
        ge=1,
        le=2**40,
        description="Parameters per broadcast bucket, in bytes (up to two buckets are staged at once on each side).",
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto",
        description="auto = nccl on GPU, gloo on CPU, and gloo to engines on the trainer's own GPU (NCCL refuses "
        "two ranks on one GPU; method colocated is the fast path there).",
    )
    load_format: Literal["", "flattened_bucket"] = Field(
        "", description="'flattened_bucket' sends each bucket as one flat tensor (fewer collectives)."
    )
    method: Literal["distributed", "disk", "colocated"] = Field(
        "distributed",
        description="Broadcast over a process group; or write a checkpoint the engines load; or 'colocated': engines "
        "on the trainer's accelerators sleep while it trains, then load its weights in place (sync, one_step_off).",
    )
    background: bool = Field(
        False,
        description="fully_async, method distributed: the trainer copies its weights (one more copy, on its "
        "device, in the wire dtype) and pushes them from the copy while the next step trains, instead of "
        "training only once the push has ended.",
    )
    delta: bool = Field(
        False,
        description="Distributed pushes send only the elements whose bits changed since the last push "
        "(indices and values per bucket) to engines that accept rlmesh delta updates (the reference engine; "
        "SGLang gets full pushes). The trainer keeps a copy of what it last pushed, as sent (set the trainer's "
        "weight_sync_dtype to the engines' dtype, e.g. bfloat16, for small deltas).",
    )
    delta_max_changed_fraction: float = Field(
        0.25,
        ge=0,
        le=1,
        description="A bucket in which more than this fraction of elements changed is sent "
        "whole (a delta element costs its index too: 4 bytes more).",
    )


ModuleName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_.]*$", max_length=128)]


class LoraConfig(StrictModel):
    """LoRA adapters (PEFT) on the policy: only they train; the engines get merged weights."""

    rank: int = Field(8, ge=1, le=1024, description="Rank r of each adapter's B A.")
    alpha: float = Field(16.0, gt=0, le=1e6, description="Scale numerator: the update is (alpha / rank) * B A.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input, in training passes only.")
    target_modules: Literal["all-linear"] | list[ModuleName] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        max_length=64,
        description="Names (or name suffixes) of the linear layers to adapt, or 'all-linear' (all but the "
        "output head); checked against the model when the run starts.",
    )


class TrainingConfig(StrictModel):
    """The trainer's part of a run, declared once: `POST /runs` has these fields at its top
    level and the trainer receives them unchanged (in TrainerRunConfig)."""

    model_path: str = Field(
        min_length=1, description="Local Hugging Face checkpoint directory of the policy (and its tokenizer)."
    )
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="Advantages, loss and KL.")
    off_policy: OffPolicyCorrection | None = Field(
        None,
        description="Correction for samples of older weights (see docs/training-modes.md); default: "
        "one_step_off and fully_async tis (cap 2) with ess_step_scaling (VCPO), sync none.",
    )
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="Optimizer of RL steps.")
    sft_optimizer: OptimizerConfig = Field(
        default_factory=lambda: OptimizerConfig(lr=DEFAULT_SFT_LR),
        description="Settings of the SFT warm start's steps (learning rate, its warm-up, betas, weight decay, "
        "grad_clip), never `optimizer`'s (setting optimizer.lr leaves the warm start's learning rate alone). "
        "The AdamW state is one: RL goes on from the moments the warm start built.",
    )
    kl_reference: str = Field(
        "after_warm_start",
        min_length=1,
        description="The frozen model KL is measured against (algorithm.kl_loss_coef, kl_coef): "
        "'after_warm_start' = the policy as RL begins (after the SFT warm start; model_path when there is "
        "none), 'initial' = model_path (before the warm start), or the path of a local Hugging Face model "
        "directory under the trainer's model_roots. With lora, 'initial' is the base model with the adapters "
        "disabled.",
    )
    micro_batch_size: int = Field(
        16, ge=1, le=INT32_MAX, description="Samples per forward/backward (gradient accumulation)."
    )
    num_steps_per_rollout: int = Field(1, ge=1, le=INT32_MAX, description="Optimizer steps per rollout batch.")
    lora: LoraConfig | None = Field(
        None,
        description="Train LoRA adapters instead of the whole model (torch backend); a KL reference of the "
        "model the run began from is then the base model with the adapters disabled, checkpoints hold the "
        "adapters, and the final model the merged weights (and the adapters). Not with backend 'megatron'.",
    )
    data_parallel: Literal["none", "fsdp2"] = Field(
        "none",
        description="'fsdp2': shard the model with FSDP2 across the processes of a torchrun job, each "
        "training its share of every mini-batch (torch backend only; not with lora; see docs/trainer.md).",
    )
    weight_sync: WeightSyncConfig = Field(
        default_factory=WeightSyncConfig, description="How new weights reach the engines."
    )
    checkpoint_dir: str = Field(
        "",
        description="Where the trainer saves checkpoints, under the trainer's work_dir (relative to it; "
        "default <work_dir>/<run>/checkpoints).",
    )
    checkpoint_interval: int = Field(
        0,
        ge=0,
        le=INT32_MAX,
        description="Save a checkpoint (model, optimizer, scheduler, RNG, step) to "
        "checkpoint_dir/step-NNNNNN every this many optimizer steps, written in the background; a trainer "
        "restarted with the same run resumes from the newest one. 0 = by time only (checkpoint_interval_seconds; "
        "each checkpoint is the model plus twice its size in optimizer state).",
    )
    checkpoint_interval_seconds: float = Field(
        DEFAULT_CHECKPOINT_SECONDS,
        ge=0,
        le=7 * 24 * 3600,
        description="Also save a checkpoint after the first step that ends this many seconds after the last one "
        "(or the run's start), so that a crash loses at most about this much training whatever a step costs; "
        "0 = by steps only. With both 0 a crashed run starts over. Whatever these say, the run's final model "
        "is written when it completes or is stopped (see final_model in GET /runs/{id}).",
    )
    keep_last: int = Field(
        2,
        ge=1,
        le=INT32_MAX,
        description="How many of the newest automatic checkpoints to keep; older ones "
        "rlmesh wrote are deleted (SaveCheckpoint's are never deleted).",
    )
    seed: int = Field(0, ge=0, le=INT64_MAX, description="Seed of the trainer's random state.")
    backend: Literal["torch", "megatron"] = Field(
        "torch",
        description="How the trainer holds the model: 'torch' (a transformers model on one device, or "
        "sharded over torchrun's ranks with data_parallel 'fsdp2') or "
        "'megatron' (a megatron-core GPTModel with tensor/pipeline parallelism; Llama and Qwen2 families; needs the "
        "`megatron` extra, and a trainer started under torchrun with TP x PP processes, see docs/trainer.md). Megatron trains "
        "the whole model: no lora, no data_parallel, no estimator with a critic ('gae').",
    )
    tensor_parallel_size: int = Field(
        1, ge=1, le=64, description="TP: ranks each layer is split over (backend 'megatron')."
    )
    pipeline_parallel_size: int = Field(
        1, ge=1, le=64, description="PP: pipeline stages the layers are cut into (backend 'megatron')."
    )

    @model_validator(mode="after")
    def _one_off_policy_correction(self):
        check_one_correction(
            self.off_policy, self.algorithm.rollout_is_upper is not None, self.algorithm.advantage_estimator
        )
        return self

    @model_validator(mode="after")
    def _parallel_sizes_need_megatron(self):
        if self.backend == "torch" and (self.tensor_parallel_size, self.pipeline_parallel_size) != (1, 1):
            raise ValueError("tensor_parallel_size and pipeline_parallel_size above 1 need backend 'megatron'")
        return self

    @model_validator(mode="after")
    def _megatron_trains_the_whole_model(self):
        # The megatron backend shards the model itself (TP/PP) and has no LoRA adapters,
        # no FSDP2 and no value head: refused here rather than silently ignored.
        if self.backend != "megatron":
            return self
        unsupported = [
            name
            for name, used in (
                ("lora", self.lora is not None),
                (f"data_parallel {self.data_parallel!r}", self.data_parallel != "none"),
                (f"advantage_estimator {self.algorithm.advantage_estimator!r} (a critic)", self.algorithm.needs_critic),
            )
            if used
        ]
        if unsupported:
            raise ValueError(
                f"backend 'megatron' does not support {', '.join(unsupported)}; use backend 'torch' "
                "for these (FSDP2 with data_parallel 'fsdp2')"
            )
        return self

    @model_validator(mode="after")
    def _lora_not_sharded(self):
        if self.lora is not None and self.data_parallel != "none":
            raise ValueError(
                "lora with data_parallel 'fsdp2' is not supported: LoRA's adapters are small enough to "
                "train unsharded; use one or the other"
            )
        return self

    @property
    def checkpoints_on(self) -> bool:
        """Automatic checkpoints are written (by steps, by time or both)."""
        return self.checkpoint_interval > 0 or self.checkpoint_interval_seconds > 0

    @property
    def kl_reference_path(self) -> str:
        """The model directory kl_reference names ('' for its named choices)."""
        return "" if self.kl_reference in KL_REFERENCES else self.kl_reference


class TrainerRunConfig(TrainingConfig):
    """What the trainer needs for a run (sent as JSON in Trainer.InitRun)."""

    reference_model_path: str = Field(
        "", description="Frozen reference for KL when kl_reference is 'initial'; default model_path."
    )
    kl_reference_dir: str = Field(
        "",
        description="Set by the trainer (under its work_dir): where kl_reference 'after_warm_start' writes the "
        "policy as RL begins.",
    )
    rollout_temperature: float = Field(
        1.0, gt=0, le=100, description="The engines' sampling temperature: log-probs are taken of logits / temperature."
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = the trainer service's setting.")
    staleness_bound: int | None = Field(
        None,
        ge=0,
        le=INT32_MAX,
        description="Lease only groups generated with weights at most this many versions "
        "older than the trainer's (None = no bound): the run's max_staleness, or its mode's default.",
    )
    stale_policy: StalePolicy = Field("drop", description="The run's stale_policy.")
