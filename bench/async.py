"""Training modes compared: the same short run (the demo's task, `rlmesh demo`'s settings,
fewer rollouts) in `sync`, `one_step_off` and `fully_async`, one after the other on one
`rlmesh up` stack on this machine.

The 2 cores are split as deployed on one machine: the engine and the trainer each get one
torch thread (OMP_NUM_THREADS=1, the engine's --num-threads 1), so generation and training
can overlap only as far as two cores allow; buffer, reward, rollout and coordinator are
light Python processes beside them.

Every mode runs with the run config's defaults (in one_step_off and fully_async that
includes their default off-policy correction; `--tis-cap` adds the older rollout_is_upper
correction instead). Figures, per mode: RL samples trained per second of RL wall time (SFT
warm start and evaluations excluded), each seed's final held-out eval reward (greedy),
their mean, the gap to sync's mean, and the number of collapsed seeds (final eval below half
of sync's mean). One 80-rollout run's final eval swings by 0.1 from seed to seed, so each
mode runs with several seeds (the trainer's random state and the data order), the modes
interleaved seed by seed. The baseline is the sync run, measured in the same invocation:
`ideal_speedup` = sync's RL time over what a perfect overlap of generation and training
would leave of it (`ideal_speedup()`), from the sync runs' own wall time and phase times:
it saves at most the shorter of the two; the weight pushes (which pause generation in every
mode; with `--background-push` beside the next train step) and the bookkeeping between
phases stay. Until 2026-11-29 it was (generation + training) / max(generation, training),
which counted the pushes as if they could be hidden too (still in the JSON line as
`ideal_speedup_before_2026_11_29`). `fully_async_fraction_of_ideal` = (fully_async
samples/s / sync samples/s) / ideal_speedup.

    python -m bench.async [--rollouts 80] [--seeds 5] [--preamble 96] [--modes sync,fully_async]

`--preamble N` puts an N-character instruction before every prompt (the same for all, as a
system prompt or few-shot examples are): the engine computes it once and shares it (its prefix
cache), while the trainer's forward and backward passes cover it in every sample, so training
becomes a real share of a step, as it is where engines run on GPUs.

It ends with its summary as markdown tables (the form docs/benchmarks.md keeps), then one
line: a JSON object with the results.
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

from bench.report import print_table
from rlmesh.cli.client import follow
from rlmesh.cli.demo import demo_config, run_metrics, write_task
from rlmesh.cli.launcher import datasets_dir, start_stack
from rlmesh.cli.tiny_model import build_tiny_model
from rlmesh.common.auth import client_headers
from rlmesh.common.off_policy import ASYNC_DEFAULT
from rlmesh.common.run_config import DEFAULT_MAX_STALENESS

MODES = ("sync", "one_step_off", "fully_async")
PREAMBLE = "Reverse the three letters after rev; answer with them alone. "


def add_preamble(path: Path, chars: int) -> None:
    """Every prompt of the dataset at `path` begins with the same `chars`-character instruction."""
    preamble = (PREAMBLE * (chars // len(PREAMBLE) + 1))[:chars]
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({**r, "prompt": preamble + r["prompt"]}) + "\n" for r in rows))


def run_mode(api: httpx.Client, config: dict, mode: str) -> dict:
    r = api.post("/runs", json={**config, "mode": mode, "name": f"bench.async {mode} seed {config['seed']}"})
    r.raise_for_status()
    run_id = r.json()["id"]
    run = follow(api, run_id, time.monotonic(), echo=lambda _line: None)  # (until it ends)
    if run["status"] != "completed":
        raise SystemExit(f"{mode} run {run['status']}: {run['error']}")
    rl = [m for m in run_metrics(api, run_id) if "iteration/seconds" in m]
    result = {
        "run_id": run_id,
        "samples": sum(m.get("train/samples", 0.0) for m in rl),
        "seconds": rl[-1]["time"] - rl[0]["time"] + rl[0]["iteration/seconds"],  # first RL start to last RL end
        "generate_seconds": sum(m.get("phase/generate_seconds", 0.0) for m in rl),
        "train_seconds": sum(m.get("phase/train_seconds", 0.0) for m in rl),
        "push_seconds": sum(m.get("split/update_seconds", 0.0) for m in rl),
        "eval_after": run["eval_after"].get("eval/held_out/reward_mean"),
        "staleness_max": max((m.get("train/staleness_max", 0.0) for m in rl), default=0.0),
        "stale_groups_dropped": sum(m.get("train/stale_groups_dropped", 0.0) for m in rl),
    }
    print(
        f"{mode:>13} seed {config['seed']}: {result['samples'] / result['seconds']:7.1f} samples/s "
        f"({result['samples']:.0f} samples in {result['seconds']:.1f} s), eval after {result['eval_after']:.2f}, "
        f"staleness max {result['staleness_max']:.0f}, {result['stale_groups_dropped']:.0f} stale groups dropped",
        flush=True,
    )
    return result


def summarize(runs: list[dict]) -> dict:
    """One mode over its seeds: throughput over all its runs, the evals' mean."""
    samples, seconds = sum(r["samples"] for r in runs), sum(r["seconds"] for r in runs)
    evals = [r["eval_after"] for r in runs]
    return {
        "samples_per_s": samples / seconds,
        "eval_after": statistics.fmean(evals),
        "evals": evals,
        "seconds": seconds,
        "generate_seconds": sum(r["generate_seconds"] for r in runs),
        "train_seconds": sum(r["train_seconds"] for r in runs),
        "push_seconds": sum(r["push_seconds"] for r in runs),
        "staleness_max": max(r["staleness_max"] for r in runs),
        "stale_groups_dropped": sum(r["stale_groups_dropped"] for r in runs),
    }


