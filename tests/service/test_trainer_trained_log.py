"""The trainer's record of which groups each step trained (rlmesh.trainer.trained_log): a
checkpoint writes only the steps since the one before, pruning checkpoints loses nothing
of it, a resume rebuilds all of it (and drops what belonged to no checkpoint), and
checkpoints written before the log still load. Over a real buffer on a real Redis."""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import redis

import rlmesh.trainer.checkpoints as checkpoints_module
from rlmesh.buffer.config import Settings as BufferSettings
from rlmesh.buffer.keys import run_keys
from rlmesh.buffer.server import start as start_buffer
from rlmesh.common.grpc_server import sync_channel
from rlmesh.common.sample import group_to_proto
from rlmesh.trainer.config import Settings
from rlmesh.trainer.trained_log import COUNT_KEY, LEGACY_KEY, LOG_KEY, GroupIds, log_path, resume_log
from rlmesh.trainer.trainer import Trainer
from rlmesh.v1.buffer_pb2_grpc import BufferStub
from tests.helpers.buffer import create, put
from tests.helpers.trainer import config, make_groups


def step_groups(step: int):
    """Two trainable groups with ids of one width ("s<step>-<i>")."""
    groups = make_groups()
    for i, g in enumerate(groups):
        g.group_id = f"s{step}-{i}"
    return [group_to_proto(g) for g in groups]


def holds(trained, ids: set[str]) -> bool:
    """Whether a record holds exactly these ids (it keeps their digests, not the ids)."""
    return len(trained.ids) == len(ids) and all(gid in trained for gid in ids)


def ids_through(step: int) -> set[str]:
    return {f"s{s}-{i}" for s in range(1, step + 1) for i in range(2)}


class Stack:
    """A buffer on the test's Redis, and trainers on one work_dir driven on the test loop."""

    def __init__(self, redis_url, start_in_loop, loop_thread, tmp_path: Path, tiny_model_dir: Path, dataset) -> None:
        _, port = start_in_loop(lambda: start_buffer(BufferSettings(redis_url=redis_url, port=0)))
        self.address = f"127.0.0.1:{port}"
        self.buffer = BufferStub(sync_channel(self.address))
        self.redis = redis.Redis.from_url(redis_url)
        self.loop, self.work_dir = loop_thread, tmp_path
        self.cfg = config(tiny_model_dir, checkpoint_interval=1, keep_last=2)
        self.checkpoints = tmp_path / "r1" / "checkpoints"
        create(self.buffer, dataset)
        self.trainers: list[Trainer] = []

    def trainer(self) -> Trainer:
        """A trainer set up with run r1 (a restarted one: it resumes the newest checkpoint)."""
        trainer = Trainer(Settings(work_dir=self.work_dir, buffer_address=self.address))
        self.trainers.append(trainer)
        self.loop.run(trainer.init_run("r1", self.cfg))
        return trainer

    def train(self, trainer: Trainer, step: int, write: bool = True):
        if write:
            put(self.buffer, step_groups(step))
        result = self.loop.run(trainer.train_step("r1", 2, wait_seconds=5))
        self.loop.run(trainer._run.saved())  # (the step's checkpoint on disk)
        return result

    def kill(self, trainer: Trainer) -> None:
        """The trainer is gone, as after SIGKILL: nothing of its run is ended or flushed."""
        self.trainers.remove(trainer)

    def hand_out_again(self, group_id: str, step: int) -> None:
        """What the buffer does after its Redis lost the write that acknowledged the group:
        queue it again."""
        k = run_keys("rlmesh", "r1")
        [raw] = [g.SerializeToString() for g in step_groups(step) if g.group_id == group_id]
        self.redis.srem(k.acked, group_id)
        self.redis.hset(k.groups, group_id, raw)
        self.redis.lpush(k.queue, group_id)

    def close(self) -> None:
        for trainer in self.trainers:
            self.loop.run(trainer.close())


def test_each_checkpoint_writes_only_its_own_steps_and_a_resume_rebuilds_the_whole_record(
    redis_url, start_in_loop, loop_thread, tmp_path, tiny_model_dir, dataset, monkeypatch
):
    stack = Stack(redis_url, start_in_loop, loop_thread, tmp_path, tiny_model_dir, dataset)
    try:
        first = stack.trainer()
        log = log_path(stack.checkpoints, "r1")
        state_sizes, log_sizes = [], [0]
        for step in range(1, 5):
            assert stack.train(first, step).groups_trained == 2
            state_sizes.append((stack.checkpoints / f"step-{step:06d}" / "trainer_state.json").stat().st_size)
            log_sizes.append(log.stat().st_size)
        # What each checkpoint writes does not grow with the run: the same bytes per step.
        assert len(set(state_sizes)) == 1, state_sizes
        assert len({b - a for a, b in pairwise(log_sizes)}) == 1, log_sizes
        # keep_last=2: steps 1-2's checkpoints are gone, their part of the record is not.
        assert sorted(p.name for p in stack.checkpoints.glob("step-*")) == ["step-000003", "step-000004"]

        # Step 5 is trained, its groups are in the log, and the trainer dies before its
        # checkpoint is written: a resume from step 4 holds exactly the groups of steps
        # 1-4, and the log no longer lists step 5's.
        def dies(*args):
            raise OSError("killed while writing")

        monkeypatch.setattr(checkpoints_module, "commit_checkpoint", dies)
        stack.train(first, 5)
        assert json.loads(log.read_text().splitlines()[-1])["step"] == 5
        monkeypatch.undo()
        stack.kill(first)
        second = stack.trainer()
        assert second._run.backend.step == 4
        assert holds(second._run.trained, ids_through(4))
        assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2, 3, 4]

        # The buffer hands out again step 5's groups (rolled back): trained again. Then a
        # group step 1 trained (its checkpoint pruned long ago) comes back, as after a lost
        # Redis write: acknowledged, not trained twice.
        assert stack.train(second, 5, write=False).groups_trained == 2
        stack.hand_out_again("s1-0", 1)
        put(stack.buffer, step_groups(6)[1:])
        result = stack.train(second, 6, write=False)
        assert (result.step, result.groups_trained, result.metrics["repeated_groups"]) == (6, 1, 1)
        third = (stack.close(), stack.trainer())[1]
        assert holds(third._run.trained, ids_through(5) | {"s6-1"})
    finally:
        stack.close()


