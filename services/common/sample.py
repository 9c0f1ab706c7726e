"""The Python `Sample` and `SampleGroup`, and the one place that converts them to and
from protobuf. Nothing else in rlmesh touches `sample_pb2` field by field.

Numeric arrays travel as raw little-endian bytes (int32 tokens, float32 log-probs,
uint8 loss mask); see bench/wire.py for the measurement behind that choice.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import enum
import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlmesh.common import safe_json
from rlmesh.common.limits import MAX_ABS_REWARD, MAX_GROUP_ID_CHARS, MAX_SAMPLE_TOKENS, MAX_WEIGHT_VERSIONS
from rlmesh.v1 import sample_pb2

_TOKEN_DTYPE = np.dtype("<i4")
_LOGPROB_DTYPE = np.dtype("<f4")
_MASK_DTYPE = np.dtype("u1")


class Status(enum.IntEnum):
    UNSPECIFIED = 0
    PENDING = 1
    COMPLETED = 2
    TRUNCATED = 3
    ABORTED = 4
    FAILED = 5


@dataclass
class Sample:
    index: int = 0
    group_index: int = 0
    prompt: str = ""
    # OpenAI-style chat messages: role, content, and for tool use an assistant turn's
    # tool_calls ([{"id", "type": "function", "function": {"name", "arguments": JSON text}}])
    # or a tool turn's tool_call_id and name.
    messages: list[dict[str, Any]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # prompt tokens + response tokens
    response: str = ""
    response_length: int = 0
    label: str = ""
    reward: float = 0.0
    reward_components: dict[str, float] = field(default_factory=dict)
    loss_mask: list[int] = field(default_factory=list)  # one per response token
    status: Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    rollout_log_probs: list[float] = field(default_factory=list)  # one per response token
    weight_versions: list[int] = field(default_factory=list)
    multimodal_inputs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def prompt_tokens(self) -> list[int]:
        return self.tokens[: len(self.tokens) - self.response_length]

    @property
    def response_tokens(self) -> list[int]:
        return self.tokens[len(self.tokens) - self.response_length :]

    def copy(self) -> Sample:
        """A copy either may change without touching the other, as copy.deepcopy makes, but
        several times cheaper on long samples: the lists of numbers are copied flat (their
        items are immutable); anything else that may hold mutable values (messages,
        metadata, a field added later) is deep-copied."""
        changes = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in _FLAT_FIELDS:
                if isinstance(value, dict):
                    changes[f.name] = dict(value)
                elif isinstance(value, (list, tuple)):
                    changes[f.name] = list(value)
                else:  # (say, an array a plug-in put there: its own copy)
                    changes[f.name] = copy.deepcopy(value)
            elif not isinstance(value, (str, int, float, enum.Enum, type(None))):
                changes[f.name] = copy.deepcopy(value)
        return dataclasses.replace(self, **changes)


# The fields of Sample that hold only numbers, or strings mapped to numbers.
_FLAT_FIELDS = frozenset({"tokens", "reward_components", "loss_mask", "rollout_log_probs", "weight_versions"})


@dataclass
class SampleGroup:
    group_id: str
    group_index: int
    samples: list[Sample]
    dataset: str = ""

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]


class ConversionError(ValueError):
    """A protobuf message that cannot be a valid sample (say, arrays of the wrong size)."""


def _pack(values, dtype: np.dtype) -> bytes:
    return np.asarray(values, dtype=dtype).tobytes() if len(values) else b""


def _unpack(data: bytes, dtype: np.dtype, what: str, index: int) -> list:
    if len(data) % dtype.itemsize:
        raise ConversionError(
            f"sample {index}: {what} has {len(data)} bytes, not a multiple of "
            f"{dtype.itemsize} ({dtype.name} little-endian)"
        )
    return np.frombuffer(data, dtype=dtype).tolist()


def message_to_proto(message: dict[str, Any]) -> sample_pb2.ChatMessage:
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", call)
        arguments = function.get("arguments", {})
        calls.append(
            sample_pb2.ToolCall(
                id=call.get("id", ""),
                name=function.get("name", ""),
                arguments_json=arguments if isinstance(arguments, str) else json.dumps(arguments),
            )
        )
    return sample_pb2.ChatMessage(
        role=message["role"],
        content=message.get("content") or "",
        tool_calls=calls,
        tool_call_id=message.get("tool_call_id", ""),
        name=message.get("name", ""),
    )


def message_from_proto(msg: sample_pb2.ChatMessage) -> dict[str, Any]:
    message: dict[str, Any] = {"role": msg.role, "content": msg.content}
    if msg.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_json}}
            for c in msg.tool_calls
        ]
    if msg.tool_call_id:
        message["tool_call_id"] = msg.tool_call_id
    if msg.name:
        message["name"] = msg.name
    return message


def sample_to_proto(sample: Sample) -> sample_pb2.Sample:
    msg = sample_pb2.Sample(
        index=sample.index,
        group_index=sample.group_index,
        prompt=sample.prompt,
        messages=[message_to_proto(m) for m in sample.messages],
        tokens=_pack(sample.tokens, _TOKEN_DTYPE),
        response=sample.response,
        response_length=sample.response_length,
        label=sample.label,
        reward=sample.reward,
        reward_components=sample.reward_components,
        loss_mask=_pack(sample.loss_mask, _MASK_DTYPE),
        status=int(sample.status),
        metadata_json=json.dumps(sample.metadata) if sample.metadata else "",
        rollout_log_probs=_pack(sample.rollout_log_probs, _LOGPROB_DTYPE),
        weight_versions=sample.weight_versions,
        multimodal_inputs=[sample_pb2.MultimodalInput(**m) for m in sample.multimodal_inputs],
    )
    return msg


def sample_from_proto(msg: sample_pb2.Sample) -> Sample:
    tokens = _unpack(msg.tokens, _TOKEN_DTYPE, "tokens", msg.index)
    loss_mask = _unpack(msg.loss_mask, _MASK_DTYPE, "loss_mask", msg.index)
    log_probs = _unpack(msg.rollout_log_probs, _LOGPROB_DTYPE, "rollout_log_probs", msg.index)
    validate_arrays(msg.index, len(tokens), msg.response_length, len(loss_mask), len(log_probs))
    metadata = _metadata(msg)
    return Sample(
        index=msg.index,
        group_index=msg.group_index,
        prompt=msg.prompt,
        messages=[message_from_proto(m) for m in msg.messages],
        tokens=tokens,
        response=msg.response,
        response_length=msg.response_length,
        label=msg.label,
        reward=msg.reward,
        reward_components=dict(msg.reward_components),
        loss_mask=loss_mask,
        status=_status(msg),
        metadata=metadata,
        rollout_log_probs=log_probs,
        weight_versions=list(msg.weight_versions),
        multimodal_inputs=[
            {"kind": m.kind, "uri": m.uri, "data": m.data, "mime_type": m.mime_type} for m in msg.multimodal_inputs
        ],
    )


def _metadata(msg: sample_pb2.Sample) -> dict[str, Any]:
    try:
        metadata = safe_json.loads(msg.metadata_json) if msg.metadata_json else {}
    except json.JSONDecodeError as e:
        raise ConversionError(f"sample {msg.index}: metadata_json is not valid JSON ({e})") from None
    if not isinstance(metadata, dict):
        raise ConversionError(f"sample {msg.index}: metadata_json must be a JSON object")
    return metadata


def _status(msg: sample_pb2.Sample) -> Status:
    try:
        return Status(msg.status)
    except ValueError:
        raise ConversionError(f"sample {msg.index}: unknown status {msg.status}") from None


def validate_arrays(index: int, n_tokens: int, response_length: int, n_mask: int, n_log_probs: int) -> None:
    """The invariants every service relies on; broken ones are the sender's bug."""
    if response_length < 0 or response_length > n_tokens:
        raise ConversionError(
            f"sample {index}: response_length {response_length} is outside 0..{n_tokens} (the token count)"
        )
    if n_mask and n_mask != response_length:
        raise ConversionError(
            f"sample {index}: loss_mask has {n_mask} entries but response_length is {response_length}"
        )
    if n_log_probs and n_log_probs != response_length:
        raise ConversionError(
            f"sample {index}: rollout_log_probs has {n_log_probs} entries but response_length is {response_length}"
        )


