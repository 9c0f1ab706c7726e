"""What a backend is built from: the device, the model loaded from a local Hugging Face
directory (never a download), and an AdamW optimizer with its linear warm-up."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from rlmesh.common import errors
from rlmesh.common.model_building import build_hf_model
from rlmesh.common.run_config import OptimizerConfig, TrainerRunConfig


def resolve_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise errors.InvalidArgument("device: 'cuda' was asked for but this trainer has no CUDA device")
    return torch.device(requested)


@dataclass
class Optimizer:
    config: OptimizerConfig
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scheduled: bool = True  # its scheduler sets its learning rate (else: its config and warm-up, each step)
    taken: int = 0  # steps taken with these settings (in this process)

    def apply_settings(self) -> None:
        """Its settings on the AdamW parameter groups, before a step (the state may be shared)."""
        warmup = self.config.warmup_steps
        for group in self.optimizer.param_groups:
            if not self.scheduled:
                group["lr"] = self.config.lr * (min(1.0, (self.taken + 1) / warmup) if warmup else 1.0)
            group.update(betas=self.config.betas, weight_decay=self.config.weight_decay)
        self.taken += 1


def build_optimizers(params: list[torch.nn.Parameter], config: TrainerRunConfig) -> dict[str, Optimizer]:
    """RL's optimizer ("rl"), and the warm start's ("sft"): its own settings on the RL
    optimizer's AdamW state, so RL goes on from the moments the warm start built (a fresh
    AdamW at the demo's learning rate moved every weight by the full step at once, and the
    policy collapsed)."""
    rl = build_optimizer(params, config.optimizer)
    return {"rl": rl, "sft": Optimizer(config.sft_optimizer, rl.optimizer, rl.scheduler, scheduled=False)}


def build_optimizer(params: list[torch.nn.Parameter], config: OptimizerConfig) -> Optimizer:
    optimizer = torch.optim.AdamW(params, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
    warmup = config.warmup_steps
    # Linear warmup: step k (0-based) runs at lr * (k + 1) / warmup until warmup is reached.
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda k: min(1.0, (k + 1) / warmup) if warmup > 0 else 1.0
    )
    return Optimizer(config, optimizer, scheduler)


def load_model(path: str, device: torch.device, what: str = "model_path") -> PreTrainedModel:
    if not Path(path).is_dir():
        raise errors.InvalidArgument(f"{what}: {path!r} is not a directory (a local Hugging Face checkpoint)")
    try:
        model = build_hf_model(AutoModelForCausalLM.from_pretrained, path, dtype=torch.float32, local_files_only=True)
    except (OSError, ValueError) as e:  # (its message names the directory: said as the setting instead)
        raise errors.InvalidArgument(
            f"{what}: cannot load a causal LM from it: {str(e).replace(str(path), what)}"
        ) from None
    return model.to(device).eval()


def vocabulary_size(path: Path) -> int | None:
    """The vocabulary of the model at `path` (its config's vocab_size), or None when its
    config does not say (the model's own load then reports what is wrong)."""
    try:
        size = getattr(AutoConfig.from_pretrained(path, local_files_only=True), "vocab_size", None)
    except (OSError, ValueError):
        return None
    return int(size) if isinstance(size, int) and size > 0 else None


def token_id_problems(vocab_size: int, token_ids: list[tuple[str, list[int]]]) -> list[tuple[str, str]]:
    """(field, message) for each field naming a token id the model cannot produce."""
    problems = []
    for field, ids in token_ids:
        outside = sorted({i for i in ids if not 0 <= i < vocab_size})
        if outside:
            problems.append(
                (
                    field,
                    f"token id(s) {outside[:10]} are outside the model's vocabulary [0, {vocab_size - 1}]: "
                    "the engines would refuse every request",
                )
            )
    return problems
