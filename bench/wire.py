"""The measurement behind the Sample wire form: raw little-endian bytes fields (what
proto/rlmesh/v1/sample.proto uses) versus packed repeated fields.

A realistic group: 8 samples x 1024 tokens (512 prompt + 512 response), int32 tokens,
float32 rollout log-probs and a uint8 loss mask over the response. Encode = Python lists
-> serialized SampleGroup bytes; decode = bytes -> Python lists (the Sample objects
services work with). Both paths do the same work around the arrays (validation,
metadata JSON), so the ratio isolates the array encoding.

    python -m bench.wire

It ends with its summary as a markdown table (the form docs/benchmarks.md keeps), then
one line: a JSON object with the results.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.internal import api_implementation

from bench.report import print_table
from rlmesh.common.sample import (
    Sample,
    SampleGroup,
    Status,
    group_from_proto,
    group_to_proto,
    validate_arrays,
)
from rlmesh.v1 import sample_pb2

N_SAMPLES = 8
PROMPT_TOKENS = 512
RESPONSE_TOKENS = 512
BUDGET_SECONDS_PER_CASE = 3.0


# ---------------------------------------------------------------- the packed alternative, built at runtime


def _packed_classes() -> tuple[type, type]:
    """PackedSample / PackedSampleGroup: sample.proto's fields with the arrays as packed
    repeated fields (proto3 packs repeated scalars by default)."""
    F = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(name="rlmesh_bench/packed.proto", package="rlmesh_bench", syntax="proto3")
    sample = file.message_type.add(name="PackedSample")
    fields = [
        ("index", 1, F.TYPE_INT64, F.LABEL_OPTIONAL),
        ("group_index", 2, F.TYPE_INT64, F.LABEL_OPTIONAL),
        ("prompt", 3, F.TYPE_STRING, F.LABEL_OPTIONAL),
        ("tokens", 5, F.TYPE_INT32, F.LABEL_REPEATED),
        ("response", 6, F.TYPE_STRING, F.LABEL_OPTIONAL),
        ("response_length", 7, F.TYPE_INT32, F.LABEL_OPTIONAL),
        ("label", 8, F.TYPE_STRING, F.LABEL_OPTIONAL),
        ("reward", 9, F.TYPE_DOUBLE, F.LABEL_OPTIONAL),
        ("loss_mask", 11, F.TYPE_UINT32, F.LABEL_REPEATED),
        ("status", 12, F.TYPE_INT32, F.LABEL_OPTIONAL),
        ("metadata_json", 13, F.TYPE_STRING, F.LABEL_OPTIONAL),
        ("rollout_log_probs", 14, F.TYPE_FLOAT, F.LABEL_REPEATED),
        ("weight_versions", 15, F.TYPE_INT64, F.LABEL_REPEATED),
    ]
    for name, number, type_, label in fields:
        sample.field.add(name=name, number=number, type=type_, label=label)
    group = file.message_type.add(name="PackedSampleGroup")
    group.field.add(name="group_id", number=1, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    group.field.add(name="group_index", number=2, type=F.TYPE_INT64, label=F.LABEL_OPTIONAL)
    group.field.add(
        name="samples", number=3, type=F.TYPE_MESSAGE, label=F.LABEL_REPEATED, type_name=".rlmesh_bench.PackedSample"
    )
    group.field.add(name="dataset", number=4, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return (
        message_factory.GetMessageClass(pool.FindMessageTypeByName("rlmesh_bench.PackedSample")),
        message_factory.GetMessageClass(pool.FindMessageTypeByName("rlmesh_bench.PackedSampleGroup")),
    )


PackedSample, PackedSampleGroup = _packed_classes()


def packed_encode(group: SampleGroup) -> bytes:
    """Mirror of group_to_proto(...).SerializeToString() for the fields the benchmark uses."""
    return PackedSampleGroup(
        group_id=group.group_id,
        group_index=group.group_index,
        dataset=group.dataset,
        samples=[
            PackedSample(
                index=s.index,
                group_index=s.group_index,
                prompt=s.prompt,
                tokens=s.tokens,
                response=s.response,
                response_length=s.response_length,
                label=s.label,
                reward=s.reward,
                loss_mask=s.loss_mask,
                status=int(s.status),
                metadata_json=json.dumps(s.metadata) if s.metadata else "",
                rollout_log_probs=s.rollout_log_probs,
                weight_versions=s.weight_versions,
            )
            for s in group.samples
        ],
    ).SerializeToString()


def packed_decode(data: bytes) -> SampleGroup:
    """Mirror of group_from_proto(SampleGroup.FromString(data))."""
    msg = PackedSampleGroup.FromString(data)
    samples = []
    for m in msg.samples:
        tokens, loss_mask, log_probs = list(m.tokens), list(m.loss_mask), list(m.rollout_log_probs)
        validate_arrays(m.index, len(tokens), m.response_length, len(loss_mask), len(log_probs))
        samples.append(
            Sample(
                index=m.index,
                group_index=m.group_index,
                prompt=m.prompt,
                tokens=tokens,
                response=m.response,
                response_length=m.response_length,
                label=m.label,
                reward=m.reward,
                loss_mask=loss_mask,
                status=Status(m.status),
                metadata=json.loads(m.metadata_json) if m.metadata_json else {},
                rollout_log_probs=log_probs,
                weight_versions=list(m.weight_versions),
            )
        )
    return SampleGroup(msg.group_id, msg.group_index, samples, msg.dataset)


def bytes_encode(group: SampleGroup) -> bytes:
    return group_to_proto(group).SerializeToString()


def bytes_decode(data: bytes) -> SampleGroup:
    return group_from_proto(sample_pb2.SampleGroup.FromString(data))


# ---------------------------------------------------------------- data and timing


def realistic_group(seed: int = 0) -> SampleGroup:
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 151_000, PROMPT_TOKENS).tolist()
    samples = []
    for i in range(N_SAMPLES):
        response = rng.integers(0, 151_000, RESPONSE_TOKENS).tolist()
        samples.append(
            Sample(
                index=i,
                group_index=3,
                prompt="Solve: " + "x" * 200,
                tokens=prompt + response,
                response="The answer is \\boxed{42}. " + "y" * 400,
                response_length=RESPONSE_TOKENS,
                label="42",
                reward=1.0,
                # float32 values, so both forms carry them exactly
                rollout_log_probs=(-rng.exponential(0.5, RESPONSE_TOKENS)).astype(np.float32).tolist(),
                loss_mask=[1] * (RESPONSE_TOKENS - 16) + [0] * 16,
                status=Status.COMPLETED,
                metadata={"dataset": "gsm8k", "turn": 1},
                weight_versions=[7],
            )
        )
    return SampleGroup("run-1/group-3", 3, samples, "gsm8k")


def per_second(fn: Callable[[], Any], budget: float = BUDGET_SECONDS_PER_CASE) -> float:
    """Calls per second: the best of several timed rounds (the least disturbed by the
    other work on a shared machine)."""
    fn()  # warm up
    start = time.perf_counter()
    calls = 0
    while time.perf_counter() - start < 0.2:
        fn()
        calls += 1
    per_round = max(1, calls // 2)  # rounds of about 0.1 s
    best = float("inf")
    deadline = time.perf_counter() + budget
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        for _ in range(per_round):
            fn()
        best = min(best, (time.perf_counter() - t0) / per_round)
    return 1.0 / best


def _same(a: SampleGroup, b: SampleGroup) -> bool:
    return all(
        x.tokens == y.tokens and x.loss_mask == y.loss_mask and x.rollout_log_probs == y.rollout_log_probs
        for x, y in zip(a.samples, b.samples, strict=True)
    )


def main() -> dict[str, float]:
    group = realistic_group()
    bytes_wire, packed_wire = bytes_encode(group), packed_encode(group)
    assert _same(bytes_decode(bytes_wire), group) and _same(packed_decode(packed_wire), group), "round trip lost data"

    results = {
        "bytes_encode_groups_per_s": per_second(lambda: bytes_encode(group)),
        "packed_encode_groups_per_s": per_second(lambda: packed_encode(group)),
        "bytes_decode_groups_per_s": per_second(lambda: bytes_decode(bytes_wire)),
        "packed_decode_groups_per_s": per_second(lambda: packed_decode(packed_wire)),
    }
    results["encode_ratio"] = results["bytes_encode_groups_per_s"] / results["packed_encode_groups_per_s"]
    results["decode_ratio"] = results["bytes_decode_groups_per_s"] / results["packed_decode_groups_per_s"]
    results["bytes_size"] = len(bytes_wire)
    results["packed_size"] = len(packed_wire)

    print(
        f"SampleGroup wire form: {N_SAMPLES} samples x {PROMPT_TOKENS + RESPONSE_TOKENS} tokens "
        f"({RESPONSE_TOKENS} response), protobuf backend: {api_implementation.Type()}"
    )
    print(f"{'form':<8}{'encode groups/s':>18}{'decode groups/s':>18}{'size bytes':>14}")
    for form in ("bytes", "packed"):
        print(
            f"{form:<8}{results[f'{form}_encode_groups_per_s']:>18.0f}"
            f"{results[f'{form}_decode_groups_per_s']:>18.0f}{results[f'{form}_size']:>14d}"
        )
    print(f"bytes / packed speed: encode x{results['encode_ratio']:.2f}, decode x{results['decode_ratio']:.2f}")
    print_table(
        [
            *(
                {
                    "form": form,
                    "encode groups/s": f"{results[f'{form}_encode_groups_per_s']:.0f}",
                    "decode groups/s": f"{results[f'{form}_decode_groups_per_s']:.0f}",
                    "size bytes": results[f"{form}_size"],
                }
                for form in ("bytes", "packed")
            ),
            {
                "form": "bytes / packed",
                "encode groups/s": f"{results['encode_ratio']:.2f}x",
                "decode groups/s": f"{results['decode_ratio']:.2f}x",
                "size bytes": f"{results['bytes_size'] / results['packed_size']:.2f}x",
            },
        ],
        f"python -m bench.wire: {N_SAMPLES} samples x {PROMPT_TOKENS + RESPONSE_TOKENS} tokens per group, "
        f"protobuf backend {api_implementation.Type()}",
    )
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in results.items()}))
    return results


if __name__ == "__main__":
    main()
