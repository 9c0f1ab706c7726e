"""Named points where a chaos test can hold a process, to kill it (or a peer) at an exact
moment: between a train step and its acknowledgment, in the middle of a checkpoint save.

Off unless RLMESH_FAULTS_DIR is set (tests only): then, at `await fault_point("name")`, a
process finding <dir>/<name>.hold waits there while the hold exists, with
<dir>/<name>.reached present while it waits (only while held: a process passing just
before the hold appeared must not look held, nor one already let go). No setting, flag or
request of a deployed service reaches this.

The points: buffer.after_lease, buffer.after_ack (LeaseBatch, AckBatch: done in Redis,
reply not sent), trainer.before_ack, trainer.before_push, trainer.mid_push (a distributed push between two
buckets: the engines asked for the next one, not sent yet), trainer.checkpoint_written,
trainer.end_run (EndRun begun, its last checkpoint not written), trainer.background_push (a
background push's weights copied, nothing sent), rollout.evaluate (an
evaluation's prompts fetched, nothing generated)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

FAULTS_DIR_ENV = "RLMESH_FAULTS_DIR"
POLL_SECONDS = 0.05


def _reach(name: str) -> tuple[Path, Path] | None:
    """(hold, reached) of point `name`, marked reached, if the point holds (None: it does not)."""
    directory = os.environ.get(FAULTS_DIR_ENV)
    if not directory:
        return None
    hold, reached = Path(directory) / f"{name}.hold", Path(directory) / f"{name}.reached"
    if not hold.exists():
        return None
    reached.touch()
    return hold, reached


async def fault_point(name: str) -> None:
    if (held := _reach(name)) is None:
        return
    try:
        while held[0].exists():
            await asyncio.sleep(POLL_SECONDS)
    finally:  # (also a call cancelled while held: its caller died)
        held[1].unlink(missing_ok=True)


def blocking_fault_point(name: str) -> None:
    """fault_point for code on a worker thread."""
    if (held := _reach(name)) is None:
        return
    try:
        while held[0].exists():
            time.sleep(POLL_SECONDS)
    finally:
        held[1].unlink(missing_ok=True)
