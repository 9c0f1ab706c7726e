"""Files only under the configured roots, over real servers on loopback: the buffer reads
datasets under its data_roots and exports and imports under its export_dir; the trainer
writes checkpoints under its work_dir, replaces only checkpoints it wrote and resumes only
from under work_dir; every service refuses a run id that could escape a directory or a
Redis key. A refusal names the roots and never tells whether the refused file exists or
what it holds."""

from __future__ import annotations

import functools
import json
import shutil
import time

import grpc
import httpx
import pytest
import redis

from rlmesh.cli.embedded_redis import start_redis
from rlmesh.common.auth import client_headers
from rlmesh.common.grpc_server import sync_channel
from rlmesh.common.run_config import TrainerRunConfig
from rlmesh.coordinator.app import start as start_coordinator
from rlmesh.coordinator.config import Settings as CoordinatorSettings
from rlmesh.rollout.config import Settings as RolloutSettings
from rlmesh.rollout.server import start as start_rollout
from rlmesh.trainer.config import Settings as TrainerSettings
from rlmesh.trainer.server import start as start_trainer
from rlmesh.v1 import buffer_pb2, rollout_pb2, rollout_pb2_grpc, trainer_pb2
from rlmesh.v1.trainer_pb2_grpc import TrainerStub
from tests.helpers.buffer import code_of, completed, create, prompts, put

INVALID = grpc.StatusCode.INVALID_ARGUMENT
FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
SECRET = {"password": "hunter2"}
BAD_RUN_IDS = ["../../x", "..", ".", "a/b", "", "a:b", ".hidden"]


@pytest.fixture
def places(tmp_path):
    """data/ (the buffer's data root) with a dataset; outside/ with a secret JSON file."""
    data, outside = tmp_path / "data", tmp_path / "outside"
    data.mkdir()
    outside.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps({"q": f"question {i}", "a": str(i)}) + "\n" for i in range(3)))
    (outside / "secret.json").write_text(json.dumps(SECRET))
    (outside / "secret.jsonl").write_text(json.dumps(SECRET) + "\n")
    return data, outside


def refusal(call) -> str:
    code, details = code_of(call)
    assert code == INVALID, details
    assert "hunter2" not in details and "password" not in details
    return details


# ---------------------------------------------------------------- buffer: datasets


def test_dataset_paths_outside_data_roots_are_refused_alike(buffer, places, tmp_path):
    data, outside = places
    stub = buffer(data_roots=[data], export_dir=tmp_path / "exports")
    (data / "link.jsonl").symlink_to(outside / "secret.jsonl")
    (data / "linkdir").symlink_to(outside)
    attempts = [
        "../outside/secret.json",
        str(outside / "secret.json"),
        f"{data}/../outside/secret.jsonl",
        "link.jsonl",
        "linkdir",
        "linkdir/secret.jsonl",
        "/",
        "/etc/passwd",
        "../outside/missing.json",
    ]
    answers = {}
    for path in attempts:
        details = refusal(lambda: create(stub, path))  # noqa: B023
        assert "data_roots" in details and str(data.resolve()) not in details.replace(repr(path), "")
        answers[path] = details.replace(repr(path), "PATH")
    # An existing file and a missing one get the same answer.
    assert answers["../outside/secret.json"] == answers["../outside/missing.json"]
    # The same file under the root is read, by a path relative to the first root.
    create(stub, "train.jsonl")
    assert [g.samples[0].prompt for g in prompts(stub, 2)] == ["question 0", "question 1"]


def test_a_dataset_cannot_name_files_outside_the_roots_inside_itself(buffer, places, tmp_path):
    data, _ = places
    stub = buffer(data_roots=[data], export_dir=tmp_path / "exports")
    saved = data / "saved"  # a save_to_disk directory whose state.json points out of the root
    saved.mkdir()
    (saved / "state.json").write_text(json.dumps({"_data_files": [{"filename": "../../outside/secret.json"}]}))
    details = refusal(lambda: create(stub, "saved"))
    assert "data_roots" in details
    splits = data / "splits"  # a DatasetDict whose split is a way out
    splits.mkdir()
    (splits / "dataset_dict.json").write_text(json.dumps({"splits": ["../../outside"]}))
    details = refusal(lambda: create(stub, "splits", split="../../outside"))
    assert "data_roots" in details


def test_a_directory_dataset_is_bounded(buffer, places, tmp_path):
    data, _ = places
    many = data / "many"
    many.mkdir()
    for i in range(20):
        (many / f"part-{i}.parquet").write_bytes(b"")
    stub = buffer(data_roots=[data], dataset_max_files=10, dataset_max_bytes=100, export_dir=tmp_path / "exports")
    assert "dataset_max_files" in refusal(lambda: create(stub, "many"))
    assert "dataset_max_files" in refusal(lambda: create(stub, "."))  # the root itself
    (data / "big.jsonl").write_text(json.dumps({"q": "x" * 200, "a": "1"}) + "\n")
    assert "dataset_max_bytes" in refusal(lambda: create(stub, "big.jsonl"))
    # Even a root of / cannot make the buffer walk the whole filesystem.
    wide = buffer(data_roots=["/"], dataset_max_files=50, export_dir=tmp_path / "exports")
    assert "dataset_max_files" in refusal(lambda: create(wide, "/"))


