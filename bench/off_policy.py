"""Off-policy corrections compared: the demo's task (as `bench.async` runs it) in
`fully_async` at a staleness bound (or in `one_step_off`), once per correction and seed, one run after the other
on one `rlmesh up` stack, with `sync` (no correction: on-policy) as the baseline measured
in the same invocation.

Per correction: each seed's final held-out eval (greedy), their mean, the gap to sync's
mean, the number of collapsed seeds (final eval below half of sync's mean), and the mean of
the run's smallest ESS and largest trainer/engine log-prob gap.

    python -m bench.off_policy [--seeds 5] [--rollouts 80] [--max-staleness 2] [--mode one_step_off] [--only tis,m2po]

It ends with the table as markdown (the form docs/training-modes.md keeps), then one line:
a JSON object with the results.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

from bench.report import print_table
from rlmesh.cli.demo import demo_config, write_task
from rlmesh.cli.launcher import datasets_dir, start_stack
from rlmesh.cli.tiny_model import build_tiny_model
from rlmesh.common.auth import client_headers

bench_async = importlib.import_module("bench.async")  # ('async' is a keyword)

# name -> the run's off_policy section (None: none at all, as sync has)
CANDIDATES: dict[str, dict | None] = {
    "none": {"method": "none"},
    "tis (token, cap 2)": {"method": "tis"},
    "mis (token, (0, 2])": {"method": "mis"},
    "mis (sequence, (0, 2])": {"method": "mis", "level": "sequence"},
    "decoupled (AReaL, cap 5)": {"method": "decoupled"},
    "icepop (band [0.5, 2])": {"method": "icepop"},
    "m2po (M2 <= 0.04)": {"method": "m2po"},
    "asymmetric (cap 2, A<0 cap 1)": {"method": "asymmetric"},
    "vcpo (tis + sqrt(ESS) step)": {"method": "tis", "ess_step_scaling": True},
    "vcpo + baseline (tis, sqrt(ESS) step, w^2-weighted group mean)": {
        "method": "tis",
        "ess_step_scaling": True,
        "optimal_baseline": True,
    },
    "vcpo as its code (sequence tis cap 8, sqrt(ESS) step, baseline)": {
        "method": "tis",
        "level": "sequence",
        "upper": 8.0,
        "ess_step_scaling": True,
        "optimal_baseline": True,
    },
}


def run_one(api: httpx.Client, config: dict, mode: str, off_policy: dict | None) -> dict:
    body = {**config, **({"off_policy": off_policy} if off_policy is not None else {})}
    result = bench_async.run_mode(api, body, mode)
    run = api.get(f"/runs/{result['run_id']}", params={"metrics_last": 10_000}).json()
    rl = [m for m in run["metrics"] if "iteration/seconds" in m]
    result["ess_min"] = min((m.get("train/is_ess", 1.0) for m in rl), default=1.0)
    result["gap_max"] = max((m.get("train/train_rollout_logprob_abs_diff", 0.0) for m in rl), default=0.0)
    print(f"{mode} {off_policy}: seed {config['seed']} eval after {result['eval_after']:.2f}", file=sys.stderr)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=80, help="RL iterations per run")
    parser.add_argument("--seeds", type=int, default=5, help="runs per correction (seeds 0..N-1)")
    parser.add_argument("--sft-steps", type=int, default=60, help="SFT warm-start steps per run")
    parser.add_argument(
        "--sft-batch-groups",
        type=int,
        default=32,
        help="prompts per SFT step (the demo's 32; fewer: a cheaper warm start)",
    )
    parser.add_argument("--max-staleness", type=int, default=2, help="fully_async's staleness bound")
    parser.add_argument("--mode", default="fully_async", choices=("fully_async", "one_step_off"))
    parser.add_argument("--only", default="", help="comma-separated prefixes of the candidates to run")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    names = [n for n in CANDIDATES if not args.only or any(n.startswith(p) for p in args.only.split(","))]

    with tempfile.TemporaryDirectory(prefix="rlmesh-bench-off-policy-") as tmp:
        data_dir = Path(tmp)
        model = build_tiny_model(data_dir / "tiny-model")
        train, held_out = write_task(datasets_dir(data_dir) / "demo")
        config = demo_config(str(model), train, held_out, args.sft_steps, args.rollouts).model_dump(mode="json")
        config["eval"]["interval"] = 0
        config["sft_warmup"]["batch_groups"] = args.sft_batch_groups
        config["pause_mode"] = "in_place"
        config["rollout"]["partial_rollout"] = True
        config["max_staleness"] = args.max_staleness if args.mode == "fully_async" else None
        stack = start_stack(data_dir, str(model))
        runs: dict[str, list[dict]] = {"sync (baseline)": [], **{n: [] for n in names}}
        try:
            with httpx.Client(base_url=stack.coordinator_url, timeout=60, headers=client_headers()) as api:
                for seed in range(args.seeds):  # interleaved: a change of the machine's load hits every candidate
                    seeded = {**config, "seed": seed, "datasets": [{**d, "seed": seed} for d in config["datasets"]]}
                    runs["sync (baseline)"].append(run_one(api, {**seeded, "max_staleness": None}, "sync", None))
                    for name in names:
                        runs[name].append(run_one(api, seeded, args.mode, CANDIDATES[name]))
        finally:
            stack.stop()

    sync_mean = statistics.fmean(r["eval_after"] for r in runs["sync (baseline)"])
    rows, results = [], {}
    for name, rs in runs.items():
        evals = [r["eval_after"] for r in rs]
        mean = statistics.fmean(evals)
        collapsed = sum(e < sync_mean / 2 for e in evals)
        results[name] = {
            "evals": [round(e, 3) for e in evals],
            "mean": round(mean, 3),
            "gap": round(mean - sync_mean, 3),
            "collapsed": collapsed,
            "ess_min": round(statistics.fmean(r["ess_min"] for r in rs), 3),
            "gap_max": round(statistics.fmean(r["gap_max"] for r in rs), 3),
        }
        rows.append(
            {
                "correction": name,
                "held-out eval after, per seed": ", ".join(f"{e:.2f}" for e in evals),
                "mean": f"{mean:.2f}",
                "gap to sync": f"{mean - sync_mean:+.2f}",
                "collapsed": f"{collapsed}/{len(evals)}",
                "min ESS (mean)": f"{results[name]['ess_min']:.2f}",
                "max log-prob gap (mean)": f"{results[name]['gap_max']:.2f}",
            }
        )
    print_table(
        rows,
        f"python -m bench.off_policy: {args.mode}, max_staleness {config['max_staleness'] or 1}, {args.seeds} seeds x "
        f"{args.rollouts} rollouts, {args.sft_steps} SFT steps of {args.sft_batch_groups} prompts, "
        f"lr {config['optimizer']['lr']:g}, {os.cpu_count()} CPUs",
    )
    print(
        json.dumps(
            {
                "mode": args.mode,
                "max_staleness": config["max_staleness"] or 1,
                "rollouts": args.rollouts,
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()