def ideal_speedup(
    sync_seconds: float, generate: float, train: float, push: float, push_beside_training: bool = False
) -> float:
    """What a perfect overlap of generation and training would make of sync's RL time (its
    phases' seconds given). Each push pauses generation; it follows the train step, or
    (push_beside_training, weight_sync.background) runs beside the next one. The time
    between phases stays as it is."""
    overlapped = max(generate + push, train) if push_beside_training else max(generate, train) + push
    return sync_seconds / (sync_seconds - (generate + train + push) + overlapped)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=80, help="RL iterations per run")
    parser.add_argument("--seeds", type=int, default=5, help="runs per mode (seeds 0..N-1)")
    # (the demo's 35 steps leave some seeds' models near 0 held-out reward: runs that start
    # there swing from 0 to 1 and drown the modes' difference in seed noise)
    parser.add_argument("--sft-steps", type=int, default=60, help="SFT warm-start steps per run")
    parser.add_argument("--lr", type=float, default=0.0, help="RL learning rate (0 = the demo's)")
    parser.add_argument(
        "--pause-mode",
        default="",
        choices=("", "abort", "in_place", "retract"),
        help="fully_async: how the engines pause for a weight push (default: the run config's)",
    )
    parser.add_argument(
        "--partial-rollout",
        action="store_true",
        help="what a pause aborts resumes from its partial response in every mode (default: the run config's)",
    )
    parser.add_argument(
        "--no-within-queue-cap",
        dest="within_queue_cap",
        action="store_false",
        help="fully_async: generation keeps rollout_batch_size groups in flight whatever the queue holds "
        "(rollout.within_queue_cap false; default: the run config's, on)",
    )
    parser.add_argument(
        "--max-groups-ahead",
        type=int,
        default=0,
        help="fully_async: at most this many groups queued or being generated (rollout.max_groups_ahead; "
        "0 = the run config's default)",
    )
    parser.add_argument(
        "--background-push",
        action="store_true",
        help="fully_async: the trainer pushes its weights beside the next train step (weight_sync.background)",
    )
    parser.add_argument(
        "--max-staleness",
        type=int,
        default=0,
        help="fully_async's staleness bound in weight versions (0 = the run config's default)",
    )
    parser.add_argument(
        "--tis-cap",
        type=float,
        default=0.0,
        help="the older rollout_is_upper correction in every mode, instead of the modes' default "
        "off_policy correction (0 = the run config's defaults)",
    )
    parser.add_argument(
        "--preamble", type=int, default=0, help="characters of a shared instruction before every prompt (0: none)"
    )
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated; sync is always run (the baseline)")
    args = parser.parse_args()
    modes = ["sync", *(m for m in MODES if m != "sync" and m in args.modes.split(","))]
    os.environ["OMP_NUM_THREADS"] = "1"  # one thread per torch process (engine, trainer)

    with tempfile.TemporaryDirectory(prefix="rlmesh-bench-async-") as tmp:
        data_dir = Path(tmp)
        model = build_tiny_model(data_dir / "tiny-model")
        train, held_out = write_task(datasets_dir(data_dir) / "demo")
        for path in (train, held_out) if args.preamble else ():
            add_preamble(path, args.preamble)
        config = demo_config(str(model), train, held_out, args.sft_steps, args.rollouts).model_dump(mode="json")
        config["eval"]["interval"] = 0
        if args.lr:
            config["optimizer"]["lr"] = args.lr
        config["pause_mode"] = args.pause_mode or config["pause_mode"]
        if args.partial_rollout:
            config["rollout"]["partial_rollout"] = True
        if not args.within_queue_cap:
            config["rollout"]["within_queue_cap"] = False
        if args.tis_cap:  # corrects for samples of older weights (async modes); ~1 on-policy
            config["algorithm"]["rollout_is_upper"] = args.tis_cap
        print("starting rlmesh (embedded Redis, CPU reference engine, tiny model):", flush=True)
        stack = start_stack(data_dir, str(model))
        try:
            with httpx.Client(base_url=stack.coordinator_url, timeout=60, headers=client_headers()) as api:
                runs: dict[str, list[dict]] = {mode: [] for mode in modes}
                for seed in range(args.seeds):  # interleaved: a change of the machine's load hits every mode
                    seeded = {**config, "seed": seed, "datasets": [{**d, "seed": seed} for d in config["datasets"]]}
                    for mode in modes:
                        own = {}  # (fully_async's own settings)
                        if mode == "fully_async" and args.max_staleness:
                            own["max_staleness"] = args.max_staleness
                        if mode == "fully_async" and args.max_groups_ahead:
                            own["rollout"] = {**config["rollout"], "max_groups_ahead": args.max_groups_ahead}
                        if mode == "fully_async" and args.background_push:
                            own["weight_sync"] = {**config["weight_sync"], "background": True}
                        runs[mode].append(run_mode(api, {**seeded, **own}, mode))
                        print(f"{mode} seed {seed}: eval after {runs[mode][-1]['eval_after']:.2f}", file=sys.stderr)
        finally:
            stack.stop()
    results = {mode: summarize(r) for mode, r in runs.items()}
    for mode, r in results.items():
        print(
            f"{mode:>13}: {r['samples_per_s']:7.1f} samples/s, eval after {r['eval_after']:.2f} "
            f"(mean of {', '.join(f'{e:.2f}' for e in r['evals'])})"
        )

    sync = results["sync"]
    for r in results.values():  # (a collapsed seed ends below half of sync's mean)
        r["gap"] = r["eval_after"] - sync["eval_after"]
        r["collapsed"] = sum(e < sync["eval_after"] / 2 for e in r["evals"])
    g, t, u = sync["generate_seconds"], sync["train_seconds"], sync["push_seconds"]
    ideal = ideal_speedup(sync["seconds"], g, t, u, push_beside_training=args.background_push)
    speedups = {mode: r["samples_per_s"] / sync["samples_per_s"] for mode, r in results.items() if mode != "sync"}
    speedup = speedups.get("fully_async", float("nan"))
    print(
        f"sync: {sync['seconds']:.1f} s of RL, generation {g:.1f} s, training {t:.1f} s, pushes {u:.1f} s "
        f"-> ideal speedup {ideal:.2f}; "
        f"fully_async achieved {speedup:.2f} ({speedup / ideal:.0%} of ideal)"
    )
    samples_per_rollout = config["rollout"]["rollout_batch_size"] * config["rollout"]["n_samples_per_prompt"]
    title = (
        f"python -m bench.async: {args.seeds} seeds x {args.rollouts} rollouts x {samples_per_rollout} samples, "
        f"lr {config['optimizer']['lr']:g}, pause_mode {config['pause_mode']}"
        f"{', partial rollouts in every mode' if args.partial_rollout else ''}"
        f"{'' if args.within_queue_cap else ', generation not within the queue cap'}"
        f"{f', fully_async at most {args.max_groups_ahead} groups ahead' if args.max_groups_ahead else ''}"
        f"{', fully_async pushing in the background' if args.background_push else ''}, preamble {args.preamble} chars, "
        f"{os.cpu_count()} CPUs"
    )
    seeds = ", ".join(str(seed) for seed in range(args.seeds))
    print_table(
        [
            {
                "mode": f"`{mode}`",
                "samples/s": f"{r['samples_per_s']:.1f}",
                f"held-out eval after (seeds {seeds})": f"{r['eval_after']:.2f} ({', '.join(f'{e:.2f}' for e in r['evals'])})",
                "gap to sync": f"{r['gap']:+.2f}",
                "collapsed seeds": f"{r['collapsed']}/{len(r['evals'])}",
            }
            for mode, r in results.items()
        ],
        title,
    )
    print_table(
        [
            {
                "sync RL s": f"{sync['seconds']:.1f}",
                "sync generation s": f"{g:.1f}",
                "sync training s": f"{t:.1f}",
                "sync pushes s": f"{u:.1f}",
                "ideal speedup": f"{ideal:.2f}",
                "fully_async speedup": f"{speedup:.2f}",
                "of the ideal": f"{speedup / ideal:.0%}",
            }
        ]
    )
    print(
        json.dumps(
            {
                **{f"{mode}_samples_per_s": round(r["samples_per_s"], 2) for mode, r in results.items()},
                "sync_seconds": round(sync["seconds"], 2),
                "sync_generate_seconds": round(g, 2),
                "sync_train_seconds": round(t, 2),
                "sync_push_seconds": round(u, 2),
                "ideal_speedup_before_2026_11_29": round((g + t) / max(g, t), 3),  # (the older form)
                "ideal_speedup": round(ideal, 3),
                **{f"{mode}_speedup": round(x, 3) for mode, x in speedups.items()},
                "fully_async_fraction_of_ideal": round(speedup / ideal, 3),
                **{f"{mode}_eval_after": round(r["eval_after"], 3) for mode, r in results.items()},
                **{
                    f"{mode}_evals": [round(e, 3) for e in r["evals"]] for mode, r in results.items()
                },  # (the seed noise)
                **{f"{mode}_eval_gap": round(r["gap"], 3) for mode, r in results.items() if mode != "sync"},
                **{f"{mode}_collapsed_seeds": r["collapsed"] for mode, r in results.items()},
                **{f"{mode}_staleness_max": r["staleness_max"] for mode, r in results.items()},
                "pause_mode": config["pause_mode"],
                "partial_rollout": "every mode" if args.partial_rollout else "the modes' defaults",
                "within_queue_cap": args.within_queue_cap,
                "fully_async_max_groups_ahead": args.max_groups_ahead or None,
                "tis_cap": args.tis_cap,
                "async_off_policy": None if args.tis_cap else ASYNC_DEFAULT.model_dump(),
                "lr": config["optimizer"]["lr"],
                "fully_async_max_staleness": args.max_staleness or DEFAULT_MAX_STALENESS["fully_async"],
                "sft_steps": args.sft_steps,
                "rollouts": args.rollouts,
                "seeds": args.seeds,
                "samples_per_rollout": samples_per_rollout,
                "preamble_chars": args.preamble,
            }
        )
    )


if __name__ == "__main__":
    main()