def test_a_checkpoint_written_before_the_log_still_loads(
    redis_url, start_in_loop, loop_thread, tmp_path, tiny_model_dir, dataset
):
    stack = Stack(redis_url, start_in_loop, loop_thread, tmp_path, tiny_model_dir, dataset)
    try:
        first = stack.trainer()
        for step in (1, 2):
            stack.train(first, step)
        # As the trainer wrote it before the log: the whole record in trainer_state.json.
        newest = stack.checkpoints / "step-000002"
        state = json.loads((newest / "trainer_state.json").read_text())
        state[LEGACY_KEY] = {str(s): sorted(ids_through(s) - ids_through(s - 1)) for s in (1, 2)}
        del state[LOG_KEY], state[COUNT_KEY]
        (newest / "trainer_state.json").write_text(json.dumps(state, indent=2))
        log_path(stack.checkpoints, "r1").unlink()

        second = stack.trainer()
        assert holds(second._run.trained, ids_through(2))
        stack.hand_out_again("s1-1", 1)
        put(stack.buffer, step_groups(3)[:1])
        result = stack.train(second, 3, write=False)
        assert (result.groups_trained, result.metrics["repeated_groups"]) == (1, 1)
        # The resume wrote the log from the old checkpoint, and the new ones carry on from it.
        third = (stack.close(), stack.trainer())[1]
        assert holds(third._run.trained, ids_through(2) | {"s3-0"})
    finally:
        stack.close()


def test_a_resume_takes_no_record_from_another_runs_checkpoint_or_a_torn_line(tmp_path):
    checkpoint = tmp_path / "step-000003"
    theirs = {"run_id": "r0", "step": 3, LEGACY_KEY: {"1": ["g0"]}}
    assert holds(resume_log(tmp_path, "r1", checkpoint, theirs), set())  # (their g0 is not r1's g0)

    log = log_path(tmp_path, "r1")
    log.write_text('{"step":1,"ids":["g0"]}\n{"step":2,"ids":["g1"]}\n{"step":3,"ids":["g2"]}\n{"step":4,"id')
    mine = {"run_id": "r1", "step": 2, LOG_KEY: f"../{log.name}", COUNT_KEY: 2}
    trained = resume_log(tmp_path, "r1", tmp_path / "step-000002", mine)
    assert holds(trained, {"g0", "g1"}) and trained.count == 2
    assert log.read_text() == '{"step":1,"ids":["g0"]}\n{"step":2,"ids":["g1"]}\n'
    trained.add(3, ["g5"])
    trained.flush()
    assert log.read_text().splitlines()[-1] == '{"step":3,"ids":["g5"]}'


def test_a_record_named_outside_the_checkpoint_directory_is_not_read(tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "trained-groups.r1.jsonl").write_text('{"step":1,"ids":["g0"]}\n')
    (tmp_path / "notes.jsonl").write_text('{"step":1,"ids":["g1"]}\n')
    for named in ("../elsewhere/trained-groups.r1.jsonl", "../notes.jsonl", "/etc/hostname"):
        state = {"run_id": "r1", "step": 1, LOG_KEY: named, COUNT_KEY: 1}
        trained = resume_log(tmp_path, "r1", tmp_path / "step-000001", state)
        assert holds(trained, set()) and trained.count == 0, named


def test_the_record_keeps_ids_compactly_and_finds_each_one():
    """Membership at 8 bytes an id, the newest ids merged into a sorted array as they come."""
    trained = GroupIds(f"ref:train:0:{i}" for i in range(5000))
    for step in range(20):
        trained.update(f"ref:train:1:{step}-{i}" for i in range(512))
    assert len(trained) == 5000 + 20 * 512
    assert all(f"ref:train:0:{i}" in trained for i in range(0, 5000, 7))
    assert all(f"ref:train:1:{step}-{i}" in trained for step in range(20) for i in range(0, 512, 5))
    assert not any(f"ref:train:2:{i}" in trained for i in range(5000))
    assert trained._sorted.nbytes <= 8 * len(trained)
