"""Named points where a chaos test can hold a process, to kill it (or a peer) at an exact
moment: between a train step and its acknowledgment, in the middle of a checkpoint save.

Off unless RLMESH_FAULTS_DIR is set (tests only): then, at `await fault_point("name")`,
the process creates <dir>/<name>.reached and waits while <dir>/<name>.hold exists. No
setting, flag or request of a deployed service reaches this."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

FAULTS_DIR_ENV = "RLMESH_FAULTS_DIR"
POLL_SECONDS = 0.05


def _reach(name: str) -> Path | None:
    """Mark point `name` reached; the file whose existence holds the process there (None: off)."""
    directory = os.environ.get(FAULTS_DIR_ENV)
    if not directory:
        return None
    (Path(directory) / f"{name}.reached").touch()
    return Path(directory) / f"{name}.hold"


async def fault_point(name: str) -> None:
    hold = _reach(name)
    while hold is not None and hold.exists():
        await asyncio.sleep(POLL_SECONDS)


def blocking_fault_point(name: str) -> None:
    """fault_point for code on a worker thread."""
    hold = _reach(name)
    while hold is not None and hold.exists():
        time.sleep(POLL_SECONDS)
