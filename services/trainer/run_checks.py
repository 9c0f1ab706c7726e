"""What the trainer checks of a new run at the coordinator's door (CheckRun), before
anything starts: its paths (run_paths), the token ids the run sends the engines against the
model's vocabulary, and a device and weight-sync backend this machine has. Each problem is a
(field, message) naming the setting to change."""

from __future__ import annotations

import torch

from rlmesh.common import errors
from rlmesh.common.run_config import TrainerRunConfig
from rlmesh.trainer.loading import resolve_device, token_id_problems, vocabulary_size
from rlmesh.trainer.run_paths import RunPaths


def run_problems(
    paths: RunPaths, config: TrainerRunConfig, device: str, token_ids: list[tuple[str, list[int]]]
) -> list[tuple[str, str]]:
    """Every problem found; `device` is the trainer's own setting (a run's "auto")."""
    problems = paths.check_run(config)
    if token_ids and not any(field == "model_path" for field, _ in problems):
        vocab_size = vocabulary_size(paths.model_dir(config.model_path, "model_path"))
        if vocab_size:
            problems += token_id_problems(vocab_size, token_ids)
    try:
        on = resolve_device(config.device if config.device != "auto" else device)
    except errors.InvalidArgument as e:
        return [*problems, ("device", str(e))]
    if config.weight_sync.backend == "nccl" and (on.type != "cuda" or not torch.cuda.is_available()):
        problems.append(
            (
                "weight_sync.backend",
                "'nccl' needs the trainer on a GPU and this trainer runs on the CPU: use 'auto' (gloo on CPU)",
            )
        )
    return problems
