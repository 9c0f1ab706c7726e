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
from tests.service.test_trainer import buffer_address, config, fill_buffer, trainer_server  # noqa: F401 (fixtures)
from tests.service.test_trainer_megatron import REPO, build_model


@pytest.fixture
def torchrun_trainer(buffer_address, tmp_path):  # noqa: F811 (the fixture imported above)
    """`torchrun --nproc-per-node 2 -m rlmesh.cli serve trainer` on the test's buffer."""
    port = free_port()
    log_path = tmp_path / "trainer.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "rlmesh.cli", "serve", "trainer", "--port", str(port),
           "--buffer-address", buffer_address, "--work-dir", str(tmp_path / "megatron-work"), "--device", "cpu"]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    address = f"127.0.0.1:{port}"
    try:
        wait_until_ready(lambda: grpc_health(address) == "SERVING", process, "the torchrun trainer")
    except RuntimeError as e:
        process.kill()
        pytest.fail(f"{e}:\n{log_path.read_text()[-5000:]}")
    yield TrainerStub(sync_channel(address))
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
def test_megatron_tp2_service_trains_like_the_torch_backend(
    buffer_address, torchrun_trainer, trainer_server, tmp_path  # noqa: F811
):
    model_dir = build_model("llama", tmp_path / "llama")
    stub = torchrun_trainer

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
        trainer_server(buffer_address=buffer_address), "t1", config(model_dir, micro_batch_size=4)
    )

    assert set(megatron_metrics) == set(torch_metrics)
    for name, value in torch_metrics.items():
        assert megatron_metrics[name] == pytest.approx(value, rel=1e-4, abs=1e-5), name
    got, want = load_file(megatron_dir / "model.safetensors"), load_file(torch_dir / "model.safetensors")
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=2e-5, rtol=1e-4, msg=name)
