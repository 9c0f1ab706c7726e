"""SGLang's `sampling_params`: the SamplingParams dataclass, and parsing and validating them.

Names and defaults are SGLang's (sglang/srt/sampling/sampling_params.py); an unknown key
is an error (400), and temperature < 1e-6 means greedy.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from rlmesh.engine.errors import RequestError

SAMPLING_EPS = 1e-6
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 4096  # each stop string or regex (the rollout service's bound too)
MAX_STOP_TOKEN_IDS = 1024
# Samples of one prompt in one request (SGLang's n); each is a sequence the engine holds.
MAX_N = 1024
# Grammar-constrained decoding is an SGLang feature this engine does not have.
_UNSUPPORTED_KEYS = ("json_schema", "regex", "ebnf", "structural_tag")


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


def _str_list(name: str, value: Any) -> list[str]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise RequestError(f"sampling_params.{name} must be a non-empty string or a list of them")
    return list(items)


def parse_sampling_params(raw: Any, vocab_size: int) -> SamplingParams:
    """SGLang's `sampling_params` dict -> SamplingParams; None values mean the default."""
    given = _given(raw)
    p = SamplingParams()
    _set_scalars(p, given)
    if "stop" in given:
        p.stop = _stop_strings(given["stop"])
    if "stop_regex" in given:
        p.stop_regex = _stop_regexes(given["stop_regex"])
    if "stop_token_ids" in given:
        p.stop_token_ids = _token_ids(given["stop_token_ids"])
    if "logit_bias" in given:
        p.logit_bias = _logit_bias(given["logit_bias"])
    if "custom_params" in given:
        p.custom_params = given["custom_params"]
    _verify(p, vocab_size)
    return p


def _given(raw: Any) -> dict[str, Any]:
    """The keys set (not None) in a `sampling_params` object; an unknown or unsupported key is an error."""
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
    return given


def _set_scalars(p: SamplingParams, given: dict[str, Any]) -> None:
    """The integer, float and boolean parameters given, checked for their type."""
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


def _stop_strings(value: Any) -> list[str]:
    stop = _str_list("stop", value)
    if len(stop) > MAX_STOP_STRINGS:
        raise RequestError(f"sampling_params.stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} allowed")
    if any(not s or len(s) > MAX_STOP_CHARS for s in stop):
        raise RequestError(f"sampling_params.stop: each string must have 1..{MAX_STOP_CHARS} characters")
    return stop


def _stop_regexes(value: Any) -> list[str]:
    patterns = _str_list("stop_regex", value)
    if len(patterns) > MAX_STOP_STRINGS or any(len(p) > MAX_STOP_CHARS for p in patterns):
        raise RequestError(
            f"sampling_params.stop_regex: at most {MAX_STOP_STRINGS} patterns of at most {MAX_STOP_CHARS} characters"
        )
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as e:
            raise RequestError(f"sampling_params.stop_regex {pattern!r} is not a valid regex: {e}") from None
    return patterns


def _token_ids(ids: Any) -> set[int]:
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise RequestError("sampling_params.stop_token_ids must be a list of integers")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise RequestError(f"sampling_params.stop_token_ids has {len(ids)} ids; at most {MAX_STOP_TOKEN_IDS}")
    return set(ids)


def _logit_bias(bias: Any) -> dict[int, float]:
    if not isinstance(bias, dict):
        raise RequestError("sampling_params.logit_bias must map token ids to numbers")
    try:
        return {int(k): _number("logit_bias", v, float) for k, v in bias.items()}
    except ValueError:
        raise RequestError("sampling_params.logit_bias keys must be token ids") from None


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
        raise RequestError(
            f"min_new_tokens must be in [0, max_new_tokens ({p.max_new_tokens})], got {p.min_new_tokens}"
        )
    if not 1 <= p.n <= MAX_N:
        raise RequestError(f"n must be in [1, {MAX_N}], got {p.n}")
    for t in [*p.stop_token_ids, *p.logit_bias]:
        if not 0 <= t < vocab_size:
            raise RequestError(f"token id {t} is outside the vocabulary [0, {vocab_size - 1}]")
