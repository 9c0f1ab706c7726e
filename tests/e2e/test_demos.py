"""The demos as a user runs them (`rlmesh demo --task ...`: their own stack, the run through
the REST API): RL lifts the held-out reward, the line they end with."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

# The environment demo's RL iterations in its test (the demo itself runs 80).
ENVIRONMENT_DEMO_ROLLOUTS = 12


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


@pytest.mark.slow
def test_the_environment_demo_learns_through_an_atropos_environment(tmp_path):
    """`rlmesh demo --task environment`, shortened: the RL samples come only from an Atropos
    environment (atroposlib's BaseEnv in `serve` mode, its own process) and the held-out
    reward still rises."""
    pytest.importorskip("atroposlib")
    demo = subprocess.run(
        [sys.executable, "-m", "rlmesh.cli", "demo", "--task", "environment", "--data-dir", str(tmp_path)]
        + ["--rollouts", str(ENVIRONMENT_DEMO_ROLLOUTS)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    assert demo.returncode == 0, demo.stdout[-3000:]
    *_, groups, last = demo.stdout.strip().splitlines()
    before, after = map(float, re.fullmatch(r"eval reward: before=([\d.]+) after=([\d.]+)", last).groups())
    assert after >= before + 0.2, demo.stdout[-3000:]
    taken = int(re.fullmatch(r"environment groups: (\d+) taken, 0 refused, \d+ dropped as stale", groups).group(1))
    assert taken >= ENVIRONMENT_DEMO_ROLLOUTS * 16  # (every step's batch came from the environment)
