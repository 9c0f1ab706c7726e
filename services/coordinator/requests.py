"""The protobuf requests the run loop sends, built from a run's config here and nowhere else."""

from __future__ import annotations

import json

from rlmesh.common.dataset_spec import dataset_to_proto
from rlmesh.common.run_config import RunConfig
from rlmesh.common.sampling import sampling_to_proto
from rlmesh.v1 import buffer_pb2, reward_pb2, rollout_pb2, trainer_pb2


def generate_function_spec(cfg: RunConfig) -> rollout_pb2.GenerateFunction:
    g = cfg.rollout.generate
    return rollout_pb2.GenerateFunction(name=g.name, options_json=json.dumps(g.options) if g.options else "")


def reward_spec(cfg: RunConfig) -> reward_pb2.RewardSpec:
    return reward_pb2.RewardSpec(components=cfg.reward.components, reward_key=cfg.reward.reward_key)


def create_run_request(run_id: str, cfg: RunConfig) -> buffer_pb2.CreateRunRequest:
    """The run's queue and prompt sources in the buffer."""
    return buffer_pb2.CreateRunRequest(
        run_id=run_id,
        n_samples_per_prompt=cfg.rollout.n_samples_per_prompt,
        max_queued_groups=cfg.queue_cap,
        datasets=[dataset_to_proto(d) for d in cfg.buffer_datasets()],
        tokenizer_path=cfg.model_path,
        apply_chat_template=cfg.rollout.apply_chat_template,
    )


def init_run_request(run_id: str, cfg: RunConfig) -> trainer_pb2.InitRunRequest:
    return trainer_pb2.InitRunRequest(run_id=run_id, config_json=cfg.trainer_config().model_dump_json())


def check_run_request(cfg: RunConfig) -> trainer_pb2.CheckRunRequest:
    """The trainer's part of a run config, and the token ids the run will send the engines (the
    trainer knows the model's vocabulary)."""
    token_ids = [
        trainer_pb2.TokenIds(field=f"{section}.sampling.stop_token_ids", ids=sampling.stop_token_ids)
        for section, sampling in (("rollout", cfg.rollout.sampling), ("eval", cfg.eval.sampling))
        if sampling.stop_token_ids
    ]
    return trainer_pb2.CheckRunRequest(config_json=cfg.trainer_config().model_dump_json(), token_ids=token_ids)


def rollout_request(
    run_id: str, cfg: RunConfig, num_groups: int, min_weight_version: int = 0, weight_version: int = 0
) -> rollout_pb2.GenerateRolloutRequest:
    """An RL batch (GenerateRollout), or the continuous generation's settings (StartAsyncRollout)."""
    ro = cfg.rollout
    return rollout_pb2.GenerateRolloutRequest(
        run_id=run_id,
        num_groups=num_groups,
        sampling=sampling_to_proto(ro.sampling),
        reward=reward_spec(cfg),
        group_filter=ro.group_filter,
        over_sampling_groups=ro.over_sampling_groups,
        partial_rollout=cfg.partial_rollouts,
        within_queue_cap=ro.within_queue_cap,
        max_groups_ahead=cfg.groups_ahead,
        mode="rl",
        max_concurrency=ro.max_concurrency,
        apply_chat_template=ro.apply_chat_template,
        generate=generate_function_spec(cfg),
        min_weight_version=min_weight_version,
        weight_version=weight_version,
    )


def sft_rollout_request(run_id: str, cfg: RunConfig, step: int, missing: int) -> rollout_pb2.GenerateRolloutRequest:
    """The `missing` rows the warm start's step `step` (0-based) still lacks: an interrupted
    call may have written the first ones."""
    batch = cfg.sft_warmup.batch_groups
    return rollout_pb2.GenerateRolloutRequest(
        run_id=run_id,
        num_groups=missing,
        mode="sft",
        apply_chat_template=cfg.rollout.apply_chat_template,
        dataset=cfg.sft_warmup.dataset,
        dataset_offset=step * batch + batch - missing,
    )


def evaluate_request(run_id: str, cfg: RunConfig, dataset: str, weight_version: int = 0) -> rollout_pb2.EvaluateRequest:
    return rollout_pb2.EvaluateRequest(
        run_id=run_id,
        dataset=dataset,
        n_samples_per_prompt=cfg.eval.n_samples_per_prompt,
        sampling=sampling_to_proto(cfg.eval.sampling),
        reward=reward_spec(cfg),
        limit=cfg.eval.limit,
        apply_chat_template=cfg.rollout.apply_chat_template,
        generate=generate_function_spec(cfg),
        weight_version=weight_version,
    )
