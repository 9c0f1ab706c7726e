"""Helpers for the buffer tests: runs, prompts, completed groups, a buffer as its own process."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from rlmesh.common.sample import Status, group_from_proto, group_to_proto
from rlmesh.v1 import buffer_pb2, sample_pb2


def create(stub, dataset, run_id="r1", n=2, cap=0, shuffle=False, **spec):
    return stub.CreateRun(
        buffer_pb2.CreateRunRequest(
            run_id=run_id,
            n_samples_per_prompt=n,
            max_queued_groups=cap,
            datasets=[
                buffer_pb2.DatasetSpec(
                    name="train", path=str(dataset), prompt_key="q", label_key="a", shuffle=shuffle, seed=7, **spec
                )
            ],
        )
    )


def completed(prompt_group: sample_pb2.SampleGroup, rewards=None, version: int | None = None) -> sample_pb2.SampleGroup:
    """The prompt group as a rollout worker would write it back, generated."""
    group = group_from_proto(prompt_group)
    for i, s in enumerate(group.samples):
        s.tokens, s.response_length, s.loss_mask = [5, 6, 7], 2, [1, 1]
        s.rollout_log_probs, s.status = [-0.5, -0.25], Status.COMPLETED
        s.reward = 1.0 if rewards is None else rewards[i]
        s.weight_versions = [] if version is None else [version]
    return group_to_proto(group)


def prompts(stub, n, run_id="r1", **kw) -> list[sample_pb2.SampleGroup]:
    return list(stub.GetPrompts(buffer_pb2.GetPromptsRequest(run_id=run_id, num_groups=n, **kw)).groups)


def put(stub, groups, run_id="r1") -> buffer_pb2.PutGroupsResponse:
    return stub.PutGroups(buffer_pb2.PutGroupsRequest(run_id=run_id, groups=groups))


def stats(stub, run_id="r1") -> buffer_pb2.BufferStats:
    return stub.GetStats(buffer_pb2.GetStatsRequest(run_id=run_id))


def code_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code(), e.value.details()


# ---------------------------------------------------------------- the buffer as its own process


def start_buffer_process(redis_url: str, port: int, log: Path, *flags: str) -> subprocess.Popen:
    """`rlmesh serve buffer` in its own process, as deployed; returns once it serves."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlmesh.cli", "serve", "buffer", "--redis-url", redis_url, "--port", str(port), *flags],
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
    )
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    deadline = time.monotonic() + 60
    try:
        while True:
            try:
                grpc.channel_ready_future(channel).result(timeout=0.5)
                return proc
            except grpc.FutureTimeoutError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    proc.kill()
                    raise RuntimeError(f"buffer process did not start; see {log}") from None
    finally:
        channel.close()
