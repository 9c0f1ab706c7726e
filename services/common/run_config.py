"""A run's configuration: the JSON body of the coordinator's `POST /runs`, documented
once here. The coordinator hands each service its section (the trainer gets
`TrainerRunConfig` as JSON; the buffer and rollout get typed protobuf requests)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, get_args

from pydantic import Field, model_validator

from rlmesh.common.limits import INT32_MAX, INT64_MAX, MAX_DATASETS, MAX_REWARD_WEIGHT, Limits
from rlmesh.common.off_policy import resolve
from rlmesh.common.strict_model import Key, StopText, StrictModel, TokenId
from rlmesh.common.training_config import (
    LoraConfig,
    OptimizerConfig,
    StalePolicy,
    TrainerRunConfig,
    TrainingConfig,
    WeightSyncConfig,
)

# (the trainer's part lives in training_config.py; its names are this module's too)
__all__ = [
    "DEFAULT_MAX_STALENESS",
    "DatasetConfig",
    "EnvironmentsConfig",
    "EvalConfig",
    "GenerateConfig",
    "Key",
    "LoraConfig",
    "OptimizerConfig",
    "RunConfig",
    "SamplingConfig",
    "StalePolicy",
    "StrictModel",
    "TokenId",
    "TrainerRunConfig",
    "TrainingConfig",
    "WeightSyncConfig",
    "limit_violations",
    "oldest_weight_version",
]

# How engines pause for a weight push (SGLang's /pause_generation modes).
PauseMode = Literal["abort", "in_place", "retract"]
PAUSE_MODES: tuple[str, ...] = get_args(PauseMode)


class DatasetConfig(StrictModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,128}$", description="Name used in metrics and to pick eval datasets.")
    path: str = Field(
        min_length=1,
        description="Local file or directory on the buffer's machine, under the buffer's data_roots (relative "
        "to the first that holds it): JSONL, Parquet (file or directory), or a Hugging Face datasets directory "
        "written by save_to_disk.",
    )
    prompt_key: Key = Field("prompt", description="Key of the prompt: text, or a list of chat messages.")
    label_key: Key = Field("label", description="Key of the label the verifiers compare against.")
    metadata_key: str = Field(
        "", max_length=128, description="Key of a per-record dict (or JSON text) kept as sample metadata."
    )
    tools_key: str = Field(
        "tools",
        max_length=128,
        description="Key of a record's tool definitions (OpenAI "
        "function schemas, or their JSON text): in sample metadata['tools'], shown to the model "
        "through the chat template; '' = none.",
    )
    tokenizer_path: str = Field(
        "", description="Tokenizer for chat templates and token lengths; default the run's model."
    )
    apply_chat_template: bool = Field(False, description="Template prompts with the tokenizer's chat template.")
    max_prompt_length: int = Field(
        0, ge=0, le=INT32_MAX, description="Skip (and count) longer prompts; tokens, 0 = no limit."
    )
    split: str = Field("", max_length=128, description="Split of a saved DatasetDict directory (default 'train').")
    weight: float = Field(1.0, gt=0, le=1e6, description="Mixing weight among training datasets.")
    shuffle: bool = Field(True, description="Shuffle each epoch (the order depends only on seed and epoch).")
    seed: int = Field(0, ge=0, le=INT64_MAX, description="Seed of the per-epoch shuffle.")
    eval: bool = Field(False, description="An evaluation dataset (held out, handed out separately).")


class SamplingConfig(StrictModel):
    """SGLang sampling parameters (same names and meaning)."""

    max_new_tokens: int = Field(
        128, ge=1, le=INT32_MAX, description="Most tokens generated per response (at most limits.max_new_tokens)."
    )
    temperature: float = Field(1.0, ge=0, le=100, description="Softmax temperature; 0 = greedy.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling: smallest token set with this probability.")
    top_k: int = Field(-1, ge=-1, le=INT32_MAX, description="Sample among the k most likely tokens (-1 = all).")
    min_p: float = Field(0.0, ge=0, le=1, description="Drop tokens less likely than min_p times the most likely one.")
    stop: list[StopText] = Field(
        default_factory=list, max_length=32, description="Stop when any of these texts appears."
    )
    stop_token_ids: list[TokenId] = Field(
        default_factory=list, max_length=32, description="Stop when any of these tokens is generated."
    )
    ignore_eos: bool = Field(False, description="Keep generating past the end-of-sequence token.")
    no_stop_trim: bool = Field(False, description="Keep the stop text at the end of the response.")
    repetition_penalty: float = Field(1.0, gt=0, le=2, description="Divides logits of tokens already seen (1 = off).")
    frequency_penalty: float = Field(0.0, ge=-2, le=2, description="Subtracted per earlier occurrence of a token.")
    presence_penalty: float = Field(0.0, ge=-2, le=2, description="Subtracted once from every token already generated.")
    min_new_tokens: int = Field(
        0, ge=0, le=INT32_MAX, description="Do not stop before this many tokens (at most max_new_tokens)."
    )

    @model_validator(mode="after")
    def _min_within_max(self) -> SamplingConfig:
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens ({self.min_new_tokens}) is more than max_new_tokens ({self.max_new_tokens})"
            )
        return self


# Room for a run's generate options (JSON).
MAX_GENERATE_OPTIONS_BYTES = 64 * 1024


class GenerateConfig(StrictModel):
    """Which of the rollout service's registered generate functions makes the samples."""

    name: str = Field(
        "",
        pattern=r"^$|^[A-Za-z_][A-Za-z0-9_.-]{0,63}$",
        description="'' = the rollout service's default; 'agent' = the built-in tool-calling agent loop; "
        "'openai_agent' = an agent of the operator's that talks to an OpenAI-compatible endpoint; or a name the "
        "operator registered (rollout settings generate_functions). Never an import path.",
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="The function's options, checked by its own options model when the run "
        "is created (the agent loop's: tools, tool_parser, max_turns, token limits; see docs/agents.md).",
    )

    @model_validator(mode="after")
    def _bounded(self):
        if len(json.dumps(self.options)) > MAX_GENERATE_OPTIONS_BYTES:
            raise ValueError(f"options are more than {MAX_GENERATE_OPTIONS_BYTES} bytes of JSON")
        if self.options and not self.name:
            raise ValueError("options given without a generate function name")
        return self


