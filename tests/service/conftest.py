"""Fixtures the service tests share: a trainer served over gRPC, the real buffer on the
test's Redis, the CPU reference engine in its own process and the rollout service in
front of it; a test remote reward service and a reward service allowed to call it."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlmesh.buffer.config import Settings as BufferSettings
from rlmesh.buffer.server import start as start_buffer
from rlmesh.common.grpc_server import start_service, sync_channel
from rlmesh.common.model_building import build_hf_model
from rlmesh.rollout.config import Settings as RolloutSettings
from rlmesh.rollout.server import start as start_rollout
from rlmesh.trainer.config import Settings
from rlmesh.trainer.server import build
from rlmesh.trainer.trainer import Trainer
from rlmesh.v1.trainer_pb2_grpc import TrainerStub
from tests.helpers.remote_reward import RemoteState, Reward, remote_app, start_http
from tests.helpers.trainer import EngineProcess


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    """The tiny model as Hugging Face computes it: what the engine must match."""
    return build_hf_model(AutoModelForCausalLM.from_pretrained, tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture
def trainer_server(loop_thread, tmp_path):
    """start(settings) -> a TrainerStub; the trainer and server stop with the test."""
    made = []

    def make(**settings):
        # Any free port: the default one may be taken on a shared machine.
        trainer = Trainer(Settings(**{"work_dir": tmp_path, "port": 0, **settings}))
        server, port = loop_thread.run(start_service(functools.partial(build, trainer=trainer), trainer.settings))
        made.append((trainer, server))
        make.trainers.append(trainer)
        return TrainerStub(sync_channel(f"127.0.0.1:{port}"))

    make.trainers = []
    yield make
    for trainer, server in made:
        loop_thread.run(trainer.close())
        loop_thread.run(server.stop(None))


@pytest.fixture
def buffer_address(redis_url, loop_thread):
    """The real buffer service on the test's Redis."""
    server, port = loop_thread.run(start_buffer(BufferSettings(redis_url=redis_url, port=0)))
    yield f"127.0.0.1:{port}"
    loop_thread.run(server.stop(None))


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    process = EngineProcess(tiny_model_dir, tmp_path_factory.mktemp("engine") / "engine.log")
    yield process
    process.stop()


@pytest.fixture
def rollout_address(loop_thread, engine):
    """The real rollout service in front of the engine (generation is not used here)."""
    server, port = loop_thread.run(start_rollout(RolloutSettings(port=0, engine_urls=[engine.url])))
    yield f"127.0.0.1:{port}"
    loop_thread.run(server.stop(None))


@pytest.fixture
def remote(start_in_loop):
    """(its state, its URL): a remote reward service on loopback (tests.helpers.remote_reward)."""
    state = RemoteState()
    _, port = start_in_loop(lambda: start_http(remote_app(state)))
    return state, f"http://127.0.0.1:{port}"


@pytest.fixture
def reward(start_in_loop, redis_url):
    """A reward service on loopback allowed to call loopback remotes."""
    return Reward(start_in_loop, redis_url)
