"""What the trainer's calls answer (a run's status, a train step's result), and the run
config it takes, parsed from InitRun's JSON: plain data the gRPC layer converts."""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import ValidationError

from rlmesh.common import errors
from rlmesh.common.run_config import TrainerRunConfig


def parse_run_config(config_json: str) -> TrainerRunConfig:
    """TrainerRunConfig from InitRun's JSON; a bad field is InvalidArgument naming it."""
    try:
        config = TrainerRunConfig.model_validate_json(config_json)
    except ValidationError as e:
        problems = errors.validation_problems(e, "config")
        raise errors.InvalidArgument(f"invalid trainer config: {problems}") from None
    return config


@dataclass
class RunStatus:
    run_id: str
    step: int
    weight_version: int
    model_path: str
    resumed_step: int = 0  # step of the checkpoint the run resumed from; 0 = a fresh start
    step_in_flight: bool = False  # a TrainStep leases, trains or acknowledges now
    unacknowledged_step: int = 0  # a trained step whose acknowledgment has not landed (retried until it does)
    waiting_for: list[str] = field(default_factory=list)  # what the trainer waits for now (its buffer)
    final_model: str = ""  # EndRun: where the run's final model was written, relative to work_dir
    final_model_problem: str = ""  # EndRun: why none was written
    vocab_size: int = 0  # the model's: token ids of a trainable group are below it


@dataclass
class StepResult:
    step: int
    groups_trained: int
    samples_trained: int
    metrics: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0  # the forward/backward passes and the optimizer step, not the wait for a batch
    no_batch: bool = False  # (answer_without_batch) no full batch came within the wait: nothing trained
    stale_groups_dropped: int = 0  # while waiting for a batch