class RolloutConfig(StrictModel):
    rollout_batch_size: int = Field(8, ge=1, le=INT32_MAX, description="Groups (prompts) per rollout.")
    n_samples_per_prompt: int = Field(8, ge=1, le=INT32_MAX, description="Samples per prompt (the group size).")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="Sampling of training rollouts.")
    group_filter: Literal["", "nonzero_std"] = Field(
        "", description="'nonzero_std' drops groups whose rewards are all equal (DAPO dynamic sampling)."
    )
    over_sampling_groups: int = Field(
        0,
        ge=0,
        le=INT32_MAX,
        description="Extra groups generated per rollout so that filtered-out groups do not shrink the batch.",
    )
    partial_rollout: bool | None = Field(
        None,
        description="Samples aborted mid-generation (surplus groups; fully_async: by a weight push) keep their "
        "partial responses and resume later (default: on in fully_async, off in the other modes).",
    )
    max_concurrency: int = Field(
        0, ge=0, le=INT32_MAX, description="Cap on in-flight engine requests (0 = service default)."
    )
    within_queue_cap: bool = Field(
        True,
        description="fully_async: start a group only while the buffer's queue cap (max_queued_groups; "
        "max_groups_ahead when tighter, as by default) has room for it, counting the groups being generated, "
        "so that no finished group waits for room and ages past max_staleness. Wherever generation outpaces "
        "training (the demo's task too, since a prompt's samples travel as one request): far fewer stale groups "
        "dropped, a faster run (docs/training-modes.md). Off: the loop keeps rollout_batch_size groups in flight "
        "whatever the queue holds.",
    )
    max_groups_ahead: int = Field(
        0,
        ge=0,
        le=2**40,
        description="fully_async within the queue cap: at most this many groups queued or being generated at "
        "once, when tighter than max_queued_groups (0 = rollout_batch_size x max_staleness less half a batch, at "
        "least a batch: the groups a push catches mid-generation finish a version later, and a full "
        "max_staleness of batches ahead left the last of them too old to train).",
    )
    apply_chat_template: bool = Field(
        False, description="Template every dataset's prompts with the model's chat template (a dataset may also ask)."
    )
    generate: GenerateConfig = Field(
        default_factory=GenerateConfig, description="The generate function (and its options) of rollouts and evals."
    )


