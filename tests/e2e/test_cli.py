"""`rlmesh run` and `rlmesh runs` as a user types them, against the stack `rlmesh up` starts
(its own processes, its data directory): the example run config trains end to end and says
its eval and final model, the run is listed, its metrics come out as CSV, and Ctrl-C asks
whether to stop a run. The CLI finds the coordinator and its token in the data directory
(no token in its environment)."""

from __future__ import annotations

import csv
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rlmesh.common.auth import TOKEN_ENV, TOKEN_FILE_ENV

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "reverse" / "run.yaml"


def rlmesh(*args: str, data_dir: Path, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlmesh.cli", *args, "--data-dir", str(data_dir)],
        env=no_token_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        **kwargs,
    )


def no_token_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, TOKEN_FILE_ENV)}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """`rlmesh up` in its own process group, stopped with SIGINT (Ctrl-C) at the end."""
    data_dir = tmp_path_factory.mktemp("up")
    up = subprocess.Popen(
        [sys.executable, "-m", "rlmesh.cli", "up", "--data-dir", str(data_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while not (data_dir / "up.json").exists():
        assert up.poll() is None, up.stdout.read()
        assert time.monotonic() < deadline, "rlmesh up did not come up"
        time.sleep(0.2)
    yield data_dir
    up.send_signal(signal.SIGINT)
    up.wait(timeout=120)


@pytest.mark.slow
def test_rlmesh_run_trains_the_example_and_rlmesh_runs_shows_it(stack):
    done = rlmesh("run", str(EXAMPLE), data_dir=stack)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    run_id = lines[0].split()[1]
    assert lines[0].startswith(f"run {run_id} started: reverse-three-letters")
    assert any(" RL rollout " in line and "/20  train reward " in line for line in lines)
    assert f"run {run_id} completed" in lines
    assert any(line.startswith("eval held_out reward: before=") for line in lines)
    final = Path(next(line for line in lines if line.startswith("final model: ")).removeprefix("final model: "))
    assert (final / "config.json").exists() and final.is_relative_to(stack)

    listed = rlmesh("runs", data_dir=stack)
    assert listed.returncode == 0, listed.stderr
    header, row = listed.stdout.splitlines()[0], next(r for r in listed.stdout.splitlines() if r.startswith(run_id))
    assert header.split() == ["ID", "NAME", "STATUS", "PHASE", "ROLLOUT", "CREATED"]
    assert row.split()[1:5] == ["reverse-three-letters", "completed", "done", "20/20"]

    table = rlmesh("runs", "metrics", run_id, "--csv", data_dir=stack)
    assert table.returncode == 0, table.stderr
    rows = list(csv.DictReader(io.StringIO(table.stdout)))
    as_json = rlmesh("runs", "metrics", run_id, data_dir=stack).stdout.splitlines()
    assert len(rows) == len(as_json) > 20
    assert [int(r["rollout_id"]) for r in rows if r["rollout/reward_mean"]] == list(range(1, 21))
    assert float(rows[-1]["eval/held_out/reward_mean"]) == json.loads(as_json[-1])["eval/held_out/reward_mean"]

    shown = rlmesh("runs", "show", run_id, "--json", data_dir=stack)
    assert json.loads(shown.stdout)["status"] == "completed"
    missing = rlmesh("runs", "show", "nope", data_dir=stack)
    assert missing.returncode == 1 and "404 unknown run 'nope'" in missing.stderr


@pytest.mark.slow
def test_ctrl_c_asks_whether_to_stop_the_run(stack, tmp_path):
    config = tmp_path / "long.json"  # (the JSON form of a config works too)
    config.write_text(json.dumps({**yaml.safe_load(EXAMPLE.read_text()), "num_rollouts": 1000}))
    cli = subprocess.Popen(
        [sys.executable, "-m", "rlmesh.cli", "run", str(config), "--data-dir", str(stack)],
        env=no_token_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # (a shell that starts a job in the background, as CI may, leaves SIGINT ignored, and
        # Python then installs no Ctrl-C handler: the CLI's as a terminal would have it)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    first = cli.stdout.readline()
    run_id = first.split()[1]
    assert first.startswith(f"run {run_id} started"), first
    cli.stdout.readline()  # the first progress line: it follows the run
    cli.send_signal(signal.SIGINT)
    out, _ = cli.communicate("y\n", timeout=300)
    assert cli.returncode == 1, out
    assert f"stop run {run_id}? [y/N]" in out and f"run {run_id}: stopping" in out
    assert f"run {run_id} stopped" in out.splitlines()
