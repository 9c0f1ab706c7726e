"""The trainer's colocated push (rlmesh.trainer.colocated) through the real rollout service:
to the reference engine it writes the weight file and the engine ends with the trainer's
weights bit for bit; to SGLang engines (no weight-file format) from a CPU trainer it is
refused with a message that says why, before anything is sent; a run a dead trainer held
leaves no weight file behind once it ends."""

from __future__ import annotations

import asyncio

import pytest
import torch
import uvicorn
from fastapi import FastAPI

from rlmesh.common import errors, weight_file
from rlmesh.common.model_building import build_hf_model
from rlmesh.common.net import free_port
from rlmesh.rollout.config import Settings as RolloutSettings
from rlmesh.rollout.server import start as start_rollout
from rlmesh.trainer.colocated import ColocatedPusher
from rlmesh.trainer.config import Settings
from rlmesh.trainer.trainer import Trainer
from tests.helpers.trainer import EngineProcess


def _model_weights(model_dir) -> list[tuple[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = build_hf_model(AutoModelForCausalLM.from_pretrained, model_dir, dtype=torch.float32)
    return [(n, t.detach() - 0.5) for n, t in model.state_dict().items()]


def test_a_colocated_push_reaches_the_reference_engine_bit_for_bit(loop_thread, tiny_model_dir, tmp_path):
    shm = tmp_path / "shm"
    engine = EngineProcess(tiny_model_dir, tmp_path / "engine.log", ("--weight-file-dir", str(shm)))
    server, port = loop_thread.run(start_rollout(RolloutSettings(port=0, engine_urls=[engine.url])))
    pusher = ColocatedPusher(f"127.0.0.1:{port}", "run-1", shm, timeout_seconds=60)
    try:
        named = _model_weights(tiny_model_dir)
        result = loop_thread.run(pusher.push(named, 5, None, 64 * 2**20))
        assert result.bytes == sum(t.numel() * 4 for _, t in named) and result.buckets == 1
        assert engine.weight_version() == "5"
        for name, tensor in named:
            assert torch.equal(engine.tensor(name), tensor), name
        assert (shm / "run-1.rlmw").exists()
    finally:
        loop_thread.run(pusher.close())
        loop_thread.run(server.stop(None))
        engine.stop()
    assert not (shm / "run-1.rlmw").exists()  # the run's file goes with its pusher


@pytest.fixture
def sglang_like_engine(loop_thread):
    """An HTTP server answering as SGLang does where the push looks (no rlmesh keys)."""
    app = FastAPI()
    seen: list[str] = []

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info():
        return {"model_path": "/m", "weight_version": "default"}

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info():
        return {"tp_size": 1, "version": "0.5.23"}

    @app.post("/{path}")
    async def anything(path: str):
        seen.append(path)
        return {"success": True, "message": ""}

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    loop_thread.run(_serve_in_background(server))
    yield f"http://127.0.0.1:{port}", seen
    server.should_exit = True


async def _serve_in_background(server: uvicorn.Server) -> None:
    import asyncio

    asyncio.get_running_loop().create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)


def test_sglang_engines_and_a_cpu_trainer_are_refused_with_the_reason(loop_thread, sglang_like_engine, tmp_path):
    url, seen = sglang_like_engine
    server, port = loop_thread.run(start_rollout(RolloutSettings(port=0, engine_urls=[url])))
    pusher = ColocatedPusher(f"127.0.0.1:{port}", "run-2", tmp_path, timeout_seconds=30)
    try:
        with pytest.raises(errors.FailedPrecondition, match="CUDA IPC"):
            loop_thread.run(pusher.push([("w", torch.zeros(2))], 1, None, 2**20))
        assert seen == []  # nothing was sent to the engine
    finally:
        loop_thread.run(pusher.close())
        loop_thread.run(server.stop(None))


def test_the_weight_files_of_a_run_a_dead_trainer_held_go_at_its_end(tmp_path):
    """A trainer that died with a colocated run left the run's weight files in shared memory; the
    run's EndRun, answered NOT_FOUND by the restarted trainer, removes them (and no other run's)."""
    shm = tmp_path / "shm"
    for run_id in ("lost", "other"):
        weight_file.Writer(shm / f"{run_id}.rlmw").write([("w", torch.ones(4))])
    (shm / "lost.1.rlmw").write_bytes((shm / "lost.rlmw").read_bytes())  # (a second slot)

    async def scenario():
        trainer = Trainer(Settings(work_dir=tmp_path / "work", weight_file_dir=shm))
        with pytest.raises(errors.NotFound):
            await trainer.end_run("lost")
        await trainer.close()

    asyncio.run(scenario())
    assert sorted(p.name for p in shm.iterdir()) == ["other.rlmw"]