class RewardConfig(StrictModel):
    components: dict[Key, Annotated[float, Field(ge=-MAX_REWARD_WEIGHT, le=MAX_REWARD_WEIGHT)]] = Field(
        default_factory=lambda: {"exact_match": 1.0},
        max_length=64,
        description="Reward component name -> weight; the sample's reward is the weighted sum.",
    )
    reward_key: str = Field("", max_length=128, description="Entry to use when a reward function returns a dict.")


TrainingMode = Literal["sync", "one_step_off", "fully_async"]
# The staleness bound when a run does not set max_staleness (sync is on-policy by construction).
DEFAULT_MAX_STALENESS = {"sync": None, "one_step_off": 1, "fully_async": 2}


def oldest_weight_version(version: int, bound: int | None, ahead: int = 0) -> int:
    """The oldest weight version a group may be generated with to be trained at weight
    version `version` + `ahead` under the staleness bound `bound` (None: no bound)."""
    return 0 if bound is None else max(version + ahead - bound, 0)


class EvalConfig(StrictModel):
    interval: int = Field(
        0, ge=0, le=INT32_MAX, description="Evaluate every this many rollouts (0 = only before and after)."
    )
    n_samples_per_prompt: int = Field(
        1, ge=1, le=INT32_MAX, description="Responses per eval prompt (pass@k style metrics)."
    )
    sampling: SamplingConfig = Field(
        default_factory=lambda: SamplingConfig(temperature=0.0), description="Sampling of eval responses (greedy)."
    )
    limit: int = Field(
        0,
        ge=0,
        le=INT32_MAX,
        description="Prompts per eval dataset (0 = all, up to limits.max_samples_per_call / n_samples_per_prompt).",
    )


class SftWarmupConfig(StrictModel):
    steps: int = Field(0, ge=0, le=INT32_MAX, description="SFT steps through the same pipeline before RL (0 = none).")
    batch_groups: int = Field(16, ge=1, le=INT32_MAX, description="Prompts per SFT step.")
    dataset: str = Field(
        "",
        max_length=128,
        description="A dataset of the run that only the warm start reads (its "
        "rows in order, cycling), kept out of the RL training stream and out of evaluation, so RL "
        "learns from prompts the warm start never showed; '' = the warm start reads the training "
        "stream.",
    )


class WandbConfig(StrictModel):
    """Weights & Biases logging of the run's metric records (the names the coordinator's API shows)."""

    project: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,128}$", description="The W&B project.")
    entity: str = Field(
        "",
        pattern=r"^[A-Za-z0-9_.-]{0,128}$",
        description="The W&B team or user (empty = the default of the coordinator's credentials).",
    )
    mode: Literal["offline", "online"] = Field(
        "offline",
        description="'offline' writes the run under the coordinator's log_dir (upload it later with "
        "`wandb sync`); 'online' sends it to W&B and needs WANDB_API_KEY in the coordinator's environment.",
    )


class LoggingConfig(StrictModel):
    """Where the coordinator logs each metric record besides its API (files go under its log_dir setting,
    in a directory per run). A logger that fails is skipped with a warning (counted in
    rlmesh_coordinator_run_log_failures_total); the run goes on."""

    tensorboard: bool = Field(False, description="Write TensorBoard event files (<log_dir>/<run id>/tensorboard).")
    wandb: WandbConfig | None = Field(None, description="Log to Weights & Biases (<log_dir>/<run id>/wandb).")


class EnvironmentsConfig(StrictModel):
    """A run fed from outside (source: environments): Atropos-compatible environments post
    scored groups to the coordinator's trajectory API (docs/environments.md)."""

    max_token_length: int = Field(
        4096,
        ge=2,
        le=INT32_MAX,
        description="Most tokens (prompt + response) a posted sequence may have; environments read it "
        "from /info (max_token_len) and skip longer groups themselves.",
    )
    max_groups_per_post: int = Field(
        64, ge=1, le=4096, description="Most groups one scored_data_list post may carry (a longer one is refused)."
    )
    max_environments: int = Field(
        64, ge=1, le=4096, description="Most environments that may register with the run (register-env)."
    )
    silent_after_seconds: float = Field(
        300.0,
        ge=10,
        le=86400,
        description="An environment that has neither posted a group nor asked /status-env (atroposlib asks "
        "every few seconds) for this long is no longer waited for: its min_batch_allocation lapses until it is "
        "heard from again (one that died without disconnect-env, perhaps registered again under a new env_id, "
        "would hold every batch).",
    )


