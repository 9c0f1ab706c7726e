"""Generation for the reference engine: SGLang's request semantics over a Hugging Face
causal LM, with continuous batching in one worker thread.

How it behaves, following SGLang (sglang/srt/sampling/sampling_params.py, layers/sampler.py,
managers/schedule_batch.py `Req.check_finished`, detokenizer `trim_matched_stop`):

- Sampling parameters have SGLang's names and defaults; an unknown key is an error (400).
  temperature < 1e-6 means greedy. Sampling applies, in order: logit_bias, penalties,
  min_new_tokens (blocks EOS/stop tokens), temperature, then top-k / top-p / min-p
  filtering of the probabilities and a multinomial draw.
- Log-probs: SGLang's default (SGLANG_RETURN_ORIGINAL_LOGPROB unset) returns
  log_softmax(logits / temperature) of the chosen token, taken *before* top-k/top-p/min-p
  filtering; greedy requests get log_softmax of the raw logits. We do the same, after
  logit_bias and penalties as SGLang's logits processing does.
- Finishing, checked after every token in SGLang's order: abort; output length reached
  max_new_tokens ({"type": "length"}); unless ignore_eos, a stop_token_id or EOS token
  ({"type": "stop", "matched": id}); a stop string or stop_regex in the decoded tail
  ({"type": "stop", "matched": str}). `output_ids` keep the matched token; `text` drops a
  matched token, and cuts at a matched string, unless no_stop_trim.
- Prompt + max_new_tokens is capped at the context length (the request then ends with
  "length" there), where SGLang would refuse unless --allow-auto-truncate.
- Pause modes: "abort" (the server aborts in-flight requests first), "in_place" (decoding
  stops, KV caches kept) and "retract" (running requests go back to the queue, their KV
  dropped; on continue they are re-prefilled with prompt + output so far, so the new
  weights see the whole sequence).

Batching: the worker admits waiting requests (up to max_batch_size running) by prefilling
them together (left padding, attention mask, explicit position ids), then merges their KV
cache into the running batch's by left-padding the shorter one; every iteration decodes
one token for every running row. Finished rows leave the batch at once, and all-padding
columns on the left are dropped. Work submitted from other threads (weight loads, weight
reads) runs between iterations, never in the middle of a forward pass.
"""

from __future__ import annotations

import collections
import logging
import math
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

log = logging.getLogger(__name__)

SAMPLING_EPS = 1e-6
MAX_STOP_STRINGS = 32
# Grammar-constrained decoding is an SGLang feature this engine does not have.
_UNSUPPORTED_KEYS = ("json_schema", "regex", "ebnf", "structural_tag")


class RequestError(ValueError):
    """Bad request input; the HTTP layer answers 400 with this message."""


# ---------------------------------------------------------------------------
# Sampling parameters
# ---------------------------------------------------------------------------


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: set[int] = field(default_factory=set)
    stop_regex: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    min_new_tokens: int = 0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    sampling_seed: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Accepted for compatibility, no effect here.
    custom_params: dict | None = None
    stream_interval: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def needs_filtering(self) -> bool:
        return self.top_k != -1 or self.top_p < 1.0 or self.min_p > 0.0


_KNOWN_KEYS = set(SamplingParams.__dataclass_fields__) | set(_UNSUPPORTED_KEYS)


def _number(name: str, value: Any, kind: type) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"sampling_params.{name} must be a number, got {value!r}")
    if kind is int:
        if isinstance(value, float) and not value.is_integer():
            raise RequestError(f"sampling_params.{name} must be an integer, got {value!r}")
        return int(value)
    if not math.isfinite(value):
        raise RequestError(f"sampling_params.{name} must be finite, got {value!r}")
    return float(value)


def _top_level_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (isinstance(value, float) and not value.is_integer()):
        raise RequestError(f"{name} must be an integer, got {value!r}")
    return int(value)


def _str_list(name: str, value: Any) -> list[str]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise RequestError(f"sampling_params.{name} must be a non-empty string or a list of them, got {value!r}")
    return list(items)


