"""Where a training step's time goes: the demo's run (`rlmesh demo`'s task and settings,
fewer rollouts, no evaluation between steps) in each mode asked for, on one `rlmesh up`
stack, and the mean of each step's time split (`split/*`, docs/metrics.md): generate,
reward, train, weight update, and "other", the time in none of them. The aim: other at most
5% of a sync step. Engine and trainer get one torch thread each. The first RL step of each
run is left out (it pays for warming up). Beside them, how many cores each service used
while the run was in its RL phase (its CPU time over that time, from /proc): how busy the
engine is tells how much of a step it waits.

    python -m bench.step_split [--modes sync] [--rollouts 12] [--sft-steps 5]

It ends with its summary as a markdown table (the form docs/benchmarks.md keeps), then
one line: a JSON object with the results.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench.report import print_table
from rlmesh.cli.client import follow
from rlmesh.cli.demo import demo_config, run_metrics, write_task
from rlmesh.cli.launcher import datasets_dir, start_stack
from rlmesh.cli.tiny_model import build_tiny_model
from rlmesh.common.auth import client_headers

PARTS = ("generate", "reward", "train", "update", "other")
# Each a column; "cpu all" sums every service (the embedded Redis is not counted).
CPU_SHOWN = ("engine", "rollout", "trainer", "buffer", "reward", "coordinator")


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU time so far (Linux /proc), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class RLPhaseCpu:
    """Asked at each poll of the run: each service's CPU time at the first and the last poll
    that found the run training (phase rl); cores() is their difference over the time between."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids if Path("/proc/self/stat").exists() else {}
        self.first: tuple[float, dict[str, float]] | None = None
        self.last: tuple[float, dict[str, float]] | None = None

    def __call__(self, run: dict) -> None:
        if run["status"] == "running" and run["phase"] == "rl" and self.pids:
            snapshot = (time.monotonic(), {name: cpu_seconds(pid) for name, pid in self.pids.items()})
            self.first, self.last = self.first or snapshot, snapshot

    def cores(self) -> dict[str, float]:
        if self.first is None or self.last is None or self.last[0] - self.first[0] < 1:
            return {}
        seconds = self.last[0] - self.first[0]
        return {name: (self.last[1][name] - self.first[1][name]) / seconds for name in self.pids}


def run_split(api: httpx.Client, config: dict, mode: str, pids: dict[str, int]) -> dict:
    r = api.post("/runs", json={**config, "mode": mode, "name": f"bench.step_split {mode}"})
    r.raise_for_status()
    run_id = r.json()["id"]
    cpu = RLPhaseCpu(pids)
    run = follow(api, run_id, time.monotonic(), echo=lambda _line: None, check=cpu)  # (until it ends)
    if run["status"] != "completed":
        raise SystemExit(f"{mode} run {run['status']}: {run['error']}")
    steps = [m for m in run_metrics(api, run_id) if "split/step_seconds" in m][1:]
    row = {"mode": f"`{mode}`", "steps": len(steps)}
    step = statistics.fmean(m["split/step_seconds"] for m in steps)
    row["step s"] = step
    for part in PARTS:
        row[f"{part} s"] = statistics.fmean(m[f"split/{part}_seconds"] for m in steps)
    row["other share"] = sum(m["split/other_seconds"] for m in steps) / sum(m["split/step_seconds"] for m in steps)
    cores = cpu.cores()
    if cores:
        row.update({f"cpu {name}": cores[name] for name in CPU_SHOWN if name in cores})
        row["cpu all"] = sum(cores.values())
    print(row, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="sync", help="comma-separated: sync, one_step_off, fully_async")
    parser.add_argument("--rollouts", type=int, default=12, help="RL iterations per run")
    parser.add_argument("--sft-steps", type=int, default=5, help="SFT warm-start steps per run")
    parser.add_argument(
        "--background-push",
        action="store_true",
        help="fully_async pushes its weights beside the next train step (weight_sync.background)",
    )
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"  # one thread per torch process (engine, trainer)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    with tempfile.TemporaryDirectory(prefix="rlmesh-bench-split-") as tmp:
        data_dir = Path(tmp)
        model = build_tiny_model(data_dir / "tiny-model")
        train, held_out = write_task(datasets_dir(data_dir) / "demo")
        config = demo_config(str(model), train, held_out, args.sft_steps, args.rollouts).model_dump(mode="json")
        config["eval"]["interval"] = 0
        print("starting rlmesh (embedded Redis, CPU reference engine, tiny model):", flush=True)
        stack = start_stack(data_dir, str(model))
        try:
            with httpx.Client(base_url=stack.coordinator_url, timeout=60, headers=client_headers()) as api:
                pids = {name: process.pid for name, process in stack.processes.items()}
                background = {**config, "weight_sync": {**config["weight_sync"], "background": True}}
                rows = [
                    run_split(api, background if args.background_push and mode == "fully_async" else config, mode, pids)
                    for mode in modes
                ]
        finally:
            stack.stop()
    title = (
        f"python -m bench.step_split --modes {','.join(modes)} --rollouts {args.rollouts}"
        f"{' --background-push' if args.background_push else ''}, {os.cpu_count()} CPUs"
    )
    print_table(rows, title, floatfmt=".3f")
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