class RunConfig(TrainingConfig):
    """The body of `POST /runs`: the run's own fields, the services' sections, and the
    trainer's fields (TrainingConfig) at the top level."""

    name: str = Field(
        "",
        max_length=256,
        # (no control or bidirectional-override characters: the name is shown on the page and in logs)
        pattern=r"^[^\x00-\x1f\x7f\u202a-\u202e\u2066-\u2069]*$",
        description="A name for people; the run id is generated. Printable characters only.",
    )
    datasets: list[DatasetConfig] = Field(
        min_length=1, max_length=MAX_DATASETS, description="Training and evaluation datasets."
    )
    num_rollouts: int = Field(10, ge=1, le=INT32_MAX, description="RL iterations: generate -> train -> push weights.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Generation of training samples.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="How samples are scored.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Evaluation on the eval datasets.")
    sft_warmup: SftWarmupConfig = Field(default_factory=SftWarmupConfig, description="Supervised steps before RL.")
    mode: TrainingMode = Field(
        "sync",
        description="'sync': generate, then train, then push weights. 'one_step_off': the next batch is "
        "generated (with the current weights) while this one trains. 'fully_async': the rollout service keeps "
        "rollout_batch_size groups in flight at all times and writes finished ones continuously; the engines "
        "are paused (pause_mode) only while weights are pushed.",
    )
    max_staleness: int | None = Field(
        None,
        ge=1,
        le=INT32_MAX,
        description="Train only on groups generated with weights at most this many "
        "versions older than the trainer's (default: one_step_off 1, fully_async 2; sync is always 0).",
    )
    stale_policy: StalePolicy = Field(
        "drop", description="Older groups are dropped (counted, never trained) or trained anyway (counted)."
    )
    pause_mode: PauseMode = Field(
        "abort",
        description="fully_async: how generation pauses for a weight push. 'abort' ends in-flight "
        "requests (with partial_rollout they resume from their partial response under the new weights); "
        "'in_place' and 'retract' keep them, and their later tokens come from the new weights.",
    )
    max_queued_groups: int = Field(
        0,
        ge=0,
        le=2**40,
        description="Buffer backpressure cap (0 = unlimited; "
        "fully_async: rollout_batch_size x max_staleness, at least an SFT batch).",
    )
    max_outage_seconds: float = Field(
        600.0,
        gt=0,
        le=7 * 24 * 3600,
        description="How long the run rides out a "
        "service that is down, restarting or not answering (its calls retried with "
        "backoff) before it fails naming that service.",
    )
    logging: LoggingConfig = Field(
        default_factory=LoggingConfig,
        description="TensorBoard and W&B logging of the run's metrics (optional: pip install 'rlmesh[logging]').",
    )
    source: Literal["datasets", "environments"] = Field(
        "datasets",
        description="Where training samples come from. 'datasets': the rollout service generates them from "
        "the training datasets. 'environments': Atropos-compatible environments generate and score them and "
        "post them to the run's trajectory API (GET /runs/{id}: trajectory_api); the coordinator generates "
        "nothing for RL (the eval datasets are still evaluated, and an SFT warm start, if any, reads its "
        "dataset before the environments are let in). Needs mode 'fully_async'.",
    )
    environments: EnvironmentsConfig = Field(
        default_factory=EnvironmentsConfig, description="Bounds of a run fed by environments (source: environments)."
    )

    @model_validator(mode="after")
    def _has_training_data(self):
        names = [d.name for d in self.datasets]
        warm = self.sft_warmup.dataset
        if warm and warm not in names:
            raise ValueError(f"sft_warmup.dataset: the run has no dataset {warm!r}; it has {names}")
        if any(d.name == warm and d.eval for d in self.datasets):
            raise ValueError(
                f"sft_warmup.dataset: {warm!r} is an evaluation dataset (eval: true); the warm start would train "
                "on the data that measures the run: name a dataset with eval: false"
            )
        if not any(not d.eval and d.name != warm for d in self.datasets):
            raise ValueError("datasets: at least one training dataset (eval: false, not the warm start's) is needed")
        if len(set(names)) != len(names):
            raise ValueError("datasets: names must be unique")
        # The loop writes a whole batch before training it: a smaller cap would wait forever.
        batch = max(self.rollout.rollout_batch_size, self.sft_warmup.batch_groups if self.sft_warmup.steps else 0)
        if self.max_queued_groups and self.max_queued_groups < batch:
            raise ValueError(
                f"max_queued_groups ({self.max_queued_groups}) must be 0 (no cap) or at least a "
                f"batch ({batch} groups: rollout_batch_size, sft_warmup.batch_groups)"
            )
        ahead = self.rollout.max_groups_ahead
        if ahead and ahead < self.rollout.rollout_batch_size:  # (the trainer waits for a whole batch)
            raise ValueError(
                f"rollout.max_groups_ahead ({ahead}) must be 0 (the default) or at least "
                f"rollout_batch_size ({self.rollout.rollout_batch_size})"
            )
        return self

    @model_validator(mode="after")
    def _colocation_fits_the_mode(self):
        if self.weight_sync.method == "colocated" and self.mode == "fully_async":
            raise ValueError(
                "weight_sync.method 'colocated' needs mode 'sync' or 'one_step_off': in fully_async the engines "
                "generate while the trainer trains, so they cannot give it their accelerator memory"
            )
        if self.weight_sync.background and (
            self.mode != "fully_async" or self.source != "datasets" or self.weight_sync.method != "distributed"
        ):
            raise ValueError(
                "weight_sync.background needs mode 'fully_async' with rlmesh's own generation (source 'datasets') "
                "and weight_sync.method 'distributed': in the other modes nothing trains during a push"
            )
        two = self.weight_sync.method == "colocated" and self.mode == "one_step_off"  # (the next batch queued too)
        if two and 0 < self.max_queued_groups < 2 * self.rollout.rollout_batch_size:
            raise ValueError(
                f"max_queued_groups must be 0 or at least 2 x rollout_batch_size for a colocated {self.mode}"
            )
        return self

    @model_validator(mode="after")
    def _environments_fit(self):
        if self.source != "environments":
            return self
        if self.mode != "fully_async":
            raise ValueError(
                "source 'environments' needs mode 'fully_async': environments generate continuously, on "
                "whatever weights the engines hold when they ask"
            )
        return self

    def buffer_datasets(self) -> list[DatasetConfig]:
        """The datasets as the buffer holds them: the warm start's is kept out of the training
        stream the way an eval set is."""
        return [d.model_copy(update={"eval": True}) if d.name == self.sft_warmup.dataset else d for d in self.datasets]

    def eval_datasets(self) -> list[DatasetConfig]:
        return [d for d in self.datasets if d.eval and d.name != self.sft_warmup.dataset]

    @property
    def staleness_bound(self) -> int | None:
        """max_staleness, or the mode's default when the run leaves it unset (None: no bound)."""
        return self.max_staleness if self.max_staleness is not None else DEFAULT_MAX_STALENESS[self.mode]

    @property
    def partial_rollouts(self) -> bool:
        """rollout.partial_rollout, or the mode's default when the run leaves it unset: on in
        fully_async. There every weight push aborts what is in flight; generated afresh, a
        sample finishes only if it is short enough to fit between two pushes, and with the
        defaults 2 of 5 seeds collapsed, against 0 of 10 when it resumes (docs/benchmarks.md)."""
        partial = self.rollout.partial_rollout
        return partial if partial is not None else self.mode == "fully_async"

    @property
    def queue_cap(self) -> int:
        """The buffer's max_queued_groups for the run."""
        if self.max_queued_groups or self.mode != "fully_async":
            return self.max_queued_groups
        sft_batch = self.sft_warmup.batch_groups if self.sft_warmup.steps else 0  # written at once
        return max(self.rollout.rollout_batch_size * (self.staleness_bound or 1), sft_batch)

    @property
    def groups_ahead(self) -> int:
        """rollout.max_groups_ahead, or fully_async's default (0: the queue cap alone)."""
        ahead, batch = self.rollout.max_groups_ahead, self.rollout.rollout_batch_size
        if ahead or self.mode != "fully_async" or not self.staleness_bound:
            return ahead
        return max(batch * self.staleness_bound - batch // 2, batch)

    def trainer_config(self) -> TrainerRunConfig:
        return TrainerRunConfig(
            **{name: getattr(self, name) for name in TrainingConfig.model_fields},
            # Greedy sampling (0) has no temperature to divide by.
            rollout_temperature=self.rollout.sampling.temperature or 1.0,
            staleness_bound=self.staleness_bound,
            stale_policy=self.stale_policy,
        ).model_copy(
            update={"off_policy": resolve(self.off_policy, self.mode, self.algorithm.rollout_is_upper is not None)}
        )


def limit_violations(config: RunConfig, limits: Limits) -> list[tuple[tuple[str, ...], str]]:
    """Where `config` asks for more than the operator's limits allow: (field path, message)."""
    ro, ev, sft = config.rollout, config.eval, config.sft_warmup
    groups = ro.rollout_batch_size + ro.over_sampling_groups
    checks = [
        (
            ("rollout", "rollout_batch_size"),
            groups,
            limits.max_groups_per_call,
            "max_groups_per_call",
            "rollout_batch_size + over_sampling_groups",
        ),
        (("sft_warmup", "batch_groups"), sft.batch_groups, limits.max_groups_per_call, "max_groups_per_call", ""),
        (
            ("rollout", "n_samples_per_prompt"),
            ro.n_samples_per_prompt,
            limits.max_samples_per_prompt,
            "max_samples_per_prompt",
            "",
        ),
        (
            ("eval", "n_samples_per_prompt"),
            ev.n_samples_per_prompt,
            limits.max_samples_per_prompt,
            "max_samples_per_prompt",
            "",
        ),
        (
            ("rollout", "rollout_batch_size"),
            groups * ro.n_samples_per_prompt,
            limits.max_samples_per_call,
            "max_samples_per_call",
            "samples per rollout ((rollout_batch_size + over_sampling_groups) x n_samples_per_prompt)",
        ),
        (
            ("sft_warmup", "batch_groups"),
            sft.batch_groups * ro.n_samples_per_prompt,
            limits.max_samples_per_call,
            "max_samples_per_call",
            "samples per SFT step (batch_groups x n_samples_per_prompt)",
        ),
        (
            ("eval", "limit"),
            ev.limit * ev.n_samples_per_prompt,
            limits.max_samples_per_call,
            "max_samples_per_call",
            "samples per evaluation (limit x n_samples_per_prompt)",
        ),
        (
            ("rollout", "sampling", "max_new_tokens"),
            ro.sampling.max_new_tokens,
            limits.max_new_tokens,
            "max_new_tokens",
            "",
        ),
        (
            ("eval", "sampling", "max_new_tokens"),
            ev.sampling.max_new_tokens,
            limits.max_new_tokens,
            "max_new_tokens",
            "",
        ),
        (
            ("environments", "max_groups_per_post"),
            config.environments.max_groups_per_post,
            limits.max_groups_per_call,
            "max_groups_per_call",
            "",
        ),
        (("num_rollouts",), config.num_rollouts, limits.max_num_rollouts, "max_num_rollouts", ""),
        (("sft_warmup", "steps"), sft.steps, limits.max_steps, "max_steps", ""),
        (("num_steps_per_rollout",), config.num_steps_per_rollout, limits.max_steps, "max_steps", ""),
        (("micro_batch_size",), config.micro_batch_size, limits.max_micro_batch_size, "max_micro_batch_size", ""),
        (("rollout", "max_concurrency"), ro.max_concurrency, limits.max_concurrency, "max_concurrency", ""),
    ]
    return [
        (
            loc,
            f"{what or loc[-1]} is {value}, more than the limit of {limit} (the coordinator's limits.{setting}; "
            "an operator can raise it)",
        )
        for loc, value, limit, setting, what in checks
        if value > limit
    ]
