"""The /generate protocol: GenerationRequest, parsing SGLang's body, and building the answer and meta_info.

Stop trimming follows SGLang's detokenizer (`trim_matched_stop`): `output_ids` keep a
matched stop/EOS token; `text` drops a matched token, and cuts at a matched string,
unless no_stop_trim.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlmesh.engine.errors import RequestError
from rlmesh.engine.sampling_params import SamplingParams, parse_sampling_params


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
    cached_tokens: int = 0  # prompt tokens whose KV was reused, not computed (prefix sharing)
    kv_epoch: int = -1  # the prefix cache's epoch (weights) when this request's KV was computed
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


# Fields of SGLang's GenerateReqInput that this engine does not implement. A client that
# sets one expects its effect (an image seen, an adapter applied, hidden states returned),
# so it gets a 400 naming the field rather than an answer that silently ignored it.
UNSUPPORTED_FIELDS = (
    "input_embeds",
    "positional_embed_overrides",
    "image_data",
    "video_data",
    "audio_data",
    "lora_path",
    "lora_id",
    "session_params",
    "return_hidden_states",
    "return_routed_experts",
    "custom_logit_processor",
    "token_ids_logprob",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "data_parallel_rank",
)


def _is_set(value: Any) -> bool:
    """SGLang's defaults for these fields are None, False or empty (per prompt in a batch)."""
    if isinstance(value, list) and all(v is None or v is False for v in value):
        return False
    return not (value is None or value is False or (isinstance(value, (str, dict, list)) and not value))


def check_supported_fields(body: dict[str, Any]) -> None:
    used = [name for name in UNSUPPORTED_FIELDS if _is_set(body.get(name))]
    if used:
        raise RequestError(
            f"the rlmesh reference engine does not implement {', '.join(used)}: remove "
            f"{'it' if len(used) == 1 else 'them'} from the request, or send it to an SGLang server"
        )


# One request's prompts, and its sequences (prompts x n): an engine holds each until it answers.
MAX_PROMPTS = 4096
MAX_SEQUENCES = 65536
MAX_PROMPT_CHARS = 4 * 1024 * 1024  # a text prompt, before it is tokenized
MAX_RID_CHARS = 256


def parse_generate_body(body: Any, tokenizer: Any, vocab_size: int) -> tuple[list[GenerationRequest], bool]:
    """SGLang's /generate body -> requests in response order, and whether the answer is a
    list (a batch of prompts, or n > 1). A batch with n > 1 is prompt-major, like SGLang."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    check_supported_fields(body)
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise RequestError("provide exactly one of text or input_ids")
    if text is not None:
        is_batch = isinstance(text, list)
        texts = text if is_batch else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise RequestError("text must be a string or a non-empty list of strings")
        _at_most("prompts (text)", len(texts), MAX_PROMPTS)
        if any(len(t) > MAX_PROMPT_CHARS for t in texts):
            raise RequestError(f"a text prompt has more than {MAX_PROMPT_CHARS} characters")
        prompts = [list(tokenizer(t)["input_ids"]) for t in texts]
    else:
        is_batch = isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
        prompts = input_ids if is_batch else [input_ids]
        _at_most("prompts (input_ids)", len(prompts), MAX_PROMPTS)
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
    _at_most("sequences (prompts x n)", sum(p.n for p in params), MAX_SEQUENCES)
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
                logprob_start_len=_top_level_int(
                    "logprob_start_len", start_len[i] if start_len[i] is not None else -1, -1, 2**31 - 1
                ),
                top_logprobs_num=_top_level_int("top_logprobs_num", top_num[i] or 0, 0, vocab_size),
                return_text_in_logprobs=text_in_logprobs,
                stream=stream,
            )
        )
    return requests, is_batch


def _request_ids(rid: Any, count: int, is_batch: bool) -> list[str]:
    if rid is None:
        return [uuid.uuid4().hex for _ in range(count)]
    if isinstance(rid, str):
        if not rid or len(rid) > MAX_RID_CHARS:
            raise RequestError(f"rid must have 1..{MAX_RID_CHARS} characters")
        return [rid] if not is_batch else [f"{rid}_{i}" for i in range(count)]
    if isinstance(rid, list) and all(isinstance(r, str) and 0 < len(r) <= MAX_RID_CHARS for r in rid):
        if len(rid) != count:
            raise RequestError(f"rid has {len(rid)} ids for {count} sequences")
        return list(rid)
    raise RequestError(f"rid must be a string or a list of strings (each of 1..{MAX_RID_CHARS} characters)")


def _at_most(what: str, count: int, most: int) -> None:
    if count > most:
        raise RequestError(f"a request holds {count} {what}; at most {most}")


def _top_level_int(name: str, value: Any, least: int, most: int) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (isinstance(value, float) and not value.is_integer())
        or not least <= value <= most
    ):
        raise RequestError(f"{name} must be an integer in [{least}, {most}], got {value!r}")
    return int(value)


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
        "cached_tokens": req.cached_tokens,
        "e2e_latency": time.monotonic() - req.created,
    }
    if req.return_logprob:
        meta["input_token_logprobs"] = [[lp, t, token_text(t)] for lp, t in req.input_logprobs]
        meta["output_token_logprobs"] = [[lp, t, token_text(t)] for lp, t in zip(req.output_logprobs, req.output_ids)]
        if req.top_logprobs_num > 0:
            meta["input_top_logprobs"] = [
                None if top is None else [[lp, t, token_text(t)] for lp, t in top] for top in req.input_top_logprobs
            ]
            meta["output_top_logprobs"] = [[[lp, t, token_text(t)] for lp, t in top] for top in req.output_top_logprobs]
    return {"text": decode_output(req, tokenizer), "output_ids": list(req.output_ids), "meta_info": meta}
