"""The trainer's automatic checkpoints: every checkpoint_interval steps, written in the
background, atomically, only keep_last of them kept; and a run set up again (a trainer
restarted after SIGKILL) resumes from the newest complete one, bit for bit."""

from __future__ import annotations

import asyncio
import functools
import json
import random
import shutil
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import rlmesh.trainer.checkpoints as checkpoints_module
from rlmesh.buffer.config import Settings as BufferSettings
from rlmesh.buffer.server import start as start_buffer
from rlmesh.common import errors
from rlmesh.common.grpc_server import start_service, sync_channel
from rlmesh.common.sample import Status, group_from_proto, group_to_proto
from rlmesh.trainer.backend import TorchBackend
from rlmesh.trainer.checkpoints import COMPLETE_FILE
from rlmesh.trainer.config import Settings
from rlmesh.trainer.server import build
from rlmesh.trainer.trainer import Trainer
from rlmesh.v1 import buffer_pb2, trainer_pb2
from rlmesh.v1.buffer_pb2_grpc import BufferStub
from rlmesh.v1.trainer_pb2_grpc import TrainerStub
from tests.helpers.buffer import code_of, create, prompts, put
from tests.helpers.trainer import CPU, config, make_groups


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def keeper(path: Path, state: dict | None = None) -> Path:
    """A directory the trainer must leave alone (with a trainer_state.json when given)."""
    path.mkdir(parents=True)
    (path / "keep.txt").write_text("keep")
    if state is not None:
        (path / "trainer_state.json").write_text(json.dumps(state))
        (path / "optimizer.pt").write_bytes(b"")
    return path


def test_a_checkpoint_every_interval_and_only_the_newest_of_rlmeshs_own_kept(tiny_model_dir, tmp_path):
    checkpoints = tmp_path / "r1" / "checkpoints"
    theirs = keeper(checkpoints / "step-000001")  # not a checkpoint at all
    hf = keeper(checkpoints / "step-000000", {"global_step": 0})  # someone else's trainer_state.json
    other_run = keeper(checkpoints / "step-000003", {"written_by": "rlmesh", "run_id": "r0", "step": 3})
    (other_run / COMPLETE_FILE).touch()

    async def scenario():
        trainer = Trainer(Settings(work_dir=tmp_path))
        status = await trainer.init_run("r1", config(tiny_model_dir, checkpoint_interval=2, keep_last=2))
        assert status.resumed_step == 0  # nothing of r1's to resume
        for _ in range(3):
            await trainer.train_on_groups("r1", make_groups())
        manual = await trainer.save_checkpoint("r1")  # SaveCheckpoint's default name: never pruned
        for _ in range(4):
            await trainer.train_on_groups("r1", make_groups())
        await trainer.end_run("r1")  # waits for the checkpoint being written
        return manual

    manual = asyncio.run(scenario())
    # Saved at 2, 4 and 6, and at 7 as the run ended (its acknowledgments become final only in
    # a checkpoint); keep_last=2 deleted steps 2 and 4; nothing else was touched.
    assert names(checkpoints) == [
        "final",
        "step-000000",
        "step-000001",
        "step-000003",
        "step-000006",
        "step-000007",
        "step_3",
    ]
    assert manual == checkpoints / "step_3"
    for directory in (theirs, hf, other_run):
        assert "keep.txt" in names(directory)
    newest = checkpoints / "step-000007"
    state = json.loads((newest / "trainer_state.json").read_text())
    assert (state["step"], state["run_id"], state["written_by"]) == (7, "r1", "rlmesh")
    assert {"model.safetensors", "tokenizer.json", "optimizer.pt", "rng_state.pt", COMPLETE_FILE} <= set(names(newest))

    # ListCheckpoints: the run's complete checkpoints, oldest first, after the run has ended
    # (another run's and other tools' directories are not its); only under work_dir.
    trainer = Trainer(Settings(work_dir=tmp_path))
    listed = asyncio.run(trainer.list_checkpoints("r1"))
    assert [(c.step, c.path, c.automatic, c.final) for c in listed] == [
        (3, manual, False, False),
        (6, checkpoints / "step-000006", True, False),
        (7, newest, True, False),
        (7, checkpoints / "final", False, True),  # the run's final model, written as it ended
    ]
    assert listed[-2].written_at == (newest / COMPLETE_FILE).stat().st_mtime
    assert asyncio.run(trainer.list_checkpoints("r1", str(checkpoints))) == listed
    assert asyncio.run(trainer.list_checkpoints("r2")) == []
    with pytest.raises(errors.InvalidArgument, match="work_dir"):
        asyncio.run(trainer.list_checkpoints("r1", "/etc"))


