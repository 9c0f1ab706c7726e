"""Choosing the next token from logits (SGLang's logits processing and sampler), and prompt log-probs.

Sampling applies, in order: logit_bias, penalties, min_new_tokens (blocks EOS/stop
tokens), temperature, then top-k / top-p / min-p filtering of the probabilities and a
multinomial draw. Log-probs follow SGLang's default (SGLANG_RETURN_ORIGINAL_LOGPROB unset):
log_softmax(logits / temperature) of the chosen token, taken *before* top-k/top-p/min-p
filtering; greedy requests get log_softmax of the raw logits. Both come after logit_bias
and penalties, as in SGLang's logits processing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from rlmesh.engine.protocol import GenerationRequest
from rlmesh.engine.sampling_params import SamplingParams


def _adjust_logits(logits: torch.Tensor, reqs: Sequence[GenerationRequest], block_ids: Iterable[int]) -> None:
    """In place: logit_bias, repetition/frequency/presence penalties, min_new_tokens."""
    block = list(block_ids)
    for row, req in enumerate(reqs):
        p = req.params
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
            logits[row, ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype)
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(req.prompt_ids) | set(req.output_ids)), dtype=torch.long)
            values = logits[row, seen]
            logits[row, seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and req.output_ids:
            counts = torch.bincount(torch.tensor(req.output_ids), minlength=logits.shape[-1]).to(logits.dtype)
            logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
        if len(req.output_ids) < p.min_new_tokens:
            stops = torch.tensor(sorted(set(block) | p.stop_token_ids), dtype=torch.long)
            logits[row, stops] = float("-inf")


def _filter_probs(probs: torch.Tensor, params: Sequence[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k, then top-p, then min-p over probabilities sorted in descending order.
    Returns the filtered (unnormalised) sorted probabilities and their token ids."""
    sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True)
    vocab = probs.shape[-1]
    top_k = torch.tensor([vocab if p.top_k == -1 else p.top_k for p in params]).unsqueeze(1)
    top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype).unsqueeze(1)
    min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype).unsqueeze(1)
    ranks = torch.arange(vocab).unsqueeze(0)
    keep = ranks < top_k
    # Keep a token while the mass before it is within top_p (the first always stays).
    keep &= (sorted_probs.cumsum(-1) - sorted_probs) <= top_p
    keep &= sorted_probs >= min_p * sorted_probs[:, :1]
    return sorted_probs * keep, sorted_ids


@dataclass
class Choice:
    token: int
    logprob: float
    top: list[tuple[float, int]]


def sample_next(
    logits: torch.Tensor,
    reqs: Sequence[GenerationRequest],
    eos_ids: Iterable[int],
    generator: torch.Generator,
) -> list[Choice]:
    """Choose the next token of every row of `logits` ([rows, vocab])."""
    # Sampling runs on the CPU in float32 (the reference engine favours simplicity).
    logits = logits.detach().to("cpu", torch.float32, copy=True)
    _adjust_logits(logits, reqs, eos_ids)
    params = [r.params for r in reqs]
    scale = torch.tensor([1.0 if p.greedy else p.temperature for p in params]).unsqueeze(1)
    logprobs = torch.log_softmax(logits / scale, dim=-1)
    tokens = logits.argmax(dim=-1)
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if sampled_rows:
        rows = torch.tensor(sampled_rows)
        probs = logprobs[rows].exp()
        sub_params = [params[i] for i in sampled_rows]
        weights, ids = _filter_probs(probs, sub_params) if any(p.needs_filtering for p in sub_params) else (probs, None)
        picks = torch.multinomial(weights, 1, generator=generator).squeeze(1)
        for j, p in enumerate(sub_params):
            if p.sampling_seed is not None:
                # Deterministic per (seed, position): the same request samples the same tokens.
                step = len(reqs[sampled_rows[j]].output_ids)
                seeded = torch.Generator().manual_seed((p.sampling_seed * 1_000_003 + step) % (2**63))
                picks[j] = torch.multinomial(weights[j], 1, generator=seeded)[0]
        tokens[rows] = picks if ids is None else ids.gather(1, picks.unsqueeze(1)).squeeze(1)
    # SGLang clamps -inf (a blocked token) to the dtype's minimum so JSON stays finite.
    logprobs = logprobs.clamp(min=torch.finfo(logprobs.dtype).min)
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    choices = []
    for row, req in enumerate(reqs):
        top: list[tuple[float, int]] = []
        if req.top_logprobs_num > 0:
            values, ids = logprobs[row].topk(min(req.top_logprobs_num, logprobs.shape[-1]))
            top = list(zip(values.tolist(), ids.tolist()))
        choices.append(Choice(int(tokens[row]), float(chosen[row]), top))
    return choices


def record_input_logprobs(req: GenerationRequest, logits: torch.Tensor, offset: int = 0) -> None:
    """Log-probs of prompt tokens from logprob_start_len (SGLang's -1: the last one);
    the first prompt token has none. logits[j] are those of prompt position offset + j
    (the positions before offset came from the prefix cache)."""
    prompt = req.prompt_ids
    start = len(prompt) - 1 if req.logprob_start_len < 0 else min(req.logprob_start_len, len(prompt) - 1)
    logprobs = torch.log_softmax(logits.float(), dim=-1).clamp(min=torch.finfo(torch.float32).min)
    for pos in range(start, len(prompt)):
        value = None if pos == 0 else float(logprobs[pos - 1 - offset, prompt[pos]])
        req.input_logprobs.append((value, prompt[pos]))
        if req.top_logprobs_num > 0:
            if pos == 0:
                req.input_top_logprobs.append(None)
            else:
                values, ids = logprobs[pos - 1 - offset].topk(min(req.top_logprobs_num, logprobs.shape[-1]))
                req.input_top_logprobs.append(list(zip(values.tolist(), ids.tolist())))
