"""What fsyncing every write costs the buffer: the full gRPC path (PutGroups -> LeaseBatch ->
AckBatch, as bench.buffer drives it) against two embedded Redis servers started side by side
in the same run, one with `appendfsync everysec` (the baseline) and one with `appendfsync
always` (each write reaches the disk before Redis answers), each with its own buffer process.
Beside them, raw redis-py (the same group bytes written and read back, no service) under
everysec, under always, and under everysec with `WAITAOF 1 0` after each call (what a buffer
would do to wait for the disk only after the writes that matter).

Rounds are interleaved (everysec, always, everysec, ...), so a shared machine's drift falls
on both alike; the figures are medians over rounds, the cost is the median of the per-round
ratios. The Redis data lives in --dir (default: a temporary directory), on whatever disk that
is: the figure is this disk's fsync, so run it where Redis will keep its data.

    python -m bench.durability

It ends with its summary as a markdown table (the form docs/benchmarks.md keeps), then one
line: a JSON object with the results.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import tempfile

from bench.buffer import (
    Options,
    create_run,
    grpc_round,
    raw_redis_round,
    settle,
    spawn_buffer,
    stop,
    templates,
    wait_grpc,
)
from bench.report import print_table
from rlmesh.cli.embedded_redis import EmbeddedRedisSettings, server_version, start_redis
from rlmesh.common.auth import ensure_stack_token
from rlmesh.common.net import free_port

FSYNC = ("everysec", "always")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=768, help="groups per measured round")
    parser.add_argument("--groups-per-call", type=int, default=32, help="groups per PutGroups / LeaseBatch")
    parser.add_argument("--writers", type=int, default=2, help="concurrent PutGroups callers")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds per configuration")
    parser.add_argument("--dir", default=None, help="where the Redis data lives (default: a temporary directory)")
    args = parser.parse_args(argv)
    opts = Options(args.groups, args.groups_per_call, args.writers, args.rounds, 0, 1)
    ensure_stack_token()

    work = tempfile.mkdtemp(prefix="rlmesh-bench-durability-", dir=args.dir)
    servers, procs, addresses = {}, [], {}
    try:
        for fsync in FSYNC:
            settings = EmbeddedRedisSettings(appendfsync=fsync, maxmemory="0")
            servers[fsync] = start_redis(os.path.join(work, f"redis-{fsync}"), settings=settings)
            port = free_port()
            procs.append(spawn_buffer(servers[fsync].url, port, work, f"buffer-{fsync}"))
            addresses[fsync] = f"127.0.0.1:{port}"
        for fsync, proc in zip(FSYNC, procs):
            wait_grpc(addresses[fsync], proc)
        dataset = os.path.join(work, "prompts.jsonl")
        with open(dataset, "w") as f:
            f.write(json.dumps({"prompt": "unused", "label": ""}) + "\n")
        groups = templates()
        raws = [g.SerializeToString() for g in groups]
        wait_aof = server_version(_binary(servers["everysec"])) >= (7, 2)

        for fsync in FSYNC:  # warm up (connections, scripts, allocator)
            asyncio.run(create_run(addresses[fsync], "warmup", dataset))
            asyncio.run(grpc_round(addresses[fsync], groups, Options(64, opts.groups_per_call, 2, 1, 0, 1), "warmup"))
            raw_redis_round(servers[fsync].url, raws, 64, opts.groups_per_call, "warmup")

        rates: dict[str, list[float]] = {}
        for r in range(opts.rounds):
            for fsync in FSYNC:
                asyncio.run(create_run(addresses[fsync], f"b{r}", dataset))
                settle()
                rates.setdefault(f"grpc {fsync}", []).append(
                    asyncio.run(grpc_round(addresses[fsync], groups, opts, f"b{r}"))
                )
            for fsync in FSYNC:
                settle()
                rates.setdefault(f"raw {fsync}", []).append(
                    raw_redis_round(servers[fsync].url, raws, opts.groups, opts.groups_per_call, f"r{r}")
                )
            if wait_aof:
                settle()
                rates.setdefault("raw everysec + WAITAOF", []).append(
                    raw_redis_round(servers["everysec"].url, raws, opts.groups, opts.groups_per_call, f"w{r}", True)
                )

        def cost(path: str, baseline: str) -> float:
            """How much slower `path` is than `baseline`: 1 - the median per-round ratio."""
            return 1 - statistics.median(a / b for a, b in zip(rates[path], rates[baseline]))

        print(
            f"{opts.groups} groups per round ({opts.groups_per_call} per call, {opts.writers} writers), "
            f"median of {opts.rounds} rounds; Redis data on {work}; {os.cpu_count()} CPUs, shared"
        )
        rows = []
        for path, xs in rates.items():
            baseline = "grpc everysec" if path.startswith("grpc") else "raw everysec"
            rows.append(
                {
                    "path": path,
                    "groups/s": f"{statistics.median(xs):.0f}",
                    "slower than everysec": "(baseline)" if path == baseline else f"{cost(path, baseline):.0%}",
                    "rounds": " ".join(f"{x:.0f}" for x in xs),
                }
            )
        print_table(rows, title="python -m bench.durability")
        result = {
            re.sub(r"\W+", "_", path) + "_groups_per_s": round(statistics.median(xs), 1) for path, xs in rates.items()
        }
        result["grpc_always_cost"] = round(cost("grpc always", "grpc everysec"), 3)
        if wait_aof:
            result["raw_waitaof_cost"] = round(cost("raw everysec + WAITAOF", "raw everysec"), 3)
        print(json.dumps(result))
    finally:
        for proc in procs:
            stop(proc)
        for server in servers.values():
            server.stop()
        shutil.rmtree(work, ignore_errors=True)


def _binary(server) -> str:
    return server.process.args[0]


if __name__ == "__main__":
    main()
