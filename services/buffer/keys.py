"""Where a run lives in Redis: its keys, one field per key (a misspelt key is an
AttributeError, never a new key), and its spec, whose existence is the run's existence.

Keys of a run live under `<prefix>:run:<run_id>:` (RunKeys below lists them):
  spec            run spec (JSON); its existence is the run's existence
  data:<dataset>  prompt records (list of JSON, see rlmesh.buffer.datasets)
  cursor          hash: <dataset> -> prompts drawn so far; __groups__ -> next group index
  prompts         hash: group_id -> handed-out prompt group (bytes, or a "ref:" to build it)
  prompt_leases   zset: group_id -> lease expiry (unix seconds on Redis's clock: TIME)
  partial         list of group ids + partial_groups hash: aborted groups waiting to resume
  groups          hash: group_id -> completed SampleGroup (bytes), until acknowledged
  meta            hash: group_id -> summary (samples, oldest weight version, rewards...)
  queue           list of completed group ids waiting for training (oldest first)
  batch_leases    zset: lease_id -> expiry (as prompt_leases');  batch:<lease_id>  list of its group ids
  deliveries      hash: group_id -> its leases that expired or are live (bounded by
                  max_deliveries), until acknowledged
  rollbacks       hash: group_id -> its leases released by a trainer's restart
                  (RollbackToCheckpoint; bounded by max_rollbacks), until acknowledged
  acked           set of acknowledged group ids (never delivered or stored again)
  acked_leases    hash: lease_id -> groups it acknowledged, for the newest leases (oldest
                  first in acked_lease_order): a retried AckBatch answers as the first did
  provisional     list of group ids acknowledged provisionally (oldest first) +
                  provisional_steps hash (group_id -> "<step>/<load_id>": the step that
                  trained it, and which load of the trainer's model did): kept in
                  `groups` until a checkpoint holding the step is committed (CommitAcks)
                  or the trainer restarts from an older one (RollbackToCheckpoint)
  discarded       set of dropped or dead-lettered group ids (stale, filtered out by the
                  rollout, rejected by a trainer, delivered max_deliveries or
                  max_rollbacks times)
  dead_letters    list of dead-lettered group ids (oldest first) + dead_groups hash
                  (group_id -> bytes) + dead_reasons hash (group_id -> why)
  stats           hash of counters;  rate_snapshots  zset of counter snapshots (rates)
  recent_ids      list of the newest stored group ids (newest first), capped at
                  recent_groups: what a person watching the run browses (GetRecentGroups);
                  their bytes stay in `groups` after they leave it (`retained`: those ids)
  closed          set by CloseRun when the run is over: no more prompts or groups taken
                  (CLOSED_RUN_DROPS and the dataset copies are deleted then)"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields

import redis.asyncio as aioredis

from rlmesh.common.errors import FailedPrecondition, NotFound
from rlmesh.common.paths import validate_run_id


@dataclass(frozen=True)
class RunKeys:
    """The keys of the run under `base` (`<prefix>:run:<run_id>:`): keys.queue is "<base>queue"."""

    base: str
    spec: str = field(init=False)
    cursor: str = field(init=False)
    prompts: str = field(init=False)
    prompt_leases: str = field(init=False)
    partial: str = field(init=False)
    partial_groups: str = field(init=False)
    groups: str = field(init=False)
    meta: str = field(init=False)
    queue: str = field(init=False)
    batch_leases: str = field(init=False)
    deliveries: str = field(init=False)
    rollbacks: str = field(init=False)
    acked: str = field(init=False)
    acked_leases: str = field(init=False)
    acked_lease_order: str = field(init=False)
    provisional: str = field(init=False)
    provisional_steps: str = field(init=False)
    discarded: str = field(init=False)
    dead_letters: str = field(init=False)
    dead_groups: str = field(init=False)
    dead_reasons: str = field(init=False)
    stats: str = field(init=False)
    rate_snapshots: str = field(init=False)
    recent_ids: str = field(init=False)
    retained: str = field(init=False)
    closed: str = field(init=False)

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name != "base":
                object.__setattr__(self, f.name, self.base + f.name)  # each key is its field's name

    def data(self, dataset: str) -> str:
        return f"{self.base}data:{dataset}"

    def batch(self, lease_id: str) -> str:
        return f"{self.base}batch:{lease_id}"


def run_keys(key_prefix: str, run_id: str) -> RunKeys:
    # ':' or '*' in an id would reach into another run's keys (DeleteRun scans by prefix).
    return RunKeys(f"{key_prefix}:run:{validate_run_id(run_id)}:")


def unknown_run(run_id: str) -> NotFound:
    return NotFound(f"unknown run {run_id!r}: create it with CreateRun first")


def closed_run(run_id: str) -> FailedPrecondition:
    return FailedPrecondition(
        f"run {run_id!r} has ended (CloseRun): the buffer hands out no more of its prompts and takes no more "
        "of its groups (its copies of the datasets were deleted)"
    )


# What CloseRun deletes (besides the dataset copies): what only a live run reads. The
# acknowledged and discarded ids keep a retried or late write from storing a group twice;
# a closed run refuses every write of groups, so nothing reads them any more.
CLOSED_RUN_DROPS = (
    "prompts",
    "prompt_leases",
    "partial",
    "partial_groups",
    "acked",
    "discarded",
    "acked_leases",
    "acked_lease_order",
    "rate_snapshots",
)


async def read_spec(redis: aioredis.Redis, k: RunKeys, run_id: str) -> dict:
    """The run's spec (as create_run wrote it); NotFound for an unknown run."""
    raw = await redis.get(k.spec)
    if raw is None:
        raise unknown_run(run_id)
    return json.loads(raw)