def group_to_proto(group: SampleGroup) -> sample_pb2.SampleGroup:
    return sample_pb2.SampleGroup(
        group_id=group.group_id,
        group_index=group.group_index,
        samples=[sample_to_proto(s) for s in group.samples],
        dataset=group.dataset,
    )


def group_from_proto(msg: sample_pb2.SampleGroup) -> SampleGroup:
    return SampleGroup(
        group_id=msg.group_id,
        group_index=msg.group_index,
        samples=[sample_from_proto(s) for s in msg.samples],
        dataset=msg.dataset,
    )


def sample_to_json(sample: Sample) -> dict[str, Any]:
    """A JSON-ready dict (for JSONL export and HTTP reward services)."""
    d = {k: getattr(sample, k) for k in Sample.__dataclass_fields__}
    d["status"] = sample.status.name.lower()
    # JSON has no bytes: inline data travels base64-encoded.
    d["multimodal_inputs"] = [
        {**{k: v for k, v in m.items() if k != "data"}, "data_base64": base64.b64encode(m.get("data") or b"").decode()}
        for m in sample.multimodal_inputs
    ]
    return d


def sample_from_json(d: dict[str, Any]) -> Sample:
    d = dict(d)
    status = d.pop("status", "pending")
    d["multimodal_inputs"] = [
        {**{k: v for k, v in m.items() if k != "data_base64"}, "data": base64.b64decode(m.get("data_base64", ""))}
        for m in d.get("multimodal_inputs", [])
    ]
    sample = Sample(**{k: v for k, v in d.items() if k in Sample.__dataclass_fields__})
    sample.status = Status[status.upper()] if isinstance(status, str) else Status(status)
    validate_arrays(
        sample.index,
        len(sample.tokens),
        sample.response_length,
        len(sample.loss_mask),
        len(sample.rollout_log_probs),
    )
    return sample