# ---------------------------------------------------------------- buffer: export and import


def test_export_and_import_stay_in_export_dir_and_never_overwrite(buffer, places, tmp_path):
    data, outside = places
    exports = tmp_path / "exports"
    stub = buffer(data_roots=[data], export_dir=exports)
    create(stub, "train.jsonl")
    put(stub, [completed(g) for g in prompts(stub, 2)])
    export = lambda path: stub.ExportGroups(buffer_pb2.ExportGroupsRequest(run_id="r1", path=path))  # noqa: E731

    assert export("rollouts.jsonl").groups == 2  # export_dir is created on the first export
    assert len((exports / "rollouts.jsonl").read_text().splitlines()) == 2
    victim = outside / "victim.jsonl"
    victim.write_text("precious\n")
    (exports / "link.jsonl").symlink_to(victim)
    for path in ("../outside/victim.jsonl", str(victim), "link.jsonl", f"{exports}/../outside/victim.jsonl"):
        details = refusal(lambda: export(path))  # noqa: B023
        assert "export_dir" in details and str(exports.resolve()) not in details.replace(repr(path), "")
    assert victim.read_text() == "precious\n"

    mine = exports / "mine.jsonl"
    mine.write_text("precious\n")
    for path in ("mine.jsonl", "rollouts.jsonl"):  # someone's file, and an earlier export
        code, details = code_of(lambda: export(path))  # noqa: B023
        assert code == FAILED_PRECONDITION and "never replaces" in details
    assert mine.read_text() == "precious\n"
    assert "jsonl" in refusal(lambda: export("rollouts.txt"))
    assert not [p.name for p in exports.iterdir() if p.name.startswith(".")]  # no temporary file left

    # Import reads only under export_dir too, even a genuine export copied elsewhere.
    shutil.copy(exports / "rollouts.jsonl", outside / "copy.jsonl")
    create(stub, "train.jsonl", run_id="replay")
    importing = lambda path: stub.ImportGroups(buffer_pb2.ImportGroupsRequest(run_id="replay", path=path))  # noqa: E731
    for path in (str(outside / "copy.jsonl"), "../outside/copy.jsonl", "../outside/secret.jsonl"):
        assert "export_dir" in refusal(lambda: importing(path))  # noqa: B023
    assert importing("rollouts.jsonl").groups == 2


# ---------------------------------------------------------------- trainer: checkpoints


@pytest.fixture
def trainer(start_in_loop, tmp_path):
    """A trainer service whose work_dir is tmp_path/work."""
    work = tmp_path / "work"
    _, port = start_in_loop(lambda: start_trainer(TrainerSettings(port=0, work_dir=work)))
    return TrainerStub(sync_channel(f"127.0.0.1:{port}")), work


def init_run(stub, model_dir, run_id="r1", **overrides):
    config = TrainerRunConfig.model_validate(
        {"model_path": str(model_dir), "micro_batch_size": 2, "device": "cpu", **overrides}
    )
    return stub.InitRun(trainer_pb2.InitRunRequest(run_id=run_id, config_json=config.model_dump_json()))


def keeper(directory, *names):
    """A directory that is not rlmesh's, holding files."""
    directory.mkdir(parents=True)
    for name in names or ("keep.txt",):
        (directory / name).write_text("precious")
    return directory


def test_checkpoints_stay_under_work_dir(trainer, tiny_model_dir, tmp_path):
    stub, work = trainer
    init_run(stub, tiny_model_dir)
    precious = keeper(tmp_path / "precious")
    work.mkdir(exist_ok=True)
    (work / "link").symlink_to(precious)
    save = lambda path: stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(run_id="r1", path=path))  # noqa: E731
    for path in (str(precious), "../precious", "link", f"{work}/../precious", "/"):
        details = refusal(lambda: save(path))  # noqa: B023
        assert "work_dir" in details and str(work.resolve()) not in details.replace(repr(path), "")
    assert (precious / "keep.txt").read_text() == "precious"
    assert [p.name for p in precious.iterdir()] == ["keep.txt"]

    # checkpoint_dir in a run config is held to work_dir as well, before any model is loaded.
    stub.EndRun(trainer_pb2.EndRunRequest(run_id="r1"))
    for where in (str(precious), "../precious"):
        assert "checkpoint_dir" in refusal(lambda: init_run(stub, tiny_model_dir, checkpoint_dir=where))  # noqa: B023
    # A path no file system takes is refused as such, not failed on (an OSError naming work_dir).
    for too_long in ("a" * 300, "/".join(["é"] * 1400)):  # (a name over 255 bytes; a path over 4096)
        details = refusal(lambda: init_run(stub, tiny_model_dir, checkpoint_dir=too_long))  # noqa: B023
        assert "checkpoint_dir" in details and "too long" in details and str(work.resolve()) not in details
    init_run(stub, tiny_model_dir, checkpoint_dir="saves")
    assert stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(run_id="r1")).path == str(
        (work / "saves" / "step_0").resolve()
    )
    # Listed relative to work_dir (no server directory), as a model_path takes it.
    listed = stub.ListCheckpoints(trainer_pb2.ListCheckpointsRequest(run_id="r1", checkpoint_dir="saves"))
    assert [c.path for c in listed.checkpoints] == ["saves/step_0"]


