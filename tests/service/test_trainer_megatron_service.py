"""The trainer service with backend 'megatron' at TP=2, as users start it: two processes
under torchrun, rank 0 serving gRPC and the other rank following it over a gloo group.
The same leased groups train the same model as the torch backend in an in-process
trainer; the checkpoints they save (HF names) agree."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("megatron.core", reason="the megatron extra is not installed")

from rlmesh.cli.launcher import grpc_health, wait_until_ready
from rlmesh.common.grpc_server import sync_channel
from rlmesh.common.net import free_port
from rlmesh.v1 import trainer_pb2
from rlmesh.v1.trainer_pb2_grpc import TrainerStub
from tests.helpers.megatron_models import build_model
from tests.helpers.trainer import assert_engine_has, config, fill_buffer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def torchrun_trainer(tmp_path):
    """start(*flags) -> a stub of `torchrun --nproc-per-node 2 -m rlmesh.cli serve trainer
    FLAGS`; stopped with the test."""
    started = []

    def start(*flags: str) -> TrainerStub:
        port = free_port()
        log_path = tmp_path / "trainer.log"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            "-m",
            "rlmesh.cli",
            "serve",
            "trainer",
            "--port",
            str(port),
            "--work-dir",
            str(tmp_path / "megatron-work"),
            "--device",
            "cpu",
            *flags,
        ]
        with open(log_path, "wb") as log:
            process = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        started.append(process)
        address = f"127.0.0.1:{port}"
        try:
            wait_until_ready(lambda: grpc_health(address) == "SERVING", process, "the torchrun trainer")
        except RuntimeError as e:
            pytest.fail(f"{e}:\n{log_path.read_text()[-5000:]}")
        return TrainerStub(sync_channel(address))

    yield start
    for process in started:
        process.send_signal(signal.SIGTERM)  # torchrun passes it to both ranks (and exits 1 itself)
        try:
            process.wait(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()


def train_and_save(stub: TrainerStub, run_id: str, run_config) -> tuple[dict, Path]:
    stub.InitRun(trainer_pb2.InitRunRequest(run_id=run_id, config_json=run_config.model_dump_json()))
    result = stub.TrainStep(trainer_pb2.TrainStepRequest(run_id=run_id, num_groups=2, wait_seconds=10), timeout=300)
    assert (result.step, result.groups_trained, result.samples_trained) == (1, 2, 4)
    path = Path(stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(run_id=run_id), timeout=300).path)
    stub.EndRun(trainer_pb2.EndRunRequest(run_id=run_id))
    return dict(result.metrics), path


@pytest.mark.slow
def test_megatron_tp2_service_trains_like_the_torch_backend(buffer_address, torchrun_trainer, trainer_server, tmp_path):
    model_dir = build_model("llama", tmp_path / "llama")
    stub = torchrun_trainer("--buffer-address", buffer_address)

    # A run config the two ranks cannot hold is refused with the way to start the trainer.
    with pytest.raises(grpc.RpcError) as e:
        bad = config(model_dir, backend="megatron", tensor_parallel_size=2, pipeline_parallel_size=2)
        stub.InitRun(trainer_pb2.InitRunRequest(run_id="bad", config_json=bad.model_dump_json()), timeout=120)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "runs 2 rank(s)" in e.value.details() and "torchrun --nproc-per-node 4" in e.value.details()

    fill_buffer(buffer_address, "m1", tmp_path / "m1.jsonl")
    fill_buffer(buffer_address, "t1", tmp_path / "t1.jsonl")
    megatron_metrics, megatron_dir = train_and_save(
        stub, "m1", config(model_dir, backend="megatron", tensor_parallel_size=2, micro_batch_size=4)
    )
    torch_metrics, torch_dir = train_and_save(
        trainer_server(buffer_address=buffer_address, port=0), "t1", config(model_dir, micro_batch_size=4)
    )

    assert set(megatron_metrics) == set(torch_metrics)
    for name, value in torch_metrics.items():
        if name != "seconds":  # (the step's wall time)
            assert megatron_metrics[name] == pytest.approx(value, rel=1e-4, abs=1e-5), name
    got, want = load_file(megatron_dir / "model.safetensors"), load_file(torch_dir / "model.safetensors")
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=2e-5, rtol=1e-4, msg=name)


@pytest.mark.slow
def test_megatron_tp2_pushes_hf_weights_to_the_engine(
    buffer_address, rollout_address, engine, torchrun_trainer, tiny_model_dir, tmp_path
):
    """Through the rollout service to the CPU reference engine over a gloo weight group,
    as from the torch backend: before training the engine gets the model's own tensors bit
    for bit; after a step, the tensors the trainer's checkpoint holds."""
    stub = torchrun_trainer("--buffer-address", buffer_address, "--rollout-address", rollout_address)
    fill_buffer(buffer_address, "w1", tmp_path / "w1.jsonl")
    stub.InitRun(
        trainer_pb2.InitRunRequest(
            run_id="w1",
            config_json=config(tiny_model_dir, backend="megatron", tensor_parallel_size=2).model_dump_json(),
        )
    )
    stub.PublishWeights(trainer_pb2.PublishWeightsRequest(run_id="w1", version=1), timeout=300)
    assert engine.weight_version() == "1"
    assert_engine_has(engine, load_file(tiny_model_dir / "model.safetensors").items())

    stub.TrainStep(trainer_pb2.TrainStepRequest(run_id="w1", num_groups=2, wait_seconds=10), timeout=300)
    stub.PublishWeights(trainer_pb2.PublishWeightsRequest(run_id="w1", version=2), timeout=300)
    saved = Path(stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(run_id="w1"), timeout=300).path)
    trained = load_file(saved / "model.safetensors")
    assert engine.weight_version() == "2"
    assert_engine_has(engine, trained.items())
    assert not torch.equal(
        trained["model.norm.weight"], load_file(tiny_model_dir / "model.safetensors")["model.norm.weight"]
    )