def validate_group_proto(msg: sample_pb2.SampleGroup, vocab_size: int = 0) -> None:
    """Check a group's invariants on the wire form without building Python objects (the
    buffer stores groups as bytes and never needs them): what a trainer would trip on at
    every delivery is refused at the door. vocab_size (0 = unknown) bounds token ids."""
    if not msg.group_id:
        raise ConversionError("group has no group_id (writes are idempotent on it)")
    if len(msg.group_id) > MAX_GROUP_ID_CHARS:
        raise ConversionError(f"a group_id of {len(msg.group_id)} characters (at most {MAX_GROUP_ID_CHARS})")
    if not msg.samples:
        raise ConversionError(f"group {msg.group_id!r} has no samples")
    try:
        for s in msg.samples:
            _validate_sample_proto(s, vocab_size)
    except ConversionError as e:
        raise ConversionError(f"group {msg.group_id!r}, {e}") from None


def _validate_sample_proto(s: sample_pb2.Sample, vocab_size: int) -> None:
    arrays = ((s.tokens, _TOKEN_DTYPE, "tokens"), (s.rollout_log_probs, _LOGPROB_DTYPE, "rollout_log_probs"))
    for data, dtype, what in arrays:
        if len(data) % dtype.itemsize:
            raise ConversionError(f"sample {s.index}: {what} has {len(data)} bytes, not a multiple of {dtype.itemsize}")
    tokens = np.frombuffer(s.tokens, dtype=_TOKEN_DTYPE)
    log_probs = np.frombuffer(s.rollout_log_probs, dtype=_LOGPROB_DTYPE)
    validate_arrays(s.index, len(tokens), s.response_length, len(s.loss_mask), len(log_probs))
    if len(tokens) > MAX_SAMPLE_TOKENS:
        raise ConversionError(f"sample {s.index}: {len(tokens)} tokens (at most {MAX_SAMPLE_TOKENS})")
    if s.loss_mask.translate(None, b"\x00\x01"):
        raise ConversionError(f"sample {s.index}: loss_mask holds a value other than 0 and 1")
    versions = s.weight_versions
    if len(versions) > MAX_WEIGHT_VERSIONS or (versions and min(versions) < 0):
        raise ConversionError(
            f"sample {s.index}: weight_versions must be at most {MAX_WEIGHT_VERSIONS} versions, none negative"
        )
    _status(s)
    _metadata(s)
    if len(tokens) and (tokens.min() < 0 or (vocab_size and tokens.max() >= vocab_size)):
        where = int(np.argmax((tokens < 0) | (tokens >= vocab_size) if vocab_size else tokens < 0))
        bound = f"the vocabulary [0, {vocab_size - 1}]" if vocab_size else "0.. (token ids are never negative)"
        raise ConversionError(f"sample {s.index}: tokens holds id {tokens[where]} at position {where}, outside {bound}")
    if not np.isfinite(log_probs).all():
        where = int(np.argmin(np.isfinite(log_probs)))
        raise ConversionError(
            f"sample {s.index}: rollout_log_probs holds {log_probs[where]} at position {where}, not a finite number"
        )
    rewards = [("reward", s.reward), *((f"reward_components[{k!r}]", v) for k, v in s.reward_components.items())]
    for name, value in rewards:
        if not math.isfinite(value):
            raise ConversionError(f"sample {s.index}: {name} is {value}, not a finite number")
        if abs(value) > MAX_ABS_REWARD:
            raise ConversionError(f"sample {s.index}: {name} is {value:g}, outside ±{MAX_ABS_REWARD:g}")


