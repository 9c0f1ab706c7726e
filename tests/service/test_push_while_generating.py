"""Weight pushes to engines that generate (fully_async): a push that pauses the engines
itself (trainer.proto's pause_mode) pauses them, in the mode asked for, before the weights
move, and lets them generate again once they all hold them; a push that fails leaves them
paused (they may hold part of the new weights) for the caller to let continue; a request
the weights changed under counts both versions. Real parts: the reference engine in its
own process, the rollout service, a gloo weight group."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
import torch

from rlmesh.common import errors
from rlmesh.common.auth import client_headers, stack_token
from rlmesh.common.grpc_server import sync_channel
from rlmesh.common.run_config import WeightSyncConfig
from rlmesh.common.sample import Sample
from rlmesh.rollout.engine_client import EnginePool
from rlmesh.rollout.generation import apply_engine_output
from rlmesh.trainer.backend import TorchBackend
from rlmesh.trainer.weight_sync import WeightPusher
from rlmesh.v1 import rollout_pb2, rollout_pb2_grpc
from tests.helpers.trainer import CPU, assert_engine_has, config

SYNC = WeightSyncConfig(backend="gloo")


def moved(backend: TorchBackend, delta: float) -> list[tuple[str, torch.Tensor]]:
    with torch.no_grad():
        for p in backend.policy.parameters():
            p.add_(delta)
    return list(backend.state_dict_for_sync())


def generate(engine_url: str, timeout: float = 60) -> dict:
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    r = httpx.post(f"{engine_url}/generate", json=body, headers=client_headers(), timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()


class StreamedGeneration(threading.Thread):
    """A long streamed /generate; `decoding` is set once its first tokens came back."""

    def __init__(self, engine_url: str) -> None:
        super().__init__(daemon=True)
        self.engine_url = engine_url
        self.decoding = threading.Event()
        self.finish_reason: dict | None = None

    def run(self) -> None:
        body = {
            "input_ids": [1, 2, 3],
            "sampling_params": {"max_new_tokens": 240, "ignore_eos": True},
            "stream": True,
        }
        with httpx.Client(timeout=60, headers=client_headers()) as c:
            with c.stream("POST", f"{self.engine_url}/generate", json=body) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    self.decoding.set()
                    self.finish_reason = json.loads(line[len("data: ") :])["meta_info"]["finish_reason"]


def test_a_push_pauses_the_engines_in_its_mode_and_lets_them_continue_once_they_hold_the_weights(
    loop_thread, rollout_address, engine, tiny_model_dir
):
    rollout = rollout_pb2_grpc.RolloutStub(sync_channel(rollout_address))
    backend = TorchBackend(config(tiny_model_dir), CPU)
    pusher = WeightPusher(rollout_address, "r-pause")
    try:
        loop_thread.run(pusher.push_distributed(moved(backend, 0.01), 1, SYNC))  # opens the group
        # A request in flight, held where it is (in_place keeps it running): only the push's
        # own pause can end it, and "abort" does.
        streamed = StreamedGeneration(engine.url)
        streamed.start()
        assert streamed.decoding.wait(60)
        rollout.PauseGeneration(rollout_pb2.PauseGenerationRequest(mode="in_place"))

        weights = moved(backend, 0.01)
        result = loop_thread.run(pusher.push_distributed(weights, 2, SYNC, pause_mode="abort"))
        streamed.join(60)
        assert streamed.finish_reason["type"] == "abort"
        assert result.engines_continued and engine.weight_version() == "2"
        assert_engine_has(engine, weights)
        assert generate(engine.url)["meta_info"]["weight_version"] == "2"  # generating again

        # No pause asked for: the engines are left as they are.
        assert not loop_thread.run(pusher.push_distributed(moved(backend, 0.01), 3, SYNC)).engines_continued
    finally:
        loop_thread.run(pusher.close())


def test_a_failed_push_leaves_the_engines_paused_for_the_caller_to_let_continue(
    loop_thread, rollout_address, engine, tiny_model_dir
):
    rollout = rollout_pb2_grpc.RolloutStub(sync_channel(rollout_address))
    backend = TorchBackend(config(tiny_model_dir), CPU)
    pusher = WeightPusher(rollout_address, "r-pause-fails")
    try:
        wrong = [(name, torch.zeros(3)) for name, _ in list(backend.state_dict_for_sync())[:1]]  # a wrong shape
        with pytest.raises(errors.RlmeshError, match="shape"):
            loop_thread.run(pusher.push_distributed(wrong, 1, SYNC, pause_mode="in_place"))
        # Paused: a request waits (part of the new weights may have landed).
        with pytest.raises(httpx.ReadTimeout):
            generate(engine.url, timeout=1)
        rollout.ContinueGeneration(rollout_pb2.ContinueGenerationRequest())
        assert generate(engine.url)["meta_info"]["finish_reason"]["type"] == "length"

        with pytest.raises(errors.InvalidArgument, match="pause_mode must be one of"):
            loop_thread.run(pusher.push_distributed(wrong, 1, SYNC, pause_mode="sleep"))
    finally:
        loop_thread.run(pusher.close())


def test_a_request_the_weights_changed_under_counts_the_version_it_was_sent_under(
    loop_thread, rollout_address, engine, tiny_model_dir
):
    """The sample records the version its request was sent under and the one it ended under,
    so its staleness counts from the older (before, only the engine's answer counted: a
    sample begun under version 1 and ended under 2 read as fresh as one wholly of 2). A
    request sent while the rollout service itself holds the engines paused starts only after
    the push: it counts the version it ends under."""
    rollout = rollout_pb2_grpc.RolloutStub(sync_channel(rollout_address))
    backend = TorchBackend(config(tiny_model_dir), CPU)
    pusher = WeightPusher(rollout_address, "r-began-under")
    # A second client of the engine: it did not pause it, so it sees a request sent under
    # version 1 answered under version 2, as when the weights change while it runs.
    pool = EnginePool([engine.url], "", timeout=30, weight_timeout=60, api_key=stack_token() or "")
    params = {"max_new_tokens": 4, "ignore_eos": True}

    def generated_while_pushing(version: int, rid: str) -> list[int]:
        answer = asyncio.run_coroutine_threadsafe(
            pool.engines[0].generate([1, 2, 3], params, rid=rid), loop_thread.loop
        )
        loop_thread.run(pusher.push_distributed(moved(backend, 0.01), version, SYNC))
        rollout.ContinueGeneration(rollout_pb2.ContinueGenerationRequest())
        loop_thread.run(pool.resume())
        return apply_engine_output(Sample(index=0, tokens=[1, 2, 3]), answer.result(60)).weight_versions

    try:
        loop_thread.run(pusher.push_distributed(moved(backend, 0.01), 1, SYNC))
        loop_thread.run(pool.probe())  # it holds version 1
        rollout.PauseGeneration(rollout_pb2.PauseGenerationRequest(mode="retract"))
        assert generated_while_pushing(2, "r") == [1, 2]

        loop_thread.run(pool.pause("retract"))  # now this client pauses it
        assert generated_while_pushing(3, "r2") == [3]
    finally:
        loop_thread.run(pusher.close())
        loop_thread.run(pool.close())
