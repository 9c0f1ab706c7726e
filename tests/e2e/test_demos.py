"""The agent demo as a user runs it (`rlmesh demo --task agent`: its own stack, the run
through the REST API): RL lifts the held-out reward by at least 0.3, the line it ends with."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_the_agent_demo_learns_to_call_its_tool(tmp_path):
    demo = subprocess.run(
        [sys.executable, "-m", "rlmesh.cli", "demo", "--task", "agent", "--data-dir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=900,
    )
    assert demo.returncode == 0, demo.stdout[-3000:]
    last = demo.stdout.strip().splitlines()[-1]
    before, after = map(float, re.fullmatch(r"eval reward: before=([\d.]+) after=([\d.]+)", last).groups())
    assert after >= before + 0.3, demo.stdout[-3000:]
