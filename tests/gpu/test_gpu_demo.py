"""`rlmesh demo` with the engine and the trainer on CUDA (marked gpu: skipped without one):
the services are told their device through the environment (RLMESH_ENGINE_DEVICE,
RLMESH_TRAINER_DEVICE), as a user would; the run learns the reverse task (the held-out greedy
reward rises by at least 0.2, as the CPU runs do in tests/e2e/test_modes.py) and the engine's
and trainer's logs say CUDA."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu


def test_the_demo_learns_with_engine_and_trainer_on_cuda(tmp_path):
    env = {**os.environ, "RLMESH_ENGINE_DEVICE": "cuda", "RLMESH_TRAINER_DEVICE": "cuda"}
    demo = subprocess.run(
        [sys.executable, "-m", "rlmesh.cli", "demo", "--data-dir", str(tmp_path), "--rollouts", "30"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=1200,
        env=env,
    )
    assert demo.returncode == 0, demo.stdout[-3000:]
    last = demo.stdout.strip().splitlines()[-1]
    before, after = map(float, re.fullmatch(r"eval reward: before=([\d.]+) after=([\d.]+)", last).groups())
    assert after >= before + 0.2, demo.stdout[-3000:]
    logs = "\n".join(p.read_text(errors="replace") for p in tmp_path.rglob("*.log"))
    assert "cuda" in logs, "no service log mentions CUDA"