def parse_sampling_params(raw: Any, vocab_size: int) -> SamplingParams:
    """SGLang's `sampling_params` dict -> SamplingParams; None values mean the default."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RequestError(f"sampling_params must be an object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - _KNOWN_KEYS)
    if unknown:
        raise RequestError(
            f"unknown sampling parameter(s) {unknown}; known: {sorted(SamplingParams.__dataclass_fields__)}"
        )
    given = {k: v for k, v in raw.items() if v is not None}
    for key in _UNSUPPORTED_KEYS:
        if key in given:
            raise RequestError(f"sampling_params.{key}: constrained decoding is not supported by the reference engine")
    p = SamplingParams()
    for name in ("max_new_tokens", "top_k", "n", "min_new_tokens", "sampling_seed", "stream_interval"):
        if name in given:
            setattr(p, name, _number(name, given[name], int))
    for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
        if name in given:
            setattr(p, name, _number(name, given[name], float))
    for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
        if name in given:
            if not isinstance(given[name], bool):
                raise RequestError(f"sampling_params.{name} must be true or false, got {given[name]!r}")
            setattr(p, name, given[name])
    if "stop" in given:
        p.stop = _str_list("stop", given["stop"])
        if len(p.stop) > MAX_STOP_STRINGS:
            raise RequestError(f"sampling_params.stop has {len(p.stop)} strings; at most {MAX_STOP_STRINGS} allowed")
    if "stop_regex" in given:
        p.stop_regex = _str_list("stop_regex", given["stop_regex"])
        for pattern in p.stop_regex:
            try:
                re.compile(pattern)
            except re.error as e:
                raise RequestError(f"sampling_params.stop_regex {pattern!r} is not a valid regex: {e}") from None
    if "stop_token_ids" in given:
        ids = given["stop_token_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise RequestError(f"sampling_params.stop_token_ids must be a list of integers, got {ids!r}")
        p.stop_token_ids = set(ids)
    if "logit_bias" in given:
        bias = given["logit_bias"]
        if not isinstance(bias, dict):
            raise RequestError("sampling_params.logit_bias must map token ids to numbers")
        try:
            p.logit_bias = {int(k): _number("logit_bias", v, float) for k, v in bias.items()}
        except ValueError:
            raise RequestError("sampling_params.logit_bias keys must be token ids") from None
    if "custom_params" in given:
        p.custom_params = given["custom_params"]
    _verify(p, vocab_size)
    return p


def _verify(p: SamplingParams, vocab_size: int) -> None:
    if p.temperature < 0:
        raise RequestError(f"temperature must be a non-negative number, got {p.temperature}")
    if not 0.0 < p.top_p <= 1.0:
        raise RequestError(f"top_p must be in (0, 1], got {p.top_p}")
    if not 0.0 <= p.min_p <= 1.0:
        raise RequestError(f"min_p must be in [0, 1], got {p.min_p}")
    if p.top_k < 1 and p.top_k != -1:
        raise RequestError(f"top_k must be -1 (whole vocabulary) or at least 1, got {p.top_k}")
    if not -2.0 <= p.frequency_penalty <= 2.0:
        raise RequestError(f"frequency_penalty must be in [-2, 2], got {p.frequency_penalty}")
    if not -2.0 <= p.presence_penalty <= 2.0:
        raise RequestError(f"presence_penalty must be in [-2, 2], got {p.presence_penalty}")
    if not 0.0 < p.repetition_penalty <= 2.0:
        raise RequestError(f"repetition_penalty must be in (0, 2] (1 = none), got {p.repetition_penalty}")
    if p.max_new_tokens < 0:
        raise RequestError(f"max_new_tokens must be at least 0, got {p.max_new_tokens}")
    if not 0 <= p.min_new_tokens <= p.max_new_tokens:
        raise RequestError(f"min_new_tokens must be in [0, max_new_tokens ({p.max_new_tokens})], got {p.min_new_tokens}")
    if p.n < 1:
        raise RequestError(f"n must be at least 1, got {p.n}")
    for t in [*p.stop_token_ids, *p.logit_bias]:
        if not 0 <= t < vocab_size:
            raise RequestError(f"token id {t} is outside the vocabulary [0, {vocab_size - 1}]")


# ---------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------


@dataclass
class GenerationRequest:
    """One sequence to generate. The worker thread owns the mutable state; other
    threads only set `abort_message` (through Engine.abort) and read it when finished."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    # Called from the worker thread: listener(request, finished). Streaming requests are
    # also told after every token.
    listener: Callable[[GenerationRequest, bool], None] | None = None

    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_logprobs: list[tuple[float | None, int]] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    error: str | None = None
    abort_message: str | None = None
    max_new_tokens: int = 0  # after the context-length cap
    created: float = field(default_factory=time.monotonic)
    weight_version: str = ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


