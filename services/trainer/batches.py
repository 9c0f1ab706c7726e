"""Batches, from the buffer's sample groups to the model's inputs: the groups checked and
reduced to tensors (check_group, prepare_batch), cut into right-padded micro-batches
(collate), and what a step keeps per token (FixedTokens) and sums for its metrics
(Totals). Plain tensor code, shared by every backend (TorchBackend, MegatronBackend)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from rlmesh.common import errors
from rlmesh.common.sample import ConversionError, SampleGroup, Status, group_from_proto, validate_arrays
from rlmesh.v1 import sample_pb2


@dataclass
class TrainSample:
    """A sample reduced to what the model needs (CPU tensors)."""

    tokens: Tensor  # [L] prompt + response
    response_length: int
    loss_mask: Tensor  # [R] float
    rollout_log_probs: Tensor | None  # [R], None when the engine sent none
    reward: float

    @property
    def num_trained_tokens(self) -> float:
        return float(self.loss_mask.sum())


@dataclass
class PreparedBatch:
    samples: list[TrainSample]  # group after group
    group_sizes: list[int]
    failed: int
    truncated: int


def check_group(group: SampleGroup, vocab_size: int) -> None:
    """Raise what makes a group untrainable, whoever tries: broken arrays
    (ConversionError), no prompt tokens or token ids outside the model's vocabulary
    (InvalidArgument; the embedding lookup would fail on the device with no useful message).
    FAILED samples are not trained, so not checked."""
    for s in group.samples:
        if s.status == Status.FAILED:
            continue
        validate_arrays(s.index, len(s.tokens), s.response_length, len(s.loss_mask), len(s.rollout_log_probs))
        where = f"group {group.group_id!r}, sample {s.index}"
        if len(s.tokens) - s.response_length < 1:
            raise errors.InvalidArgument(
                f"{where}: no prompt tokens, so the first response token has nothing to be predicted from"
            )
        low, high = min(s.tokens), max(s.tokens)
        if low < 0 or high >= vocab_size:
            raise errors.InvalidArgument(
                f"{where}: tokens holds id {low if low < 0 else high}, outside the model's vocabulary "
                f"[0, {vocab_size - 1}] (was it generated with another model or tokenizer?)"
            )


def prepare_batch(groups: Sequence[SampleGroup], vocab_size: int) -> PreparedBatch:
    """Drop FAILED samples (counted), check the groups, make tensors."""
    samples: list[TrainSample] = []
    group_sizes: list[int] = []
    failed = truncated = 0
    for group in groups:
        check_group(group, vocab_size)
        kept = 0
        for s in group.samples:
            if s.status == Status.FAILED:
                failed += 1
                continue
            truncated += s.status == Status.TRUNCATED
            r = s.response_length
            samples.append(
                TrainSample(
                    tokens=torch.tensor(s.tokens, dtype=torch.long),
                    response_length=r,
                    loss_mask=torch.tensor(s.loss_mask, dtype=torch.float32) if s.loss_mask else torch.ones(r),
                    rollout_log_probs=(
                        torch.tensor(s.rollout_log_probs, dtype=torch.float32) if s.rollout_log_probs else None
                    ),
                    reward=float(s.reward),
                )
            )
            kept += 1
        if kept:
            group_sizes.append(kept)
    return PreparedBatch(samples, group_sizes, failed, truncated)


def batch_metrics(batch: PreparedBatch) -> dict[str, float]:
    samples = batch.samples
    n = len(samples)
    return {
        "samples": float(n),
        "groups": float(len(batch.group_sizes)),
        "failed_count": float(batch.failed),
        "truncated_fraction": batch.truncated / n if n else 0.0,
        "reward_mean": sum(s.reward for s in samples) / n if n else 0.0,
        "response_length_mean": sum(s.response_length for s in samples) / n if n else 0.0,
        "trained_tokens": float(sum(s.num_trained_tokens for s in samples)),
    }


@dataclass
class MicroBatch:
    """Right-padded model inputs and response-aligned [b, R] index tensors."""

    input_ids: Tensor  # [b, L]
    attention_mask: Tensor  # [b, L]
    logit_index: Tensor  # [b, R] position whose logits predict response token j
    targets: Tensor  # [b, R] the response tokens
    mask: Tensor  # [b, R] float: 1 = trained token
    stand_in: bool = False  # run only to match the other ranks' collectives (data parallelism)

    @property
    def response_width(self) -> int:
        return self.mask.shape[1]


def collate(samples: Sequence[TrainSample], pad_token_id: int, device: torch.device) -> MicroBatch:
    lengths = torch.tensor([len(s.tokens) for s in samples])
    responses = torch.tensor([s.response_length for s in samples])
    width = max(int(responses.max()), 1)
    input_ids = pad_sequence([s.tokens for s in samples], batch_first=True, padding_value=pad_token_id)
    attention_mask = (torch.arange(input_ids.shape[1]) < lengths.unsqueeze(1)).long()
    j = torch.arange(width).unsqueeze(0)
    inside = j < responses.unsqueeze(1)
    # Token at position p is predicted by the logits at p - 1.
    logit_index = torch.where(inside, (lengths - responses - 1).unsqueeze(1) + j, 0)
    targets = torch.gather(input_ids, 1, torch.where(inside, logit_index + 1, 0))
    mask = pad_to([s.loss_mask for s in samples], width)
    return MicroBatch(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        logit_index=logit_index.to(device),
        targets=targets.to(device),
        mask=mask.to(device),
    )


def pad_to(rows: Sequence[Tensor], width: int, value: float = 0.0) -> Tensor:
    """Stack 1-D tensors (at least one) into [len(rows), width], right-padded."""
    out = torch.full((len(rows), width), value, dtype=rows[0].dtype, device=rows[0].device)
    for i, row in enumerate(rows):
        out[i, : row.numel()] = row
    return out


def token_log_probs(logits: Tensor, targets: Tensor) -> Tensor:
    """log softmax(logits)[target] per position: [b, R, V], [b, R] -> [b, R]."""
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def split_evenly(n: int, parts: int) -> list[range]:
    """[0, n) cut into `parts` contiguous ranges whose sizes differ by at most one."""
    bounds = [round(k * n / parts) for k in range(parts + 1)]
    return [range(bounds[k], bounds[k + 1]) for k in range(parts)]


@dataclass
class FixedTokens:
    """What a step computes once, before any update, as [B, W] tensors."""

    old: Tensor  # log-probs of the policy before the update
    ref: Tensor | None  # log-probs of the reference model
    advantages: Tensor
    is_weights: Tensor | None  # rollout importance weights (1 where the engine sent no log-probs)
    values: Tensor | None = None  # the critic's values before the update (advantage_estimator 'gae')
    returns: Tensor | None = None  # and its regression targets

    def rows(self, index: Sequence[int], width: int) -> FixedTokens:
        """The rows of a micro-batch, cut to its response width."""
        pick = torch.as_tensor(list(index), device=self.old.device)
        fields = (self.old, self.ref, self.advantages, self.is_weights, self.values, self.returns)
        return FixedTokens(*(t[pick, :width] if t is not None else None for t in fields))


# --------------------------------------------------------------------------------------
# Metrics accumulation
# --------------------------------------------------------------------------------------


@dataclass
class Totals:
    """Sums over optimizer steps (per-step losses) and over trained tokens."""

    steps: int = 0
    skipped_steps: int = 0
    tokens: float = 0.0
    per_step: dict[str, float] = field(default_factory=dict)
    per_token: dict[str, float] = field(default_factory=dict)
    grad_norms: list[float] = field(default_factory=list)
    lr: float = 0.0

    def add_step_value(self, name: str, value: float) -> None:
        self.per_step[name] = self.per_step.get(name, 0.0) + value

    def add_token_sum(self, name: str, value: float) -> None:
        self.per_token[name] = self.per_token.get(name, 0.0) + value

    def add_token_mean(self, name: str, mean: float, tokens: float) -> None:
        """A micro-batch's mean over its `tokens` trained tokens, weighted like add_token_sum."""
        self.add_token_sum(name, mean * tokens)

    def metrics(self) -> dict[str, float]:
        out = {k: v / max(self.steps, 1) for k, v in self.per_step.items()}
        out.update({k: v / max(self.tokens, 1.0) for k, v in self.per_token.items()})
        if self.grad_norms:
            out["grad_norm"] = sum(self.grad_norms) / len(self.grad_norms)
        out["lr"] = self.lr
        out["optimizer_steps"] = float(self.steps)
        if self.skipped_steps:
            out["skipped_steps_nonfinite_grad"] = float(self.skipped_steps)
        return out


def trainable_groups(leased: list[sample_pb2.SampleGroup], vocab_size: int) -> tuple[list[SampleGroup], dict[str, str]]:
    """The leased groups that can be trained, and why each other one cannot (by group id)."""
    groups, rejected = [], {}
    for msg in leased:
        try:
            group = group_from_proto(msg)
            check_group(group, vocab_size)
        except (ConversionError, errors.InvalidArgument) as e:
            rejected[msg.group_id] = f"the trainer cannot train on it: {e}"
            continue
        groups.append(group)
    return groups, rejected


def staleness_metrics(groups: list[SampleGroup], trainer_version: int) -> dict[str, float]:
    """How many weight versions behind the trainer's the oldest tokens of each trained
    sample were generated (samples that record no version are left out)."""
    lags = [trainer_version - min(s.weight_versions) for g in groups for s in g.samples if s.weight_versions]
    if not lags:
        return {}
    return {"staleness_max": float(max(lags)), "staleness_mean": sum(lags) / len(lags)}