def test_a_save_cut_short_is_ignored_and_cleaned_and_an_unmarked_one_never_loaded(tiny_model_dir, tmp_path):
    checkpoints = tmp_path / "r1" / "checkpoints"
    cfg = config(tiny_model_dir, checkpoint_interval=2)

    async def train(trainer: Trainer, steps: int) -> int:
        status = await trainer.init_run("r1", cfg)
        for _ in range(steps):
            await trainer.train_on_groups("r1", make_groups())
        await trainer.end_run("r1")
        return status.resumed_step

    assert asyncio.run(train(Trainer(Settings(work_dir=tmp_path)), 4)) == 0
    # What a trainer killed mid-save leaves: its scratch directory (complete or not) ...
    scratch = shutil.copytree(checkpoints / "step-000004", checkpoints / ".step-000006.0123456789ab")
    # ... and a directory that lacks the completion marker (say, copied by hand half-way).
    unmarked = shutil.copytree(checkpoints / "step-000004", checkpoints / "step-000008")
    (unmarked / COMPLETE_FILE).unlink()
    for directory, step in ((scratch, 6), (unmarked, 8)):
        (directory / "trainer_state.json").write_text(
            json.dumps({**json.loads((directory / "trainer_state.json").read_text()), "step": step})
        )

    # Resumed from step 4, the newest complete one; the scratch directory is gone.
    assert asyncio.run(train(Trainer(Settings(work_dir=tmp_path)), 2)) == 4
    assert names(checkpoints) == ["final", "step-000004", "step-000006", "step-000008"]
    assert json.loads((checkpoints / "step-000006" / "trainer_state.json").read_text())["step"] == 6


def test_a_run_ends_only_once_its_last_step_is_in_a_checkpoint(tiny_model_dir, tmp_path, monkeypatch):
    """EndRun writes the steps since the last checkpoint; when that fails, it fails and the run
    stays set up, so a retried EndRun writes it (the run's last acknowledgments are final only
    in a checkpoint)."""
    write, failures = checkpoints_module.write_checkpoint, [1]

    def failing_once(*args):
        if failures[0]:
            failures[0] -= 1
            raise OSError(28, "No space left on device")
        return write(*args)

    monkeypatch.setattr(checkpoints_module, "write_checkpoint", failing_once)
    checkpoints = tmp_path / "r1" / "checkpoints"

    async def scenario():
        trainer = Trainer(Settings(work_dir=tmp_path))
        await trainer.init_run("r1", config(tiny_model_dir, checkpoint_interval=10))
        for _ in range(3):
            await trainer.train_on_groups("r1", make_groups())
        with pytest.raises(errors.FailedPrecondition, match="last step .3.*EndRun again"):
            await trainer.end_run("r1")
        assert trainer.status("r1").step == 3  # still set up
        return await trainer.end_run("r1")

    assert asyncio.run(scenario()).step == 3
    assert names(checkpoints) == ["final", "step-000003"]


def test_writing_a_checkpoint_does_not_hold_up_the_next_step(tiny_model_dir, tmp_path, monkeypatch):
    started, release = threading.Event(), threading.Event()
    writing, most_at_once = [0], [0]
    write = checkpoints_module.write_checkpoint

    def held_write(*args):
        writing[0] += 1
        most_at_once[0] = max(most_at_once[0], writing[0])
        started.set()
        release.wait(60)
        try:
            return write(*args)
        finally:
            writing[0] -= 1

    monkeypatch.setattr(checkpoints_module, "write_checkpoint", held_write)
    checkpoints = tmp_path / "r1" / "checkpoints"

    async def scenario():
        trainer = Trainer(Settings(work_dir=tmp_path))
        await trainer.init_run("r1", config(tiny_model_dir, checkpoint_interval=2))
        for _ in range(2):
            await trainer.train_on_groups("r1", make_groups())
        assert await asyncio.to_thread(started.wait, 60)  # step 2's checkpoint is being written ...
        third = await trainer.train_on_groups("r1", make_groups())
        assert third.step == 3  # ... and step 3 was taken meanwhile
        assert not (checkpoints / "step-000002").exists()
        fourth = asyncio.ensure_future(trainer.train_on_groups("r1", make_groups()))  # due: waits for step 2's
        release.set()
        assert (await fourth).step == 4
        await trainer.end_run("r1")

    asyncio.run(scenario())
    assert names(checkpoints) == ["final", "step-000002", "step-000004"]
    assert most_at_once[0] == 1  # one save in flight at a time
    # The checkpoint holds the state of step 2 (copied then), not of the steps taken while it was written.
    reference = TorchBackend(config(tiny_model_dir), CPU)
    for _ in range(2):
        reference.train_step(make_groups())
    saved = load_file(checkpoints / "step-000002" / "model.safetensors")
    for name, tensor in reference.state_dict_for_sync():
        assert torch.equal(saved[name], tensor), name