def test_a_save_replaces_only_rlmeshs_own_checkpoints(trainer, tiny_model_dir):
    stub, work = trainer
    init_run(stub, tiny_model_dir)
    save = lambda path: stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(run_id="r1", path=path))  # noqa: E731
    theirs = keeper(work / "theirs")
    # A Hugging Face Trainer checkpoint has the same file names as ours, but it is not ours.
    hf = keeper(work / "checkpoint-500", "trainer_state.json", "optimizer.pt")
    for directory in (theirs, hf):
        code, details = code_of(lambda: save(directory.name))  # noqa: B023
        assert code == FAILED_PRECONDITION and "not a checkpoint rlmesh wrote" in details
    assert [p.name for p in theirs.iterdir()] == ["keep.txt"]
    assert sorted(p.name for p in hf.iterdir()) == ["optimizer.pt", "trainer_state.json"]

    beside = keeper(work / "ckpt.partial")  # a name the save once used for its scratch directory
    first = save("ckpt").path
    assert first == str((work / "ckpt").resolve()) and (work / "ckpt" / "model.safetensors").exists()
    assert save("ckpt").path == first  # our own checkpoint is replaced
    assert [p.name for p in beside.iterdir()] == ["keep.txt"]
    assert not [p.name for p in work.iterdir() if p.name.startswith(".")]  # no scratch directory left


def test_a_run_resumes_only_from_under_work_dir(trainer, tiny_model_dir, tmp_path):
    stub, _ = trainer
    init_run(stub, tiny_model_dir)
    saved = stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(run_id="r1", path="ckpt")).path
    stub.EndRun(trainer_pb2.EndRunRequest(run_id="r1"))
    copied = shutil.copytree(saved, tmp_path / "elsewhere")
    details = refusal(lambda: init_run(stub, copied, run_id="r2"))
    assert "model_path" in details and "work_dir" in details
    assert init_run(stub, saved, run_id="r2").run_id == "r2"


# ---------------------------------------------------------------- run ids, at every service


def test_every_service_refuses_run_ids_that_could_escape(buffer, trainer, start_in_loop, redis_url, tiny_model_dir):
    stub = buffer()
    trainer_stub, work = trainer
    _, port = start_in_loop(
        lambda: start_rollout(
            RolloutSettings(
                port=0, buffer_address="127.0.0.1:1", reward_address="127.0.0.1:1", engine_urls=["http://127.0.0.1:1"]
            )
        )
    )
    rollout = rollout_pb2_grpc.RolloutStub(sync_channel(f"127.0.0.1:{port}"))
    calls = [  # each takes a run id
        lambda r: stub.GetStats(buffer_pb2.GetStatsRequest(run_id=r)),
        lambda r: stub.ExportGroups(buffer_pb2.ExportGroupsRequest(run_id=r, path="x.jsonl")),
        lambda r: stub.DeleteRun(buffer_pb2.DeleteRunRequest(run_id=r)),
        lambda r: init_run(trainer_stub, tiny_model_dir, run_id=r),
        lambda r: trainer_stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(run_id=r)),
        lambda r: trainer_stub.GetStatus(trainer_pb2.GetStatusRequest(run_id=r)),
        lambda r: rollout.GenerateRollout(rollout_pb2.GenerateRolloutRequest(run_id=r, num_groups=1)),
        lambda r: rollout.Evaluate(rollout_pb2.EvaluateRequest(run_id=r, dataset="d")),
    ]
    for bad in BAD_RUN_IDS:
        for call in calls:
            assert "run_id" in refusal(functools.partial(call, bad))
    assert not work.exists()  # the trainer wrote nothing anywhere

    _, port = start_in_loop(lambda: start_coordinator(CoordinatorSettings(redis_url=redis_url, port=0)))
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=client_headers()) as api:
        for bad in ("a:b", "a:b:metrics", ".hidden", "%2E%2E"):
            for r in (api.get(f"/runs/{bad}"), api.post(f"/runs/{bad}/stop")):
                assert r.status_code == 422 and "run_id" in r.text, (bad, r.text)  # the REST API's bad-input answer


def test_the_embedded_redis_files_are_readable_by_their_owner_only(tmp_path):
    # Its append-only file holds every run's samples and registered reward services' bearer
    # tokens (it was world-readable).
    server = start_redis(tmp_path / "redis")
    try:
        redis.Redis.from_url(server.url).set("k", "v")
        redis.Redis.from_url(server.admin_url).execute_command("BGREWRITEAOF")
        time.sleep(1)
    finally:
        server.stop()
    written = [p for p in (tmp_path / "redis").rglob("*") if p.is_file()]
    assert any("appendonly" in p.name for p in written), written
    for path in [tmp_path / "redis", *written]:
        assert path.stat().st_mode & 0o077 == 0, (path, oct(path.stat().st_mode))
