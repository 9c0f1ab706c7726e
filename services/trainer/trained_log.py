"""Which groups each step of a run trained: the record behind the trainer's exactly-once
check (a group the buffer hands out again is acknowledged, not trained twice).

It is an append-only log beside the run's checkpoints, `trained-groups.<run_id>.jsonl` in
the checkpoint directory (one JSON line per step: {"step": s, "ids": [...]}), not a copy
inside each checkpoint. A checkpoint of step s first appends the steps trained since the
last append and syncs the file, then is written, marked complete and renamed into place;
its trainer_state.json names the log and counts the ids the log holds through s. So:

- a checkpoint costs what its own steps trained, not everything the run trained before;
- pruning checkpoints (keep_last) deletes no part of the record: the log is not in any
  checkpoint directory;
- every line through a complete checkpoint's step was synced before that checkpoint was
  marked complete. Lines past it (steps a trainer that died took after its last
  checkpoint, or a torn last line) belong to no checkpoint: a resume from step s reads the
  lines through s and rewrites the log without the rest (those steps are trained again).

Checkpoints written before the log hold the whole record in trainer_state.json
(`trained_groups`); they still load, and the first resume writes the log from them."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from rlmesh.trainer.checkpoints import fsync_dir

log = logging.getLogger(__name__)

# Keys of trainer_state.json: the log (relative to the checkpoint directory) and how many
# ids it lists through the checkpoint's step; LEGACY_KEY: the whole record, as checkpoints
# written before the log held it.
LOG_KEY = "trained_groups_log"
COUNT_KEY = "trained_group_count"
LEGACY_KEY = "trained_groups"


LOG_NAME = re.compile(r"trained-groups\.[\w-]{1,128}\.jsonl")


def log_path(checkpoint_dir: Path, run_id: str) -> Path:
    return checkpoint_dir / f"trained-groups.{run_id}.jsonl"


class GroupIds:
    """A set of group ids for membership only, at 8 bytes an id: each id's 64-bit digest, in a
    sorted array plus a set of the newest, merged in when it grows past an eighth of the
    array (a run of millions of groups keeps megabytes, not the ids' hundreds). Two ids with
    one digest (about 3 in 10^8 for a run of a million groups) would have the second
    acknowledged untrained if the buffer ever handed it out again."""

    def __init__(self, ids: Iterable[str] = ()) -> None:
        self._sorted = np.empty(0, dtype=np.uint64)
        self._newest: set[int] = set()
        self.update(ids)

    def update(self, ids: Iterable[str]) -> None:
        self._newest.update(map(_digest, ids))
        if len(self._newest) > max(MERGE_AT_LEAST, len(self._sorted) // 8):
            newest = np.fromiter(self._newest, dtype=np.uint64, count=len(self._newest))
            self._sorted = np.union1d(self._sorted, newest)
            self._newest.clear()

    def __contains__(self, group_id: str) -> bool:
        digest = _digest(group_id)
        if digest in self._newest:
            return True
        i = int(np.searchsorted(self._sorted, np.uint64(digest)))
        return i < len(self._sorted) and int(self._sorted[i]) == digest

    def __len__(self) -> int:
        return len(self._sorted) + len(self._newest)


MERGE_AT_LEAST = 4096  # ids in GroupIds' set of the newest before a merge


def _digest(group_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(group_id.encode(), digest_size=8).digest(), "little")


class TrainedLog:
    """A run's record as the trainer holds it: every group id the model holds (`in`), and
    the steps trained since the last checkpoint (`pending`), appended to the log by `flush`.
    One writer (the trainer, under its lock). `size` is the end of what is known to be
    whole, so a failed append (a full disk) is overwritten by the next one instead of
    leaving a torn line in the middle."""

    def __init__(self, path: Path, ids: GroupIds, size: int, count: int) -> None:
        self.path = path
        self.ids = ids
        self.count = count  # ids listed in the log (an id trained at two steps counts twice)
        self.size = size
        self.pending: dict[int, list[str]] = {}

    def __contains__(self, group_id: str) -> bool:
        return group_id in self.ids

    def add(self, step: int, ids: list[str]) -> None:
        """`ids` trained at `step` (added to it: a step that trained nothing leaves the step
        where the one before did)."""
        self.pending.setdefault(step, []).extend(ids)
        self.ids.update(ids)

    def flush(self) -> None:
        """Append the pending steps and sync; they stay pending if that fails."""
        lines = [_line(step, ids) for step, ids in sorted(self.pending.items()) if ids]
        if lines:
            created = not self.path.exists()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "ab" if created else "r+b") as f:
                f.seek(self.size)
                data = "".join(lines).encode()
                f.write(data)
                f.truncate()
                f.flush()
                os.fsync(f.fileno())
            if created:
                fsync_dir(self.path.parent)
            self.size += len(data)
            self.count += sum(len(ids) for ids in self.pending.values())
        self.pending.clear()

    def state(self, checkpoint: Path) -> dict:
        """What a checkpoint written to `checkpoint` keeps in its trainer_state.json."""
        return {LOG_KEY: os.path.relpath(self.path, checkpoint), COUNT_KEY: self.count}


def _line(step: int, ids: list[str]) -> str:
    return json.dumps({"step": step, "ids": ids}, separators=(",", ":")) + "\n"


def read_log(path: Path, through_step: int) -> tuple[dict[int, list[str]], bool]:
    """The log's record through `through_step` (step -> ids), and whether the file is
    exactly that (no later lines, no torn one). A missing file is an empty record."""
    record: dict[int, list[str]] = {}
    exact = True
    try:
        with open(path, "rb") as f:
            for raw in f:
                try:
                    line = json.loads(raw)
                    step, ids = int(line["step"]), list(line["ids"])
                except (ValueError, KeyError, TypeError):
                    exact = False  # a torn last line: written for a checkpoint that never completed
                    continue
                if step > through_step or not raw.endswith(b"\n"):
                    exact = False
                    continue
                record.setdefault(step, []).extend(ids)
    except FileNotFoundError:
        pass
    return record, exact


def trained_record(checkpoint: Path, state: dict) -> dict[int, list[str]]:
    """Which groups each step trained, as far as the checkpoint at `checkpoint` (with its
    trainer_state.json `state`) holds them."""
    if LEGACY_KEY in state:
        return {int(step): list(ids) for step, ids in state[LEGACY_KEY].items()}
    if LOG_KEY not in state:
        return {}
    path = Path(os.path.normpath(checkpoint / state[LOG_KEY]))  # (lexically: the checkpoint may be renamed)
    if path.parent != Path(os.path.normpath(checkpoint.parent)) or not LOG_NAME.fullmatch(path.name):
        # (trainer_state.json is a file on disk, not to be trusted to name what the trainer reads)
        log.warning(
            "%s: its trainer_state.json names %r as its record of trained groups, which is not a "
            "trained-groups.<run>.jsonl beside the checkpoint: not read (the run resumes without it)",
            checkpoint,
            state[LOG_KEY],
        )
        return {}
    record, _ = read_log(path, int(state.get("step", 0)))
    found = sum(len(ids) for ids in record.values())
    if found != int(state.get(COUNT_KEY, found)):
        log.warning(
            "%s: its record of trained groups (%s) lists %d groups through step %s, the checkpoint counted %d; "
            "groups missing from it would be trained again if the buffer handed them out again",
            checkpoint,
            path,
            found,
            state.get("step"),
            state[COUNT_KEY],
        )
    return record


def resume_log(checkpoint_dir: Path, run_id: str, checkpoint: Path | None, state: dict) -> TrainedLog:
    """The run's record for a model loaded from `checkpoint` (with
    trainer_state.json `state`; None or {}: the run starts afresh). The log is rewritten to
    exactly the checkpoint's record (a temporary file, synced, renamed) when it holds more
    (steps past the checkpoint), less (a checkpoint written before the log, or another
    directory's) or a torn line."""
    path = log_path(checkpoint_dir, run_id)
    step = int(state.get("step", 0))
    mine = checkpoint is not None and state.get("run_id") == run_id  # (another run's groups are not this run's)
    record = trained_record(checkpoint, state) if mine else {}
    own, exact = read_log(path, step if mine else 0)
    if not (exact and own == record):
        _rewrite(path, record)
    return TrainedLog(
        path,
        GroupIds(gid for ids in record.values() for gid in ids),
        path.stat().st_size if path.exists() else 0,
        sum(len(ids) for ids in record.values()),
    )


def _rewrite(path: Path, record: dict[int, list[str]]) -> None:
    if not record:
        path.unlink(missing_ok=True)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fresh = path.with_name(f".{path.name}.tmp")
    with open(fresh, "w") as f:
        f.writelines(_line(step, ids) for step, ids in sorted(record.items()) if ids)
        f.flush()
        os.fsync(f.fileno())
    fresh.rename(path)
    fsync_dir(path.parent)
