"""Verifiers that misbehave, for the verifier pool's tests: the service is built with
VERIFIERS (the built-ins plus these) in place of the built-in table."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from rlmesh.reward.workers import BUILTIN_VERIFIERS


def hang(response: str, label: str, metadata: dict[str, Any]) -> float:
    """Never returns: only killing its worker ends it."""
    while True:
        time.sleep(1)


def held(response: str, label: str, metadata: dict[str, Any]) -> float:
    """Busy until the file the label names exists: a worker the test holds and releases. It
    first creates `label`.started, so the test knows the worker holds it."""
    Path(label + ".started").touch()
    while not Path(label).exists():
        time.sleep(0.01)
    return 1.0


def crash(response: str, label: str, metadata: dict[str, Any]) -> float:
    os._exit(3)  # the worker process dies, as on a segfault or the OOM killer


VERIFIERS = {**BUILTIN_VERIFIERS, **{name: f"{__name__}:{name}" for name in ("hang", "held", "crash")}}