def test_a_checkpoint_restores_the_random_number_generators(tiny_model_dir, tmp_path):
    path = TorchBackend(config(tiny_model_dir), CPU).save_checkpoint(tmp_path / "ckpt")
    expected = (torch.rand(4), random.random(), np.random.rand())
    torch.rand(4), random.random(), np.random.rand()  # the generators move on
    TorchBackend(config(tiny_model_dir), CPU, resume_from=path)
    drawn = (torch.rand(4), random.random(), np.random.rand())
    assert torch.equal(drawn[0], expected[0]) and drawn[1:] == expected[1:]


# ---------------------------------------------------------------- resume after a trainer restart, over gRPC


def scored(prompt_group, step: int):
    """Step `step`'s data, the same for every run: two different responses, one rewarded."""
    group = group_from_proto(prompt_group)
    for i, s in enumerate(group.samples):
        s.tokens, s.response_length, s.loss_mask = [5, 6, 7, 8 + step, 12 + i], 2, [1, 1]
        s.reward, s.status = float(i == step % 2), Status.COMPLETED
    return group_to_proto(group)


@pytest.fixture
def serve(loop_thread):
    """serve(trainer) -> (stub, kill): the trainer over real gRPC; kill() stops the server
    the way SIGKILL would, with no EndRun and nothing flushed."""
    servers = []

    def start(trainer: Trainer):
        server, port = loop_thread.run(start_service(functools.partial(build, trainer=trainer), trainer.settings))
        servers.append((trainer, server))
        return TrainerStub(sync_channel(f"127.0.0.1:{port}")), lambda: loop_thread.run(server.stop(None))

    yield start
    for trainer, server in servers:
        loop_thread.run(trainer.close())
        loop_thread.run(server.stop(None))


def test_a_restarted_trainer_resumes_the_run_bit_for_bit(
    redis_url, start_in_loop, dataset, serve, loop_thread, tiny_model_dir, tmp_path
):
    _, port = start_in_loop(lambda: start_buffer(BufferSettings(redis_url=redis_url, port=0)))
    buffer = BufferStub(sync_channel(f"127.0.0.1:{port}"))
    settings = {"buffer_address": f"127.0.0.1:{port}", "port": 0}  # two trainers at once
    cfg = config(tiny_model_dir, checkpoint_interval=2, seed=3).model_dump_json()

    def train(stub, run_id: str, steps: range) -> None:
        for step in steps:
            put(buffer, [scored(prompts(buffer, 1, run_id=run_id)[0], step)], run_id=run_id)
            assert (
                stub.TrainStep(trainer_pb2.TrainStepRequest(run_id=run_id, num_groups=1, wait_seconds=5)).step == step
            )

    def final_state(stub, run_id: str) -> tuple[dict, dict]:
        path = Path(stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(run_id=run_id, path=f"final-{run_id}")).path)
        return load_file(path / "model.safetensors"), torch.load(path / "optimizer.pt", weights_only=True)

    # The run never interrupted: steps 1-4.
    create(buffer, dataset, run_id="whole")
    whole, _ = serve(Trainer(Settings(work_dir=tmp_path / "a", **settings)))
    whole.InitRun(trainer_pb2.InitRunRequest(run_id="whole", config_json=cfg))
    train(whole, "whole", range(1, 5))

    # The same run, killed after step 3: the checkpoint of step 2 had been written.
    create(buffer, dataset, run_id="killed")
    first = Trainer(Settings(work_dir=tmp_path / "b", **settings))
    stub, kill = serve(first)
    stub.InitRun(trainer_pb2.InitRunRequest(run_id="killed", config_json=cfg))
    train(stub, "killed", range(1, 4))
    loop_thread.run(first._run.saved())  # step 2's checkpoint on disk, as it would be soon enough
    kill()

    # A new trainer on the same work_dir does not know the run; InitRun (what the
    # coordinator does then) resumes it from step 2, and the buffer hands out again the
    # group step 3 had trained (its acknowledgment was provisional): step 3 is retrained
    # on the same data, nothing is written again.
    stub, _ = serve(Trainer(Settings(work_dir=tmp_path / "b", **settings)))
    code, _ = code_of(lambda: stub.GetStatus(trainer_pb2.GetStatusRequest(run_id="killed")))
    assert code == grpc.StatusCode.NOT_FOUND
    status = stub.InitRun(trainer_pb2.InitRunRequest(run_id="killed", config_json=cfg))
    assert (status.step, status.resumed_step) == (2, 2)
    assert stub.TrainStep(trainer_pb2.TrainStepRequest(run_id="killed", num_groups=1, wait_seconds=5)).step == 3
    train(stub, "killed", range(4, 5))
    s = buffer.GetStats(buffer_pb2.GetStatsRequest(run_id="killed"))
    assert (s.groups_written, s.rolled_back_groups) == (4, 1)

    (weights, optimizer), (expected_weights, expected_optimizer) = (
        final_state(stub, "killed"),
        final_state(whole, "whole"),
    )
    assert weights.keys() == expected_weights.keys()
    for name, tensor in expected_weights.items():
        assert torch.equal(weights[name], tensor), name
    for index, values in expected_optimizer["rl"]["optimizer"]["state"].items():
        for key, tensor in values.items():
            assert torch.equal(optimizer["rl"]["optimizer"]["state"][index][key], tensor), (index, key)
    assert optimizer["rl"]["scheduler"] == expected_optimizer["rl"]["scheduler"]
    # Not trivially equal: training moved the weights away from the step-2 checkpoint.
    at_two = load_file(tmp_path / "b" / "killed" / "checkpoints" / "step-000002" / "model.safetensors")
    assert any(not torch.equal(at_two[name], tensor) for name, tensor in weights.items())


