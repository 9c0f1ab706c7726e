"""rlmesh on a GPU: the demo's run (reverse-the-letters task, the tiny model) with the engine
and the trainer on CUDA, on one `rlmesh up` stack, once with the weights pushed over
torch.distributed (NCCL: the default layout's path) and once colocated (the engine
releasing its memory while the trainer trains, updated in place; weight_sync.method
"colocated"), the same model in the same invocation.

Figures, per layout: RL samples trained per second of RL wall time, the step split (the
seconds of generation, training and the weight update per iteration, and their shares), and
the weight update's seconds per GB (its median over iterations, from the trainer's own
timing and bytes).

    python -m bench.gpu [--rollouts 20]

Needs CUDA (without it, it says so and measures nothing). It ends with its summary as a markdown table,
then one line: a JSON object with the results.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from bench.report import print_table
from rlmesh.cli.demo import demo_config, write_task
from rlmesh.cli.launcher import datasets_dir, start_stack
from rlmesh.cli.tiny_model import build_tiny_model
from rlmesh.common.auth import client_headers

LAYOUTS = {"distributed": {"method": "distributed"}, "colocated": {"method": "colocated"}}


def _get_run(api: httpx.Client, run_id: str, metrics_last: int = 0) -> dict:
    r = api.get(f"/runs/{run_id}", params={"metrics_last": metrics_last})
    r.raise_for_status()
    return r.json()


def run_layout(api: httpx.Client, config: dict, layout: str) -> dict:
    body = {
        **config,
        "weight_sync": {**config.get("weight_sync", {}), **LAYOUTS[layout]},
        "name": f"bench.gpu {layout}",
    }
    r = api.post("/runs", json=body)
    r.raise_for_status()
    run_id = r.json()["id"]
    said = ""
    while (run := _get_run(api, run_id))["status"] not in ("completed", "failed", "stopped"):
        now = f"{layout}: {run['status']} {run.get('phase', '')} {run.get('rollout_id', 0)}/{config['num_rollouts']}"
        now += f", waiting for {run['waiting_for']}" if run.get("waiting_for") else ""
        if now != said:  # (progress on stderr: the results alone on stdout)
            print(now, file=sys.stderr, flush=True)
            said = now
        time.sleep(0.5)
    if run["status"] != "completed":
        raise SystemExit(f"{layout} run {run['status']}: {run['error']}")
    run = _get_run(api, run_id, metrics_last=10_000)  # (the API's bound; a run here has fewer records)
    rl = [m for m in run["metrics"] if "iteration/seconds" in m]
    seconds = rl[-1]["time"] - rl[0]["time"] + rl[0]["iteration/seconds"]
    # The update: the trainer's push (weights/seconds); a colocated iteration also counts the
    # engines' resume around it (phase/update_seconds).
    update = [m.get("phase/update_seconds", m.get("weights/seconds", 0.0)) for m in rl]
    split = {
        "generate": statistics.mean(m.get("phase/generate_seconds", 0.0) for m in rl),
        "train": statistics.mean(m.get("phase/train_seconds", 0.0) for m in rl),
        "update": statistics.mean(update),
    }
    s_per_gb = statistics.median(
        m["weights/seconds"] / (m["weights/bytes"] / 1e9) for m in rl if m.get("weights/bytes")
    )
    result = {
        "samples_per_second": sum(m.get("train/samples", 0.0) for m in rl) / seconds,
        "split_seconds": split,
        "update_seconds_per_gb": s_per_gb,
        "weights_bytes": rl[-1].get("weights/bytes", 0.0),
        "eval_before": run["eval_before"].get("eval/held_out/reward_mean"),
        "eval_after": run["eval_after"].get("eval/held_out/reward_mean"),
    }
    print(f"{layout:>12}: {json.dumps(result)}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=20, help="RL iterations per layout")
    parser.add_argument("--sft-steps", type=int, default=35, help="the warm start's steps (the demo's)")
    parser.add_argument(
        "--model-path",
        default="",
        help="a Hugging Face model directory to run instead of the tiny model (its update's s/GB means more; "
        "the demo's task will not learn on it)",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench.gpu needs a CUDA GPU: none is visible here (nothing measured)")
        return
    os.environ.update(RLMESH_ENGINE_DEVICE="cuda", RLMESH_TRAINER_DEVICE="cuda")  # (the services read them)
    data_dir = Path(tempfile.mkdtemp(prefix="rlmesh-bench-gpu-"))
    model = Path(args.model_path) if args.model_path else build_tiny_model(data_dir / "tiny-model")
    train, held_out = write_task(datasets_dir(data_dir))
    config = demo_config(str(model), train, held_out, args.sft_steps, args.rollouts).model_dump(mode="json")
    config["eval"] = {**config["eval"], "interval": 0}
    stack = start_stack(data_dir, str(model))
    try:
        with httpx.Client(base_url=stack.coordinator_url, timeout=60, headers=client_headers()) as api:
            results = {layout: run_layout(api, config, layout) for layout in LAYOUTS}
    finally:
        stack.stop()
    rows = []
    for layout, r in results.items():
        split = r["split_seconds"]
        total = sum(split.values()) or 1.0
        rows.append(
            {
                "layout": layout,
                "samples/s": f"{r['samples_per_second']:.1f}",
                "generate / train / update (s per iteration)": " / ".join(f"{split[k]:.3f}" for k in split),
                "split": " / ".join(f"{split[k] / total:.0%}" for k in split),
                "update s per GB": f"{r['update_seconds_per_gb']:.3f}",
                "eval before -> after": f"{r['eval_before']:.2f} -> {r['eval_after']:.2f}",
            }
        )
    print_table(rows, f"python -m bench.gpu: {torch.cuda.get_device_name()}, {args.rollouts} rollouts per layout")
    print(json.dumps({"device": torch.cuda.get_device_name(), **results}))


if __name__ == "__main__":
    main()
