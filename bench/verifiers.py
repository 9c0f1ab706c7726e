"""Built-in verifier throughput: worker processes with a time budget (the reward
service's path) beside the in-thread call it replaced, measured in the same run.

Ordinary math samples (bench.reward.make_samples: right and wrong, boxed and not,
fractions, LaTeX) are scored by the Scorer, CONCURRENCY requests of BATCH samples at a
time, as the service does for concurrent Score calls:

1. in-thread (baseline): no pool; each request's verifiers run in one thread, as before.
2. worker pool: the verifiers run in VerifierPool's processes (min(4, CPUs) workers, the
   service's default), each call under a deadline; also with one worker.

The cases take turns for three rounds and each keeps its best rate, so a busy moment of
a shared machine does not land on one case alone. Then one adversarial sample of each kind through the pool: the seconds it takes.

    python -m bench.verifiers

It ends with its summary as a markdown table (the form docs/benchmarks.md keeps), then
one line: a JSON object with the results.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import replace

from bench.report import print_table
from bench.reward import make_samples
from rlmesh.common.sample import Sample
from rlmesh.reward.scoring import RewardSpec, Scorer
from rlmesh.reward.workers import VerifierPool

BATCH = 64
CONCURRENCY = 4
SECONDS_PER_CASE = 3.0
ROUNDS = 3  # the best of three per case
SPEC = RewardSpec({"math": 1.0})
ADVERSARIAL = {
    "50,000 unclosed \\boxed{": ("\\boxed{" * 50_000, "1"),
    "\\boxed{} nested 40,000 deep": ("\\boxed{" + "{" * 40_000 + "7" + "}" * 40_000 + "}", "7"),
    "\\text{} nested 12,000 deep": ("\\boxed{" + "\\text{" * 12_000 + "7" + "}" * 12_001, "7"),
    "5. and 90,000 zeros": (r"\boxed{5." + "0" * 90_000 + "}", "5"),
}


async def per_second(scorer: Scorer, samples: list[Sample]) -> float:
    """Samples per second scored, CONCURRENCY requests of BATCH samples in flight."""
    batches = [samples[i : i + BATCH] for i in range(0, len(samples), BATCH)]
    await scorer.score_samples(batches[0], SPEC)  # warm up (workers, sympy's caches)
    done, turn, started = 0, 0, time.perf_counter()
    while time.perf_counter() - started < SECONDS_PER_CASE:
        round_ = [batches[(turn + k) % len(batches)] for k in range(CONCURRENCY)]
        turn += CONCURRENCY
        await asyncio.gather(*(scorer.score_samples(b, SPEC) for b in round_))
        done += sum(len(b) for b in round_)
    return done / (time.perf_counter() - started)


async def measure() -> dict[str, float]:
    samples = make_samples(512)
    workers = min(4, os.cpu_count() or 1)
    results = {"workers": float(workers), "cpus": float(os.cpu_count() or 1)}
    pools = {
        "pool_samples_per_s": VerifierPool(workers, timeout_seconds=5.0, overload_seconds=2.0),
        "pool_1_worker_samples_per_s": VerifierPool(1, timeout_seconds=5.0, overload_seconds=2.0),
    }
    scorers = {
        "in_thread_samples_per_s": Scorer.from_config({"math": 1.0}),
        **{key: Scorer.from_config({"math": 1.0}, verifier_pool=pool) for key, pool in pools.items()},
    }
    try:
        for _ in range(ROUNDS):
            for key, scorer in scorers.items():
                results[key] = max(results.get(key, 0.0), await per_second(scorer, samples))
        scorer = scorers["pool_samples_per_s"]
        for name, (response, label) in ADVERSARIAL.items():
            sample = replace(samples[0], response=response, label=label)
            started = time.perf_counter()
            await scorer.score_samples([sample], SPEC)
            results[f"adversarial: {name} (s)"] = time.perf_counter() - started
    finally:
        for pool in pools.values():
            pool.close()
    return results


def main() -> dict[str, float]:
    results = asyncio.run(measure())
    ratio = results["pool_samples_per_s"] / results["in_thread_samples_per_s"]
    print(
        f"Math verifier throughput (best of {ROUNDS} x {SECONDS_PER_CASE:g} s per case, {CONCURRENCY} requests of "
        f"{BATCH} samples in flight, {results['cpus']:.0f} CPUs)"
    )
    print(f"{'path':<52}{'samples/s':>12}")
    print(f"{'in-thread call (baseline, no time budget)':<52}{results['in_thread_samples_per_s']:>12.0f}")
    pool_row = f"worker pool, {results['workers']:.0f} workers (the service default)"
    print(f"{pool_row:<52}{results['pool_samples_per_s']:>12.0f}")
    print(f"{'worker pool, 1 worker':<52}{results['pool_1_worker_samples_per_s']:>12.0f}")
    print(f"worker pool: x{ratio:.2f} the in-thread rate")
    for key, seconds in results.items():
        if key.startswith("adversarial"):
            print(f"{key.removeprefix('adversarial: ').removesuffix(' (s)'):<52}{seconds:>11.3f}s")
    print_table(
        [
            {
                "path": "in-thread call (baseline, no time budget)",
                "samples/s": f"{results['in_thread_samples_per_s']:.0f}",
            },
            {"path": pool_row, "samples/s": f"{results['pool_samples_per_s']:.0f}"},
            {"path": "worker pool, 1 worker", "samples/s": f"{results['pool_1_worker_samples_per_s']:.0f}"},
            {"path": "worker pool / in-thread", "samples/s": f"{ratio:.2f}x"},
            *(
                {
                    "path": f"adversarial: {key.removeprefix('adversarial: ').removesuffix(' (s)')}",
                    "samples/s": f"{seconds:.3f} s",
                }
                for key, seconds in results.items()
                if key.startswith("adversarial")
            ),
        ],
        f"python -m bench.verifiers: best of {ROUNDS} x {SECONDS_PER_CASE:g} s per case, {results['cpus']:.0f} CPUs",
    )
    print(json.dumps({k: round(v, 3) for k, v in results.items()}))
    return results


if __name__ == "__main__":
    main()