def test_only_a_save_a_resume_would_use_makes_acknowledgments_final(
    redis_url, start_in_loop, dataset, serve, tiny_model_dir, tmp_path
):
    # A save named "best" in the run's checkpoint_dir is never resumed from: had it made the
    # acknowledgments through its step final, a trainer killed later would have resumed from
    # an older checkpoint and the groups between would have been lost.
    _, port = start_in_loop(lambda: start_buffer(BufferSettings(redis_url=redis_url, port=0)))
    buffer = BufferStub(sync_channel(f"127.0.0.1:{port}"))
    create(buffer, dataset, run_id="r1")
    stub, _ = serve(Trainer(Settings(work_dir=tmp_path, buffer_address=f"127.0.0.1:{port}", port=0)))
    cfg = config(tiny_model_dir, checkpoint_interval=100)
    stub.InitRun(trainer_pb2.InitRunRequest(run_id="r1", config_json=cfg.model_dump_json()))
    for step in (1, 2):
        put(buffer, [scored(prompts(buffer, 1, run_id="r1")[0], step)], run_id="r1")
        stub.TrainStep(trainer_pb2.TrainStepRequest(run_id="r1", num_groups=1, wait_seconds=5))

    def provisional() -> int:
        return buffer.GetStats(buffer_pb2.GetStatsRequest(run_id="r1")).provisional_groups

    stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(run_id="r1", path="r1/checkpoints/best"))
    assert provisional() == 2
    stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(run_id="r1"))  # step_2: a resume would use it
    assert provisional() == 0


def test_a_checkpoint_set_aside_by_a_save_that_died_is_put_back(tiny_model_dir, tmp_path):
    checkpoints = tmp_path / "r1" / "checkpoints"
    cfg = config(tiny_model_dir, checkpoint_interval=2)

    async def train(trainer: Trainer, steps: int) -> int:
        status = await trainer.init_run("r1", cfg)
        for _ in range(steps):
            await trainer.train_on_groups("r1", make_groups())
        await trainer.end_run("r1")
        return status.resumed_step

    assert asyncio.run(train(Trainer(Settings(work_dir=tmp_path)), 4)) == 0
    # A save replacing step-000004 died between its two renames: the old checkpoint is set
    # aside, the new one complete beside it, and nothing is in place.
    (checkpoints / "step-000004").rename(checkpoints / ".step-000004.0123456789ab.old")
    shutil.copytree(checkpoints / ".step-000004.0123456789ab.old", checkpoints / ".step-000004.0123456789ab")
    assert asyncio.run(train(Trainer(Settings(work_dir=tmp_path)), 1)) == 4
    assert not [name for name in names(checkpoints) if name.startswith(".")]


