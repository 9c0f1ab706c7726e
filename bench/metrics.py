"""What Prometheus metrics cost a gRPC call: unary calls per second to a server with the
metrics interceptor (every call counted and timed, as every rlmesh service does) beside the
same server without it, measured in alternating rounds in the same run; and how long a
scrape of such a server's /metrics takes.

The call is the standard health Check (the cheapest unary call every service has), so the
interceptor's share is as large as it can be; real calls (a lease, a train step) take longer.

    python -m bench.metrics

It ends with its summary as a markdown table (the form docs/benchmarks.md keeps), then
one line: a JSON object with the results.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import threading
import time

import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.report import print_table
from rlmesh.common.auth import client_headers, ensure_stack_token
from rlmesh.common.grpc_server import start_server, sync_channel
from rlmesh.common.net import free_port
from rlmesh.common.prometheus import ServiceMetrics, start_metrics_server

ROUNDS = 10
SECONDS_PER_ROUND = 1.0
SCRAPES = 50


def calls_per_second(stub) -> float:
    request = health_pb2.HealthCheckRequest()
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < SECONDS_PER_ROUND:
        stub.Check(request, timeout=10)
        done += 1
    return done / (time.perf_counter() - started)


def main() -> None:
    ensure_stack_token()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    run = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(60)  # noqa: E731

    metrics = ServiceMetrics()
    metrics_port = free_port()
    with_metrics, port_a, _ = run(start_server([], "127.0.0.1:0", metrics=metrics))
    without, port_b, _ = run(start_server([], "127.0.0.1:0"))
    scrape_server = run(start_metrics_server(metrics, "127.0.0.1", metrics_port))
    channels = {
        "with_metrics": sync_channel(f"127.0.0.1:{port_a}"),
        "without_metrics": sync_channel(f"127.0.0.1:{port_b}"),
    }
    stubs = {name: health_pb2_grpc.HealthStub(channel) for name, channel in channels.items()}
    for stub in stubs.values():
        for _ in range(200):  # warm up
            stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
    rates: dict[str, list[float]] = {name: [] for name in stubs}
    for _ in range(ROUNDS):
        for name, stub in stubs.items():
            rates[name].append(calls_per_second(stub))
    # Rounds alternate, so a machine busy with other work slows both alike; the median of each.
    best = {name: statistics.median(r) for name, r in rates.items()}

    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with httpx.Client(headers=client_headers()) as client:
        client.get(url).raise_for_status()
        started = time.perf_counter()
        for _ in range(SCRAPES):
            client.get(url).raise_for_status()
        scrape_ms = (time.perf_counter() - started) / SCRAPES * 1000

    per_call_us = (1 / best["with_metrics"] - 1 / best["without_metrics"]) * 1e6
    print(
        f"health Check, calls/s: with metrics {best['with_metrics']:.0f}, "
        f"without (baseline) {best['without_metrics']:.0f}; ratio {best['with_metrics'] / best['without_metrics']:.3f}; "
        f"~{per_call_us:.1f} us per call"
    )
    print(f"scrape of /metrics: {scrape_ms:.2f} ms")
    print_table(
        [
            {
                "health Check calls/s, with metrics": f"{best['with_metrics']:.0f}",
                "without (baseline)": f"{best['without_metrics']:.0f}",
                "ratio": f"{best['with_metrics'] / best['without_metrics']:.3f}",
                "us per call": f"{per_call_us:.1f}",
                "scrape of /metrics ms": f"{scrape_ms:.2f}",
            }
        ],
        "python -m bench.metrics",
    )
    for channel in channels.values():
        channel.close()
    scrape_server.close()
    run(with_metrics.stop(None))
    run(without.stop(None))
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)
    print(
        json.dumps(
            {
                "bench": "metrics",
                "calls_per_second_with_metrics": round(best["with_metrics"]),
                "calls_per_second_without_metrics_baseline": round(best["without_metrics"]),
                "ratio": round(best["with_metrics"] / best["without_metrics"], 3),
                "overhead_us_per_call": round(per_call_us, 1),
                "scrape_ms": round(scrape_ms, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
