"""Reward scoring throughput, each figure beside its baseline measured in the same run.

1. The math verifier through the reward service over gRPC (Score calls of BATCH
   samples, sequential) beside calling the verifier in-process: the service's overhead.
2. A remote HTTP reward service (examples/reward_service/app.py) scored through rlmesh,
   which batches samples per request and keeps CONCURRENCY requests in flight, beside
   calling the same service directly one sample per request (with the same number of
   requests in flight, and one at a time).

The reward service and the remote run as their own processes; samples carry realistic
arrays (tokens, log-probs), since they travel with the sample in both paths.

    python -m bench.reward

It ends with its summary as a markdown table (the form docs/benchmarks.md keeps), then
one line: a JSON object with the results.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import httpx

from bench.report import print_table
from rlmesh.common.auth import ensure_stack_token
from rlmesh.common.grpc_server import sync_channel
from rlmesh.common.net import free_port
from rlmesh.common.sample import Sample, Status, sample_to_json, sample_to_proto
from rlmesh.reward import verifiers
from rlmesh.v1 import reward_pb2, reward_pb2_grpc

BATCH = 64  # samples per Score call from the client
REMOTE_BATCH = 32  # samples per HTTP request rlmesh sends
CONCURRENCY = 4
SECONDS_PER_CASE = 3.0
EXAMPLE_APP = Path(__file__).resolve().parents[1] / "examples" / "reward_service" / "app.py"


def make_samples(n: int) -> list[Sample]:
    """Math answers in the forms a policy writes them: right and wrong, boxed and not,
    fractions, decimals, LaTeX; 128 prompt + 96 response tokens each."""
    forms = [
        (r"... so the answer is \boxed{\frac{1}{2}}.", "0.5"),
        (r"Thus \boxed{12}.", "12"),
        (r"We get \boxed{2\sqrt{2}}", r"\sqrt{8}"),
        ("The answer is 42.", "42"),
        (r"\boxed{\dfrac{3}{4}}", "0.7"),
        (r"Hence $x = 5$, i.e. \boxed{x = 5}", "5"),
        (r"\boxed{(1, 2)}", "(1,2)"),
        ("I am not sure.", "7"),
    ]
    samples = []
    for i in range(n):
        response, label = forms[i % len(forms)]
        samples.append(
            Sample(
                index=i,
                group_index=i // 8,
                prompt=f"Problem {i}: compute it.",
                tokens=list(range(224)),
                response=f"Step {i}. " + response,
                response_length=96,
                label=label,
                loss_mask=[1] * 96,
                rollout_log_probs=[-0.5] * 96,
                status=Status.COMPLETED,
                weight_versions=[1],
                metadata={"dataset": "math"},
            )
        )
    return samples


def per_second(run_batch: Callable[[], int]) -> float:
    """Samples per second of run_batch (which returns how many it scored), over SECONDS_PER_CASE."""
    run_batch()  # warm up (connections, imports, caches)
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < SECONDS_PER_CASE:
        done += run_batch()
    return done / (time.perf_counter() - started)


def wait_until(ready: Callable[[], bool], proc: subprocess.Popen, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start (exit code {proc.poll()})")
        time.sleep(0.1)


def start_reward_service(port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlmesh.cli",
            "serve",
            "reward",
            "--port",
            str(port),
            "--default-components",
            json.dumps({"math": 1.0}),
            "--log-level",
            "WARNING",
            "--remote-allowed-networks",
            json.dumps(["127.0.0.0/8"]),
        ]
    )  # the benchmark's remote is on loopback
    channel = sync_channel(f"127.0.0.1:{port}")

    def ready() -> bool:
        try:
            grpc.channel_ready_future(channel).result(timeout=0.5)
            return True
        except grpc.FutureTimeoutError:
            return False

    wait_until(ready, proc, "the reward service")
    return proc


def start_remote(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, str(EXAMPLE_APP), "--port", str(port)])

    def ready() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/stats", timeout=0.5).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(ready, proc, "the example reward service")
    return proc


def direct_per_second(url: str, payloads: list[bytes], in_flight: int) -> float:
    """The remote called directly, one sample per request, `in_flight` requests at a time."""

    async def measure() -> float:
        headers = {"content-type": "application/json"}
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=in_flight)) as client:

            async def one(body: bytes) -> None:
                reply = await client.post(url, content=body, headers=headers)
                reply.raise_for_status()

            async def worker(offset: int, stop_at: float, counts: list[int]) -> None:
                i = offset
                while time.perf_counter() < stop_at:
                    await one(payloads[i % len(payloads)])
                    counts[0] += 1
                    i += in_flight

            await asyncio.gather(*(one(p) for p in payloads[:in_flight]))  # warm up
            counts = [0]
            started = time.perf_counter()
            await asyncio.gather(*(worker(k, started + SECONDS_PER_CASE, counts) for k in range(in_flight)))
            return counts[0] / (time.perf_counter() - started)

    return asyncio.run(measure())


def main() -> dict[str, float]:
    ensure_stack_token()  # the reward service started here and its client share it
    samples = make_samples(512)
    results: dict[str, float] = {}

    # 1. the math verifier in-process, then through the service
    cursor = [0]

    def inprocess_batch() -> int:
        start = cursor[0] % len(samples)
        for s in samples[start : start + BATCH]:
            verifiers.math(s.response, s.label, s.metadata)
        cursor[0] += BATCH
        return len(samples[start : start + BATCH])

    results["inprocess_samples_per_s"] = per_second(inprocess_batch)

    reward_port, remote_port = free_port(), free_port()
    reward_proc = start_reward_service(reward_port)
    remote_proc = None
    try:
        stub = reward_pb2_grpc.RewardStub(sync_channel(f"127.0.0.1:{reward_port}"))
        math_requests = [
            reward_pb2.ScoreRequest(
                samples=[sample_to_proto(s) for s in samples[i : i + BATCH]],
                spec=reward_pb2.RewardSpec(components={"math": 1.0}),
            )
            for i in range(0, len(samples), BATCH)
        ]
        turn = [0]

        def service_batch() -> int:
            request = math_requests[turn[0] % len(math_requests)]
            turn[0] += 1
            return len(stub.Score(request, timeout=60).samples)

        results["service_samples_per_s"] = per_second(service_batch)

        # 2. a remote HTTP reward service: through rlmesh (batched), and directly per sample
        remote_proc = start_remote(remote_port)
        url = f"http://127.0.0.1:{remote_port}/score"
        stub.RegisterService(
            reward_pb2.RegisterServiceRequest(
                service=reward_pb2.RemoteService(
                    name="judge", url=url, timeout_seconds=30, max_concurrency=CONCURRENCY, max_batch_size=REMOTE_BATCH
                )
            )
        )
        judge_request = reward_pb2.ScoreRequest(
            samples=[sample_to_proto(s) for s in samples[: REMOTE_BATCH * CONCURRENCY * 2]],
            spec=reward_pb2.RewardSpec(components={"judge/exact": 1.0, "judge/similarity": 0.5}),
        )

        def via_rlmesh_batch() -> int:
            reply = stub.Score(judge_request, timeout=60)
            assert all(s.status != Status.FAILED for s in reply.samples), "the remote failed during the benchmark"
            return len(reply.samples)

        results["remote_via_rlmesh_samples_per_s"] = per_second(via_rlmesh_batch)
        payloads = [json.dumps({"samples": [sample_to_json(s)]}).encode() for s in samples]
        results["remote_direct_samples_per_s"] = direct_per_second(url, payloads, CONCURRENCY)
        results["remote_direct_sequential_samples_per_s"] = direct_per_second(url, payloads, 1)
        stats = stub.GetStats(reward_pb2.GetRewardStatsRequest(), timeout=10).services[0]
        assert stats.failures == 0, stats.last_error
    finally:
        for proc in (reward_proc, remote_proc):
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=30)

    results["service_overhead_ratio"] = results["inprocess_samples_per_s"] / results["service_samples_per_s"]
    results["remote_batching_speedup"] = (
        results["remote_via_rlmesh_samples_per_s"] / results["remote_direct_samples_per_s"]
    )

    print(f"Reward scoring throughput ({SECONDS_PER_CASE:g} s per case; the services run as separate processes)")
    print(f"{'path':<58}{'samples/s':>12}")
    rows = [
        ("math verifier, in-process (baseline)", "inprocess_samples_per_s"),
        (f"math verifier, reward service over gRPC ({BATCH}/call)", "service_samples_per_s"),
        (
            f"remote HTTP, through rlmesh ({REMOTE_BATCH}/request, {CONCURRENCY} in flight)",
            "remote_via_rlmesh_samples_per_s",
        ),
        (f"remote HTTP, direct, 1 sample/request, {CONCURRENCY} in flight (baseline)", "remote_direct_samples_per_s"),
        ("remote HTTP, direct, 1 sample/request, one at a time", "remote_direct_sequential_samples_per_s"),
    ]
    for label, key in rows:
        print(f"{label:<58}{results[key]:>12.0f}")
    print(
        f"service overhead: in-process is x{results['service_overhead_ratio']:.2f} the service's rate; "
        f"batching through rlmesh: x{results['remote_batching_speedup']:.2f} the direct per-sample rate"
    )
    print_table(
        [{"path": label, "samples/s": f"{results[key]:.0f}"} for label, key in rows]
        + [
            {"path": "in-process / service", "samples/s": f"{results['service_overhead_ratio']:.2f}x"},
            {"path": "remote: through rlmesh / direct", "samples/s": f"{results['remote_batching_speedup']:.2f}x"},
        ],
        f"python -m bench.reward: {SECONDS_PER_CASE:g} s per case",
    )
    print(json.dumps({k: round(v, 3) for k, v in results.items()}))
    return results


if __name__ == "__main__":
    main()
