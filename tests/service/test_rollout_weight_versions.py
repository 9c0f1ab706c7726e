"""The weight versions a sample records when the engine's weights change under its request
(pause modes in_place and retract keep requests across a push; abort ends them first):
real parts, the reference engine in its own process, the rollout service, a gloo weight
group."""

from __future__ import annotations

import asyncio

import torch

from rlmesh.common.auth import stack_token
from rlmesh.common.grpc_server import sync_channel
from rlmesh.common.run_config import WeightSyncConfig
from rlmesh.common.sample import Sample
from rlmesh.rollout.engine_client import EnginePool
from rlmesh.rollout.generation import apply_engine_output
from rlmesh.trainer.backend import TorchBackend
from rlmesh.trainer.weight_sync import WeightPusher
from rlmesh.v1 import rollout_pb2, rollout_pb2_grpc
from tests.helpers.trainer import CPU, config

SYNC = WeightSyncConfig(backend="gloo")


def moved(backend: TorchBackend, delta: float) -> list[tuple[str, torch.Tensor]]:
    with torch.no_grad():
        for p in backend.policy.parameters():
            p.add_(delta)
    return list(backend.state_dict_for_sync())


def test_a_request_the_weights_changed_under_counts_the_version_it_was_sent_under(
    loop_thread, rollout_address, engine, tiny_model_dir
):
    """The sample records the version its request was sent under and the one it ended under,
    so its staleness counts from the older (before, only the engine's answer counted: a
    sample begun under version 1 and ended under 2 read as fresh as one wholly of 2). The
    client cannot see when inside the engine a request began: one sent while the engines
    were paused for a push counts the older version too."""
    rollout = rollout_pb2_grpc.RolloutStub(sync_channel(rollout_address))
    backend = TorchBackend(config(tiny_model_dir), CPU)
    pusher = WeightPusher(rollout_address, "r-began-under")
    pool = EnginePool([engine.url], "", timeout=30, weight_timeout=60, api_key=stack_token() or "")  # a second client
    try:
        loop_thread.run(pusher.push_distributed(moved(backend, 0.01), 1, SYNC))
        loop_thread.run(pool.probe())  # it holds version 1
        rollout.PauseGeneration(rollout_pb2.PauseGenerationRequest(mode="retract"))
        params = {"max_new_tokens": 4, "ignore_eos": True}
        answer = asyncio.run_coroutine_threadsafe(
            pool.engines[0].generate([1, 2, 3], params, rid="r"), loop_thread.loop
        )
        loop_thread.run(pusher.push_distributed(moved(backend, 0.01), 2, SYNC))
        rollout.ContinueGeneration(rollout_pb2.ContinueGenerationRequest())
        sample = apply_engine_output(Sample(index=0, tokens=[1, 2, 3]), answer.result(60))
        assert sample.weight_versions == [1, 2]

        loop_thread.run(pool.probe())  # it holds version 2
        answer = loop_thread.run(pool.engines[0].generate([1, 2, 3], params, rid="r2"))
        assert apply_engine_output(Sample(index=1, tokens=[1, 2, 3]), answer).weight_versions == [2]
    finally:
        loop_thread.run(pusher.close())
        loop_thread.run(pool.close())
