"""The shared plumbing every service relies on: Sample conversion, typed settings,
health checking and reflection, graceful stop on SIGTERM."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from rlmesh.buffer.config import Settings as BufferSettings
from rlmesh.common.sample import (
    ConversionError,
    Sample,
    SampleGroup,
    Status,
    group_from_proto,
    group_to_proto,
    sample_from_json,
    sample_from_proto,
    sample_to_json,
    sample_to_proto,
    validate_group_proto,
    validate_groups_proto,
)
from rlmesh.common.settings import add_settings_flags, settings_from_args
from rlmesh.v1 import sample_pb2


def full_sample() -> Sample:
    return Sample(
        index=7,
        group_index=3,
        prompt="",
        tokens=[5, 6, 7, 8],
        messages=[
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": "call_0", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
                ],
            },
            {"role": "tool", "content": "2", "tool_call_id": "call_0", "name": "add"},
        ],
        response="ab",
        response_length=2,
        label="ab",
        reward=0.5,
        reward_components={"exact_match": 0.5},
        loss_mask=[0, 1],
        status=Status.TRUNCATED,
        metadata={"dataset": "d", "n": 1},
        rollout_log_probs=[-0.5, -1.25],
        weight_versions=[3, 4],
        multimodal_inputs=[{"kind": "image", "uri": "file:///x.png", "data": b"", "mime_type": "image/png"}],
    )


def test_a_samples_copy_equals_it_and_changes_to_either_leave_the_other_as_it_was():
    original = full_sample()
    twin = original.copy()
    assert twin == original
    twin.tokens.append(9)
    twin.loss_mask.append(1)
    twin.rollout_log_probs.append(-1.0)
    twin.weight_versions.append(5)
    twin.reward_components["format"] = 1.0
    twin.messages[1]["tool_calls"][0]["function"]["name"] = "mul"
    twin.metadata["n"] = 2
    twin.multimodal_inputs[0]["uri"] = "file:///y.png"
    assert original == full_sample()


def test_sample_round_trips_through_protobuf_and_json():
    s = full_sample()
    assert sample_from_proto(sample_pb2.Sample.FromString(sample_to_proto(s).SerializeToString())) == s
    group = SampleGroup("g3", 3, [s, full_sample()], "d")
    assert group_from_proto(group_to_proto(group)) == group
    s.multimodal_inputs[0]["data"] = b"\x89PNG\x00"
    assert sample_from_json(json.loads(json.dumps(sample_to_json(s)))) == s  # through real JSON, bytes too
    back = sample_from_json(sample_to_json(s))
    assert back.tokens == s.tokens and back.status == Status.TRUNCATED and back.rollout_log_probs == s.rollout_log_probs
    assert s.prompt_tokens == [5, 6] and s.response_tokens == [7, 8]


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("loss_mask", b"\x01", "loss_mask has 1 entries"),
        ("rollout_log_probs", b"\x00" * 5, "not a multiple of 4"),
        ("response_length", 9, "outside 0..4"),
        ("metadata_json", "[1]", "JSON object"),
        ("metadata_json", "{oops", "not valid JSON"),
        ("metadata_json", '{"a": ' + "[" * 100_000, "nested too deeply"),  # (a RecursionError before)
        ("status", 42, "unknown status 42"),
    ],
)
def test_malformed_samples_are_refused_with_the_reason(field, value, message):
    msg = sample_to_proto(full_sample())
    setattr(msg, field, value)
    with pytest.raises(ConversionError, match=message.replace(".", r"\.")):
        sample_from_proto(msg)
    with pytest.raises(ConversionError, match=message.replace(".", r"\.")):  # the buffer's check at write time
        validate_group_proto(sample_pb2.SampleGroup(group_id="g", samples=[msg]))


_BROKEN = [  # (field of the third sample of the second group, value), each a group no trainer can use
    ("loss_mask", b"\x01"),
    ("tokens", b"\x00" * 7),
    ("tokens", np.array([5, 6, -1, 8], "<i4").tobytes()),
    ("tokens", np.array([5, 6, 7, 100], "<i4").tobytes()),  # past a vocabulary of 100
    ("rollout_log_probs", b"\x00" * 5),
    ("rollout_log_probs", np.array([-0.5, np.nan], "<f4").tobytes()),
    ("rollout_log_probs", np.array([-np.inf, -1.0], "<f4").tobytes()),
    ("response_length", 9),
    ("response_length", -1),
    ("metadata_json", "[1]"),
    ("metadata_json", "{oops"),
    ("status", 42),
    ("reward", float("nan")),
    ("reward_components", {"x": float("inf")}),
    ("group_id", ""),
    ("samples", []),
    # Bounds: a trainer would waste steps on them, and they make every later read huge.
    ("loss_mask", b"\x01\x07"),  # 0 or 1 per response token
    ("reward", 1e308),  # finite, but its square is not (MAX_ABS_REWARD)
    ("reward_components", {"x": -1e10}),
    ("group_id", "g" * 513),
    ("weight_versions", [-5]),
    ("weight_versions", list(range(4097))),
    ("tokens", b"\x00" * 4 * ((1 << 22) + 1)),  # (MAX_SAMPLE_TOKENS)
]


@pytest.mark.parametrize("field,value", _BROKEN)
def test_a_whole_write_is_checked_as_strictly_as_each_group_alone(field, value):
    """The buffer checks a write's groups together (validate_groups_proto, one pass over
    the arrays): it refuses exactly what the per-group check refuses, with its message."""
    groups = [group_to_proto(SampleGroup(f"g{i}", i, [full_sample() for _ in range(4)])) for i in range(3)]
    validate_groups_proto(groups, vocab_size=100)  # sound groups pass
    bad = groups[1] if field in ("group_id", "samples") else groups[1].samples[2]
    if field == "reward_components":
        bad.reward_components.update(value)
    elif field == "weight_versions":
        bad.weight_versions[:] = value
    elif field == "samples":
        del bad.samples[:]
    else:
        setattr(bad, field, value)
    with pytest.raises(ConversionError) as alone:
        for g in groups:
            validate_group_proto(g, vocab_size=100)
    with pytest.raises(ConversionError) as together:
        validate_groups_proto(groups, vocab_size=100)
    assert str(together.value) == str(alone.value)
    assert "'g1'" in str(together.value) or field == "group_id"


def test_settings_precedence_is_defaults_yaml_env_flags(tmp_path, monkeypatch):
    (tmp_path / "buffer.yaml").write_text("port: 1111\nredis_url: redis://yaml:1/0\nkey_prefix: fromyaml\n")
    monkeypatch.setenv("RLMESH_BUFFER_REDIS_URL", "redis://env:2/0")
    parser = argparse.ArgumentParser()
    add_settings_flags(parser, BufferSettings)
    args = parser.parse_args(["--config", str(tmp_path / "buffer.yaml"), "--port", "3333"])
    s = settings_from_args(BufferSettings, args)
    assert (s.port, s.redis_url, s.key_prefix, s.prompt_lease_seconds) == (3333, "redis://env:2/0", "fromyaml", 600.0)