def test_a_save_never_replaces_another_runs_checkpoint(tiny_model_dir, tmp_path):
    async def save(run_id: str) -> Path:
        trainer = Trainer(Settings(work_dir=tmp_path))
        await trainer.init_run(run_id, config(tiny_model_dir, checkpoint_dir="shared"))
        try:
            return await trainer.save_checkpoint(run_id, "shared/step_0")
        finally:
            await trainer.end_run(run_id)

    written = asyncio.run(save("a"))
    shutil.rmtree(tmp_path / "shared" / "final")  # (else run b is refused at its setup: below)
    with pytest.raises(errors.FailedPrecondition, match="a checkpoint of run 'a'"):
        asyncio.run(save("b"))
    assert json.loads((written / "trainer_state.json").read_text())["run_id"] == "a"


def test_a_run_is_not_set_up_where_another_runs_final_model_is(tiny_model_dir, tmp_path):
    """A run whose checkpoint_dir holds another run's final model could not write its own there
    (it would have trained to the end and kept no model): refused when it is set up, while the
    run that wrote it is set up there again (a trainer restarted after its end)."""

    async def scenario():
        trainer = Trainer(Settings(work_dir=tmp_path))
        shared = config(tiny_model_dir, checkpoint_dir="shared")
        await trainer.init_run("a", shared)
        assert (await trainer.end_run("a")).final_model == "shared/final"
        with pytest.raises(errors.InvalidArgument, match="holds another run's final model"):
            await trainer.init_run("b", shared)
        await trainer.init_run("a", shared)
        await trainer.close()

    asyncio.run(scenario())


def test_a_lost_rollback_does_not_make_a_dead_trainers_later_steps_final(
    redis_url, start_in_loop, dataset, serve, tiny_model_dir, tmp_path, monkeypatch
):
    """Trainer A checkpoints step 1, trains steps 2-3 (acknowledged provisionally) and dies; B
    loads step 1, and its RollbackToCheckpoint is lost (a Redis that lost the write). B's own
    steps are numbered 2, 3 too: its commit must not make A's final (no checkpoint holds
    them). They come back to be trained again; nothing is lost, nothing counted twice."""
    _, port = start_in_loop(lambda: start_buffer(BufferSettings(redis_url=redis_url, port=0)))
    buffer = BufferStub(sync_channel(f"127.0.0.1:{port}"))
    create(buffer, dataset, run_id="r1")
    settings = Settings(work_dir=tmp_path, buffer_address=f"127.0.0.1:{port}", port=0)
    cfg = config(tiny_model_dir, checkpoint_interval=100)

    def init(stub) -> int:
        return stub.InitRun(trainer_pb2.InitRunRequest(run_id="r1", config_json=cfg.model_dump_json())).step

    def step(stub, number: int, groups: int = 1) -> trainer_pb2.TrainStepResponse:
        put(buffer, [scored(p, number) for p in prompts(buffer, 1, run_id="r1")], run_id="r1")
        return stub.TrainStep(trainer_pb2.TrainStepRequest(run_id="r1", num_groups=groups, wait_seconds=5))

    def counts() -> tuple[int, int, int]:
        s = buffer.GetStats(buffer_pb2.GetStatsRequest(run_id="r1"))
        return s.acknowledged_groups, s.provisional_groups, s.queued_groups

    a, kill_a = serve(Trainer(settings))
    init(a)
    step(a, 1)
    a.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(run_id="r1"))
    step(a, 2)
    step(a, 3)
    kill_a()
    assert counts() == (1, 2, 0)

    async def lost(self, run_id: str, step: int) -> None:  # answered, but Redis lost the write
        return None

    monkeypatch.setattr("rlmesh.trainer.buffer_client.BufferClient.rewind", lost)
    b, _ = serve(Trainer(settings))
    assert init(b) == 1
    step(b, 2)
    b.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(run_id="r1"))  # commits through B's step 2
    assert counts() == (2, 0, 2)  # A's step 1 and B's step 2 final; A's steps 2-3 queued again
    again = b.TrainStep(trainer_pb2.TrainStepRequest(run_id="r1", num_groups=2, wait_seconds=5))
    assert (again.groups_trained, again.step) == (2, 3)  # trained into B's model, not skipped
    b.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(run_id="r1"))
    assert counts() == (4, 0, 0)