def _per_prompt(name: str, value: Any, count: int) -> list[Any]:
    if isinstance(value, list):
        if len(value) != count:
            raise RequestError(f"{name} has {len(value)} entries for {count} prompts")
        return value
    return [value] * count


def parse_generate_body(body: Any, tokenizer: Any, vocab_size: int) -> tuple[list[GenerationRequest], bool]:
    """SGLang's /generate body -> requests in response order, and whether the answer is a
    list (a batch of prompts, or n > 1). A batch with n > 1 is prompt-major, like SGLang."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise RequestError("provide exactly one of text or input_ids")
    if text is not None:
        is_batch = isinstance(text, list)
        texts = text if is_batch else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise RequestError("text must be a string or a non-empty list of strings")
        prompts = [list(tokenizer(t)["input_ids"]) for t in texts]
    else:
        is_batch = isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
        prompts = input_ids if is_batch else [input_ids]
        for ids in prompts:
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise RequestError("input_ids must be a list of token ids or a list of such lists")
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise RequestError(f"input_ids has token ids outside the vocabulary [0, {vocab_size - 1}]: {bad[:5]}")
    for ids in prompts:
        if not ids:
            raise RequestError("a prompt must have at least one token")
    count = len(prompts)
    raw_params = _per_prompt("sampling_params", body.get("sampling_params"), count)
    params = [parse_sampling_params(p, vocab_size) for p in raw_params]
    return_logprob = _per_prompt("return_logprob", body.get("return_logprob") or False, count)
    start_len = _per_prompt("logprob_start_len", body.get("logprob_start_len", -1), count)
    top_num = _per_prompt("top_logprobs_num", body.get("top_logprobs_num") or 0, count)
    text_in_logprobs = bool(body.get("return_text_in_logprobs") or False)
    stream = bool(body.get("stream") or False)
    expanded = [(i, k) for i in range(count) for k in range(params[i].n)]
    is_batch = is_batch or len(expanded) > 1
    rids = _request_ids(body.get("rid"), len(expanded), is_batch)
    requests = []
    for rid, (i, _) in zip(rids, expanded):
        requests.append(
            GenerationRequest(
                rid=rid,
                prompt_ids=list(prompts[i]),
                params=params[i],
                return_logprob=bool(return_logprob[i]),
                logprob_start_len=_top_level_int("logprob_start_len", start_len[i] if start_len[i] is not None else -1),
                top_logprobs_num=_top_level_int("top_logprobs_num", top_num[i] or 0),
                return_text_in_logprobs=text_in_logprobs,
                stream=stream,
            )
        )
    return requests, is_batch


def _request_ids(rid: Any, count: int, is_batch: bool) -> list[str]:
    if rid is None:
        return [uuid.uuid4().hex for _ in range(count)]
    if isinstance(rid, str):
        if not rid:
            raise RequestError("rid must not be empty")
        return [rid] if not is_batch else [f"{rid}_{i}" for i in range(count)]
    if isinstance(rid, list) and all(isinstance(r, str) and r for r in rid):
        if len(rid) != count:
            raise RequestError(f"rid has {len(rid)} ids for {count} sequences")
        return list(rid)
    raise RequestError("rid must be a string or a list of strings")


# ---------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------


def decode_output(req: GenerationRequest, tokenizer: Any) -> str:
    ids = req.output_ids
    reason = req.finish_reason or {}
    matched = reason.get("matched")
    trim = not req.params.no_stop_trim and reason.get("type") == "stop"
    if trim and isinstance(matched, int) and ids:
        ids = ids[:-1]
    text = tokenizer.decode(ids, skip_special_tokens=req.params.skip_special_tokens)
    if trim and isinstance(matched, str):
        pos = text.find(matched)
        if pos != -1:
            text = text[:pos]
    return text


def build_response(req: GenerationRequest, tokenizer: Any) -> dict[str, Any]:
    """The SGLang /generate answer for one sequence (also each streamed chunk, cumulative)."""

    def token_text(token_id: int) -> str | None:
        return tokenizer.decode([token_id]) if req.return_text_in_logprobs else None

    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": req.finish_reason,
        "prompt_tokens": len(req.prompt_ids),
        "weight_version": req.weight_version,
        "completion_tokens": len(req.output_ids),
        "cached_tokens": 0,
        "e2e_latency": time.monotonic() - req.created,
    }
    if req.return_logprob:
        meta["input_token_logprobs"] = [[lp, t, token_text(t)] for lp, t in req.input_logprobs]
        meta["output_token_logprobs"] = [
            [lp, t, token_text(t)] for lp, t in zip(req.output_logprobs, req.output_ids)
        ]
        if req.top_logprobs_num > 0:
            meta["input_top_logprobs"] = [
                None if top is None else [[lp, t, token_text(t)] for lp, t in top] for top in req.input_top_logprobs
            ]
            meta["output_top_logprobs"] = [[[lp, t, token_text(t)] for lp, t in top] for top in req.output_top_logprobs]
    return {"text": decode_output(req, tokenizer), "output_ids": list(req.output_ids), "meta_info": meta}


# ---------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------
# KV cache of the running batch
# ---------------------------------------------------------------------------


def _cache_tensors(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))  # transformers < 4.54


def _make_cache(tensors: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    return DynamicCache(tensors)


def _left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    if width == 0:
        return t
    shape = list(t.shape)
    shape[dim] = width
    return torch.cat([t.new_zeros(shape), t], dim=dim)


@dataclass
class RunningBatch:
    """Rows decoding together. For each row the cache holds prompt + output[:-1]
    (left-padded to a common length); output[-1] is the next token to feed."""

    rows: list[GenerationRequest]
    cache: DynamicCache
    mask: torch.Tensor  # [rows, cached length], 1 = real token
    positions: torch.Tensor  # [rows], position of the token to feed next
    pending: torch.Tensor  # [rows], the token to feed next

    def merge(self, other: RunningBatch) -> None:
        length, other_length = self.mask.shape[1], other.mask.shape[1]
        width = max(length, other_length)
        merged = []
        for (k1, v1), (k2, v2) in zip(_cache_tensors(self.cache), _cache_tensors(other.cache)):
            k = torch.cat([_left_pad(k1, width - length, 2), _left_pad(k2, width - other_length, 2)], dim=0)
            v = torch.cat([_left_pad(v1, width - length, 2), _left_pad(v2, width - other_length, 2)], dim=0)
            merged.append((k, v))
        self.cache = _make_cache(merged)
        self.mask = torch.cat([_left_pad(self.mask, width - length, 1), _left_pad(other.mask, width - other_length, 1)])
        self.positions = torch.cat([self.positions, other.positions])
        self.pending = torch.cat([self.pending, other.pending])
        self.rows = self.rows + other.rows

    def keep(self, indices: list[int]) -> None:
        """Keep only these rows, then drop the left columns no remaining row uses."""
        index = torch.tensor(indices, dtype=torch.long)
        mask = self.mask[index]
        used = mask.any(dim=0)
        first = int(used.int().argmax()) if bool(used.any()) else mask.shape[1]
        self.cache = _make_cache([(k[index, :, first:], v[index, :, first:]) for k, v in _cache_tensors(self.cache)])
        self.mask = mask[:, first:]
        self.positions = self.positions[index]
        self.pending = self.pending[index]
        self.rows = [self.rows[i] for i in indices]


# ---------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------


class Engine:
    """Owns the model and one worker thread that runs every forward pass. All methods
    are thread-safe; listeners are called from the worker thread."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        max_batch_size: int = 64,
        context_length: int = 0,
        weight_version: str = "default",
        seed: int | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        config = model.config
        self.vocab_size = int(getattr(config, "vocab_size", 0) or len(tokenizer))
        self.context_length = context_length or int(getattr(config, "max_position_embeddings", 0) or 1 << 30)
        self.eos_ids = _eos_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids, default=0)
        self.weight_version = weight_version
        self.device = next(model.parameters()).device
        self._generator = torch.Generator()
        self._generator.manual_seed(seed if seed is not None else int.from_bytes(uuid.uuid4().bytes[:7], "little"))
        self._cv = threading.Condition()
        self._waiting: collections.deque[GenerationRequest] = collections.deque()
        self._active: dict[str, GenerationRequest] = {}
        self._tasks: collections.deque[tuple[Callable[[], Any], Future]] = collections.deque()
        self._paused = False
        self._retract = False
        self._wake = False
        self._stopping = False
        self._batch: RunningBatch | None = None
        self._stop_len = {}  # stop string -> its length in tokens (for tail decoding)
        self._thread = threading.Thread(target=self._run, name="engine-worker", daemon=True)
        self.last_step_time = time.monotonic()

    # -- thread-safe API ---------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    @property
    def paused(self) -> bool:
        return self._paused

    def num_active(self) -> int:
        with self._cv:
            return len(self._active)

    def submit(self, requests: Sequence[GenerationRequest]) -> None:
        """Queue requests; RequestError if a rid is already in flight (nothing is queued then)."""
        with self._cv:
            if self._stopping:
                raise RequestError("the engine is shutting down")
            rids = [r.rid for r in requests]
            duplicates = sorted({r for r in rids if r in self._active or rids.count(r) > 1})
            if duplicates:
                raise RequestError(f"duplicate request id(s) already in flight: {duplicates}")
            for req in requests:
                req.max_new_tokens = min(req.params.max_new_tokens, max(self.context_length - len(req.prompt_ids), 0))
                if len(req.prompt_ids) >= self.context_length:
                    raise RequestError(
                        f"the prompt has {len(req.prompt_ids)} tokens; the context length is {self.context_length}"
                    )
            for req in requests:
                self._active[req.rid] = req
                self._waiting.append(req)
            self._cv.notify_all()

    def abort(
        self,
        rid: str = "",
        abort_all: bool = False,
        message: str = "Aborted by /abort_request.",
        with_prefix: bool = True,
    ) -> None:
        """Abort `rid` (and, like SGLang, with_prefix: requests whose rid starts with it,
        a batch's children), or everything. Unknown rids are ignored."""
        with self._cv:
            if not abort_all and rid not in self._active:
                return
            for req in self._active.values():
                if abort_all or req.rid == rid or (with_prefix and req.rid.startswith(rid)):
                    req.abort_message = req.abort_message or message
            self._wake = True
            self._cv.notify_all()

    def pause(self, retract: bool = False) -> None:
        with self._cv:
            self._paused = True
            self._retract = self._retract or retract
            self._cv.notify_all()

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    def run_between_steps(self, fn: Callable[[], Any]) -> Future:
        """Run fn in the worker thread between decode iterations (also while paused)."""
        future: Future = Future()
        with self._cv:
            if self._stopping:
                future.set_exception(RuntimeError("the engine is shutting down"))
                return future
            self._tasks.append((fn, future))
            self._cv.notify_all()
        return future

    # -- worker thread -----------------------------------------------------

    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cv:
                    while not self._has_work():
                        self._cv.wait()
                    if self._stopping:
                        break
                    tasks = list(self._tasks)
                    self._tasks.clear()
                    self._wake = False
                    retract, self._retract = self._retract, False
                    paused = self._paused
                for fn, future in tasks:
                    if future.set_running_or_notify_cancel():
                        try:
                            future.set_result(fn())
                        except BaseException as e:
                            future.set_exception(e)
                self._reap_aborted()
                if retract:
                    self._retract_running()
                if paused:
                    continue
                try:
                    self._admit()
                    if self._batch is not None:
                        self._decode_step()
                except Exception as e:
                    log.exception("generation step failed")
                    self._fail_all(f"{type(e).__name__}: {e}")
                self.last_step_time = time.monotonic()
            self._shutdown_requests()

    def _has_work(self) -> bool:
        if self._stopping or self._tasks or self._wake or self._retract:
            return True
        return not self._paused and (bool(self._waiting) or self._batch is not None)

    def _finish(self, req: GenerationRequest, reason: dict[str, Any] | None = None, error: str | None = None) -> None:
        req.finish_reason = reason
        req.error = error
        req.weight_version = self.weight_version
        with self._cv:
            self._active.pop(req.rid, None)
        self._notify(req, True)

    def _notify(self, req: GenerationRequest, finished: bool) -> None:
        if req.listener is None:
            return
        try:
            req.listener(req, finished)
        except Exception:
            log.exception("listener of request %s failed", req.rid)

    def _reap_aborted(self) -> None:
        with self._cv:
            aborted = [r for r in self._waiting if r.abort_message]
            for req in aborted:
                self._waiting.remove(req)
        for req in aborted:
            self._finish(req, {"type": "abort", "message": req.abort_message})
        if self._batch is not None and any(r.abort_message for r in self._batch.rows):
            keep = []
            for i, req in enumerate(self._batch.rows):
                if req.abort_message:
                    self._finish(req, {"type": "abort", "message": req.abort_message})
                else:
                    keep.append(i)
            self._keep_rows(keep)

    def _retract_running(self) -> None:
        if self._batch is None:
            return
        rows = self._batch.rows
        self._batch = None
        with self._cv:
            self._waiting.extendleft(reversed(rows))

    def _fail_all(self, message: str) -> None:
        rows = self._batch.rows if self._batch is not None else []
        self._batch = None
        for req in rows:
            if not req.finished:
                self._finish(req, error=message)

    def _shutdown_requests(self) -> None:
        with self._cv:
            waiting = list(self._waiting)
            self._waiting.clear()
            tasks = list(self._tasks)
            self._tasks.clear()
        for _, future in tasks:
            if future.set_running_or_notify_cancel():
                future.set_exception(RuntimeError("the engine is shutting down"))
        for req in [*(self._batch.rows if self._batch else []), *waiting]:
            self._finish(req, {"type": "abort", "message": "The engine is shutting down."})
        self._batch = None

    def _keep_rows(self, indices: list[int]) -> None:
        if not indices:
            self._batch = None
        elif self._batch is not None and len(indices) < len(self._batch.rows):
            self._batch.keep(indices)

    def _admit(self) -> None:
        room = self.max_batch_size - (len(self._batch.rows) if self._batch else 0)
        with self._cv:
            new = [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
        ready = []
        for req in new:
            if req.max_new_tokens == 0 or len(req.output_ids) >= req.max_new_tokens:
                self._finish(req, {"type": "length", "length": req.max_new_tokens})
            else:
                ready.append(req)
        if not ready:
            return
        try:
            group = self._prefill(ready)
        except Exception as e:
            log.exception("prefill failed")
            for req in ready:
                self._finish(req, error=f"{type(e).__name__}: {e}")
            return
        if group is None:
            return
        if self._batch is None:
            self._batch = group
        else:
            self._batch.merge(group)

    def _prefill(self, reqs: list[GenerationRequest]) -> RunningBatch | None:
        """Run prompt (+ output so far, for retracted requests) through the model, choose
        each row's next token; returns the rows still generating."""
        sequences = [r.prompt_ids + r.output_ids for r in reqs]
        width = max(len(s) for s in sequences)
        ids = torch.full((len(reqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(reqs), width), dtype=torch.long)
        for i, seq in enumerate(sequences):
            ids[i, width - len(seq):] = torch.tensor(seq)
            mask[i, width - len(seq):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        want_inputs = any(r.return_logprob and not r.output_ids for r in reqs)
        cache = DynamicCache()
        out = self.model(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=positions.to(self.device),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=0 if want_inputs else 1,
        )
        logits = out.logits
        if want_inputs:
            for i, req in enumerate(reqs):
                if req.return_logprob and not req.output_ids:
                    self._input_logprobs(req, logits[i, width - len(req.prompt_ids):])
        choices = sample_next(logits[:, -1], reqs, self.eos_ids, self._generator)
        batch = RunningBatch(
            rows=list(reqs),
            cache=out.past_key_values,
            mask=mask,
            positions=mask.sum(-1),
            pending=torch.tensor([c.token for c in choices]),
        )
        keep = [i for i, (req, c) in enumerate(zip(reqs, choices)) if not self._append(req, c)]
        if not keep:
            return None
        if len(keep) < len(reqs):
            batch.keep(keep)
        return batch

    def _input_logprobs(self, req: GenerationRequest, logits: torch.Tensor) -> None:
        """Log-probs of prompt tokens from logprob_start_len (SGLang's -1: the last one);
        the first prompt token has none."""
        prompt = req.prompt_ids
        start = len(prompt) - 1 if req.logprob_start_len < 0 else min(req.logprob_start_len, len(prompt) - 1)
        logprobs = torch.log_softmax(logits.float(), dim=-1).clamp(min=torch.finfo(torch.float32).min)
        for pos in range(start, len(prompt)):
            value = None if pos == 0 else float(logprobs[pos - 1, prompt[pos]])
            req.input_logprobs.append((value, prompt[pos]))
            if req.top_logprobs_num > 0:
                if pos == 0:
                    req.input_top_logprobs.append(None)
                else:
                    values, ids = logprobs[pos - 1].topk(min(req.top_logprobs_num, logprobs.shape[-1]))
                    req.input_top_logprobs.append(list(zip(values.tolist(), ids.tolist())))

    def _decode_step(self) -> None:
        batch = self._batch
        assert batch is not None
        ones = torch.ones((len(batch.rows), 1), dtype=batch.mask.dtype)
        batch.mask = torch.cat([batch.mask, ones], dim=1)
        out = self.model(
            input_ids=batch.pending.unsqueeze(1).to(self.device),
            attention_mask=batch.mask.to(self.device),
            position_ids=batch.positions.unsqueeze(1).to(self.device),
            past_key_values=batch.cache,
            use_cache=True,
        )
        batch.cache = out.past_key_values
        batch.positions = batch.positions + 1
        choices = sample_next(out.logits[:, -1], batch.rows, self.eos_ids, self._generator)
        batch.pending = torch.tensor([c.token for c in choices])
        keep = [i for i, (req, c) in enumerate(zip(batch.rows, choices)) if not self._append(req, c)]
        self._keep_rows(keep)

    def _append(self, req: GenerationRequest, choice: Choice) -> bool:
        """Record a new token; finish the request if it is done. Returns True if finished."""
        req.output_ids.append(choice.token)
        if req.return_logprob:
            req.output_logprobs.append(choice.logprob)
            if req.top_logprobs_num > 0:
                req.output_top_logprobs.append(choice.top)
        reason = self._finish_reason(req)
        if reason is not None:
            self._finish(req, reason)
            return True
        if req.stream:
            req.weight_version = self.weight_version
            self._notify(req, False)
        return False

    def _finish_reason(self, req: GenerationRequest) -> dict[str, Any] | None:
        p = req.params
        if req.abort_message:
            return {"type": "abort", "message": req.abort_message}
        if len(req.output_ids) >= req.max_new_tokens:
            return {"type": "length", "length": req.max_new_tokens}
        last = req.output_ids[-1]
        if not p.ignore_eos and (last in p.stop_token_ids or last in self.eos_ids):
            return {"type": "stop", "matched": last}
        if p.stop or p.stop_regex:
            tail = self._tail_text(req)
            for stop in p.stop:
                if stop in tail:
                    return {"type": "stop", "matched": stop}
            for pattern in p.stop_regex:
                found = re.search(pattern, tail)
                if found:
                    return {"type": "stop", "matched": found.group(0)}
        return None

    def _tail_text(self, req: GenerationRequest) -> str:
        """Decoded text of the last few output tokens: enough to contain any stop string
        that the newest token completed."""
        p = req.params
        longest = 0
        for stop in p.stop:
            if stop not in self._stop_len:
                self._stop_len[stop] = len(self.tokenizer.encode(stop, add_special_tokens=False))
            longest = max(longest, self._stop_len[stop])
        # A regex may match anything: look at the whole output.
        ids = req.output_ids if p.stop_regex else req.output_ids[-(longest + 2):]
        return self.tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens)


def _eos_ids(model: torch.nn.Module, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    sources = [getattr(model, "generation_config", None), model.config]
    for source in sources:
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids
