"""Test helpers for the trainer: a batch of sample groups, a trainer run config, groups put
through the real buffer, and the CPU reference engine in its own process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from rlmesh.cli.launcher import http_ready, wait_until_ready
from rlmesh.common.auth import client_headers
from rlmesh.common.grpc_server import sync_channel
from rlmesh.common.net import free_port
from rlmesh.common.run_config import TrainerRunConfig
from rlmesh.common.sample import Sample, SampleGroup, Status, group_from_proto, group_to_proto
from rlmesh.v1 import buffer_pb2
from rlmesh.v1.buffer_pb2_grpc import BufferStub

CPU = torch.device("cpu")


def sample(index: int, prompt: list[int], response: list[int], reward: float, status=Status.COMPLETED, **kw) -> Sample:
    return Sample(
        index=index,
        tokens=prompt + response,
        response_length=len(response),
        reward=reward,
        status=status,
        **kw,
    )


def make_groups() -> list[SampleGroup]:
    """Two prompts of different lengths, responses of different lengths (padding is
    exercised), one truncated sample and one failed one."""
    return [
        SampleGroup(
            "g0",
            0,
            [
                sample(0, [5, 6, 7], [8, 9, 10, 1], 1.0),
                sample(1, [5, 6, 7], [11, 1], 0.0),
                sample(2, [5, 6, 7], [12, 13, 14, 15, 16], 0.5, Status.TRUNCATED),
            ],
        ),
        SampleGroup(
            "g1",
            1,
            [
                sample(3, [20, 21, 22, 23, 24, 25], [8, 1], 1.0),
                sample(4, [20, 21, 22, 23, 24, 25], [30, 31, 1], 0.0),
                sample(5, [20, 21, 22, 23, 24, 25], [9, 9, 9], 0.0, Status.FAILED),
            ],
        ),
    ]


def config(model_dir: Path, **overrides) -> TrainerRunConfig:
    base = {"model_path": str(model_dir), "micro_batch_size": 2, "optimizer": {"lr": 1e-3}, "device": "cpu"}
    base.update(overrides)
    return TrainerRunConfig.model_validate(base)


def independent_log_probs(model, s: Sample) -> list[float]:
    """Response-token log-probs from one unpadded forward, the way an engine would."""
    with torch.no_grad():
        logp = model(torch.tensor([s.tokens])).logits[0].log_softmax(-1)
    first = len(s.tokens) - s.response_length
    return [float(logp[first + j - 1, s.tokens[first + j]]) for j in range(s.response_length)]


def fill_buffer(address: str, run_id: str, dataset: Path) -> BufferStub:
    """Two prompts through the buffer's own path: CreateRun, GetPrompts, PutGroups."""
    dataset.write_text("".join(json.dumps({"prompt": f"q{i}", "label": str(i)}) + "\n" for i in range(2)))
    stub = BufferStub(sync_channel(address))
    stub.CreateRun(
        buffer_pb2.CreateRunRequest(
            run_id=run_id, n_samples_per_prompt=2, datasets=[buffer_pb2.DatasetSpec(name="train", path=str(dataset))]
        )
    )
    prompts = stub.GetPrompts(buffer_pb2.GetPromptsRequest(run_id=run_id, num_groups=2)).groups
    done = []
    for g, template in zip(prompts, make_groups()):
        group = group_from_proto(g)
        for s, filled in zip(group.samples, template.samples):
            s.tokens, s.response_length, s.reward, s.status = (
                filled.tokens,
                filled.response_length,
                filled.reward,
                filled.status,
            )
        done.append(group_to_proto(group))
    stub.PutGroups(buffer_pb2.PutGroupsRequest(run_id=run_id, groups=done))
    return stub


class EngineProcess:
    """The CPU reference engine as `rlmesh serve engine` runs it, in its own process:
    one process cannot hold both ends of a weight group (torch registers groups by
    name, and both ends must use the same name)."""

    def __init__(self, model_dir: Path, log_path: Path, extra_args: tuple[str, ...] = ()) -> None:
        self.model_dir, self.log_path, self.extra_args = model_dir, log_path, extra_args
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        command = [
            sys.executable,
            "-m",
            "rlmesh.cli",
            "serve",
            "engine",
            "--model-path",
            str(self.model_dir),
            "--port",
            str(self.port),
            "--num-threads",
            "1",
            "--weight-group-timeout-s",
            "60",
            *self.extra_args,
        ]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_until_ready(lambda: http_ready(self.url), self.process, "the reference engine")
        except RuntimeError as e:
            pytest.fail(f"{e}:\n{self.log_path.read_text()}")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)

    def restart(self) -> None:
        self.stop()
        self.start()

    def weight_version(self) -> str:
        return httpx.get(f"{self.url}/get_model_info", headers=client_headers()).json()["weight_version"]

    def tensor(self, name: str) -> torch.Tensor:
        values = httpx.post(
            f"{self.url}/get_weights_by_name", json={"name": name, "truncate_size": 10**6}, headers=client_headers()
        ).json()
        return torch.tensor(values, dtype=torch.float32)


def assert_engine_has(engine: EngineProcess, tensors, dtype=None) -> None:
    for name, t in tensors:
        expected = t.to(dtype).float() if dtype else t
        torch.testing.assert_close(engine.tensor(name), expected, rtol=0, atol=0, msg=name)