_STATUSES = frozenset(Status)


def validate_groups_proto(groups, vocab_size: int = 0) -> None:
    """validate_group_proto of every group, in order, at a fraction of the cost: the scalar
    checks per sample, then the token bounds and finite log-probs once over the whole
    write's arrays (numpy's cost is per call, not per element). Exactly as strict: any
    doubt hands the write to validate_group_proto, which names the first bad group."""
    if not _groups_pass(groups, vocab_size):
        for g in groups:
            validate_group_proto(g, vocab_size)


def _groups_pass(groups, vocab_size: int) -> bool:
    tokens: list[bytes] = []
    log_probs: list[bytes] = []
    masks: list[bytes] = []
    metadata_ok: set[str] = set()  # metadata texts found to be JSON objects (samples of a group share them)
    most = MAX_ABS_REWARD
    for g in groups:
        if not g.group_id or not g.samples or len(g.group_id) > MAX_GROUP_ID_CHARS:
            return False
        for s in g.samples:
            t, lp = s.tokens, s.rollout_log_probs
            n_tokens, n_log_probs, n_mask = len(t) >> 2, len(lp) >> 2, len(s.loss_mask)
            response_length = s.response_length
            versions = s.weight_versions
            if (
                len(t) & 3
                or len(lp) & 3
                or not 0 <= response_length <= n_tokens
                or n_tokens > MAX_SAMPLE_TOKENS
                or (n_mask and n_mask != response_length)
                or (n_log_probs and n_log_probs != response_length)
                or s.status not in _STATUSES
                or not -most <= s.reward <= most  # (NaN and infinities fail too)
                or (versions and (len(versions) > MAX_WEIGHT_VERSIONS or min(versions) < 0))
            ):
                return False
            if s.reward_components and not all(-most <= v <= most for v in s.reward_components.values()):
                return False
            text = s.metadata_json
            if text and text not in metadata_ok:
                try:
                    _metadata(s)
                except ConversionError:
                    return False
                metadata_ok.add(text)
            tokens.append(t)
            log_probs.append(lp)
            masks.append(s.loss_mask)
    if b"".join(masks).translate(None, b"\x00\x01"):
        return False
    ids = np.frombuffer(b"".join(tokens), dtype=_TOKEN_DTYPE)
    if len(ids) and (ids.min() < 0 or (vocab_size and ids.max() >= vocab_size)):
        return False
    return bool(np.isfinite(np.frombuffer(b"".join(log_probs), dtype=_LOGPROB_DTYPE)).all())
