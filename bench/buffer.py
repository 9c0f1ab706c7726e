"""Buffer throughput: the full gRPC path (PutGroups -> LeaseBatch -> AckBatch) against
two baselines measured in the same run on the same Redis:

- raw Redis: the same group bytes written and read back with redis-py directly
  (pipelined HSET + RPUSH, then LPOP + HMGET + HDEL), no service in between;
- a JSON-over-HTTP trajectory API, as people commonly build them: a FastAPI/uvicorn
  endpoint taking JSON lists for tokens / log-probs / loss masks (pydantic-validated)
  and storing them in the same Redis, a client posting JSON (one group of 8 sequences
  per request, 4 in flight). Only its write side is measured, which flatters it: the
  gRPC figure is the whole trip, write -> lease -> ack.

Payload: realistic groups, 8 samples x 1024 tokens (512 prompt + 512 response), int32
tokens, float32 log-probs, uint8 loss masks as raw little-endian bytes fields
(bench.wire.realistic_group), about 59 kB a group on the wire. Redis runs as embedded by
default (append-only file, appendfsync always: what fsyncing costs is bench.durability's
figure); each round starts after the previous round's background work settled. Everything runs on this machine: Redis, the buffer service and the
JSON server as their own processes, the clients here. Each path is measured a few times,
interleaved. The figures are medians over rounds, and the ratio is the median of the
per-round ratios (each gRPC round runs right after its raw round, so pairing them cancels
the drift of a shared machine); the best rounds are printed beside them. Both the gRPC path and the raw baseline move groups-per-call
groups per call (a pipeline of that many for raw Redis).

    python -m bench.buffer

It ends with its summary as a markdown table (the form docs/benchmarks.md keeps), then
one line: a JSON object with the results.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import grpc
import httpx
import redis
from pydantic import BaseModel

from bench.report import print_table
from bench.wire import realistic_group
from rlmesh.cli.embedded_redis import start_redis
from rlmesh.cli.launcher import http_ready, wait_until_ready
from rlmesh.common.auth import ensure_stack_token
from rlmesh.common.grpc_server import aio_channel
from rlmesh.common.net import free_port
from rlmesh.common.sample import group_to_proto
from rlmesh.v1 import buffer_pb2, buffer_pb2_grpc, sample_pb2

SAMPLES_PER_GROUP = 8
TEMPLATES = 32  # distinct groups, reused under fresh group ids


@dataclass
class Options:
    groups: int  # per measured round
    groups_per_call: int
    writers: int
    rounds: int
    json_sequences: int
    json_concurrency: int


# ---------------------------------------------------------------- payload


def templates() -> list[sample_pb2.SampleGroup]:
    return [group_to_proto(realistic_group(seed)) for seed in range(TEMPLATES)]


def json_payloads(groups: list[sample_pb2.SampleGroup]) -> list[dict]:
    """The same groups as a JSON trajectory API takes them (lists of numbers)."""
    from rlmesh.common.sample import group_from_proto

    out = []
    for g in groups:
        py = group_from_proto(g)
        out.append(
            {
                "group_id": py.group_id,
                "sequences": [
                    {
                        "tokens": s.tokens,
                        "log_probs": s.rollout_log_probs,
                        "loss_mask": s.loss_mask,
                        "response_length": s.response_length,
                        "reward": s.reward,
                        "prompt": s.prompt,
                        "response": s.response,
                    }
                    for s in py.samples
                ],
            }
        )
    return out


# ---------------------------------------------------------------- raw Redis baseline


def raw_redis_round(url: str, raws: list[bytes], n: int, per_call: int, tag: str, wait_aof: bool = False) -> float:
    """`wait_aof`: each write and each read+delete waits until Redis fsynced it (WAITAOF 1 0,
    Redis >= 7.2 or Valkey), as appendfsync always does for every write."""
    client = redis.Redis.from_url(url, single_connection_client=True)  # (WAITAOF covers its connection's writes)
    hash_key, queue = f"raw:{tag}:groups", f"raw:{tag}:queue"
    start = time.perf_counter()
    for first in range(0, n, per_call):
        ids = [f"{tag}-{i}" for i in range(first, min(first + per_call, n))]
        pipe = client.pipeline(transaction=False)
        pipe.hset(hash_key, mapping={gid: raws[i % len(raws)] for i, gid in enumerate(ids)})
        pipe.rpush(queue, *ids)
        if wait_aof:
            pipe.execute_command("WAITAOF", 1, 0, 0)
        pipe.execute()
        got = client.lpop(queue, len(ids))
        values = client.hmget(hash_key, got)
        client.hdel(hash_key, *got)
        if wait_aof:
            client.execute_command("WAITAOF", 1, 0, 0)
        assert len(values) == len(ids) and all(v is not None for v in values)
    elapsed = time.perf_counter() - start
    client.close()
    return n / elapsed


# ---------------------------------------------------------------- the buffer over gRPC


async def grpc_round(address: str, groups: list[sample_pb2.SampleGroup], opts: Options, run_id: str) -> float:
    channel = aio_channel(address)
    stub = buffer_pb2_grpc.BufferStub(channel)
    n, per_call = opts.groups, opts.groups_per_call
    batches = []
    for first in range(0, n, per_call):
        batches.append(range(first, min(first + per_call, n)))

    async def writer(mine: list[range]) -> None:
        for ids in mine:
            request = buffer_pb2.PutGroupsRequest(run_id=run_id)
            for i in ids:
                g = request.groups.add()
                g.CopyFrom(groups[i % len(groups)])
                g.group_id = f"{run_id}-{i}"
            response = await stub.PutGroups(request)
            assert response.stored == len(ids)

    async def trainer() -> int:
        seen = 0
        while seen < n:
            want = min(per_call, n - seen)
            batch = await stub.LeaseBatch(buffer_pb2.LeaseBatchRequest(run_id=run_id, num_groups=want, wait_seconds=30))
            assert len(batch.groups) == want, "lease came back short"
            await stub.AckBatch(buffer_pb2.AckBatchRequest(run_id=run_id, lease_id=batch.lease_id))
            seen += want
        return seen

    start = time.perf_counter()
    await asyncio.gather(trainer(), *(writer(batches[w :: opts.writers]) for w in range(opts.writers)))
    elapsed = time.perf_counter() - start
    await channel.close()
    return n / elapsed


async def create_run(address: str, run_id: str, dataset: str) -> None:
    channel = aio_channel(address)
    await buffer_pb2_grpc.BufferStub(channel).CreateRun(
        buffer_pb2.CreateRunRequest(
            run_id=run_id,
            n_samples_per_prompt=SAMPLES_PER_GROUP,
            datasets=[buffer_pb2.DatasetSpec(name="train", path=dataset)],
        )
    )
    await channel.close()


# ---------------------------------------------------------------- JSON over HTTP baseline


class Sequence(BaseModel):
    tokens: list[int]
    log_probs: list[float]
    loss_mask: list[int]
    response_length: int
    reward: float
    prompt: str
    response: str


class Trajectories(BaseModel):
    group_id: str
    sequences: list[Sequence]


def json_app(redis_url: str):
    """The trajectory API baseline: pydantic-validated JSON lists, stored in Redis."""
    import redis.asyncio as aioredis
    from fastapi import FastAPI

    app = FastAPI()
    store = aioredis.Redis.from_url(redis_url)

    @app.get("/health")
    async def health() -> dict:
        return {"ok": True}

    @app.post("/trajectories")
    async def post(body: Trajectories) -> dict:
        await store.rpush("json:trajectories", body.model_dump_json())
        return {"stored": len(body.sequences)}

    return app


def serve_json(port: int, redis_url: str) -> None:
    import uvicorn

    uvicorn.run(json_app(redis_url), host="127.0.0.1", port=port, log_level="warning", access_log=False)


async def json_round(url: str, payloads: list[dict], opts: Options) -> float:
    n_groups = max(1, opts.json_sequences // SAMPLES_PER_GROUP)
    next_group = 0

    async def poster(client: httpx.AsyncClient) -> None:
        nonlocal next_group
        while next_group < n_groups:
            i = next_group
            next_group += 1
            body = dict(payloads[i % len(payloads)], group_id=f"json-{i}")
            r = await client.post(
                "/trajectories", content=json.dumps(body), headers={"content-type": "application/json"}
            )
            r.raise_for_status()

    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        start = time.perf_counter()
        await asyncio.gather(*(poster(client) for _ in range(opts.json_concurrency)))
        elapsed = time.perf_counter() - start
    return n_groups * SAMPLES_PER_GROUP / elapsed


# ---------------------------------------------------------------- processes


def spawn_buffer(
    redis_url: str, port: int, work: str, name: str, cache_megabytes: int | None = None
) -> subprocess.Popen:
    """The buffer service as its own process (its log in <work>/<name>.log; it reads datasets under `work`)."""
    cache = [] if cache_megabytes is None else ["--cache-megabytes", str(cache_megabytes)]
    with open(os.path.join(work, f"{name}.log"), "wb") as log:  # (the child keeps its own descriptor)
        return subprocess.Popen(
            [sys.executable, "-m", "rlmesh.cli", "serve", "buffer", "--redis-url", redis_url, "--port", str(port)]
            + ["--log-level", "WARNING", "--data-roots", json.dumps([work]), *cache],
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def wait_grpc(address: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    channel = grpc.insecure_channel(address)
    try:
        while True:
            try:
                grpc.channel_ready_future(channel).result(timeout=1)
                return
            except grpc.FutureTimeoutError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the buffer service did not start") from None
    finally:
        channel.close()


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def settle() -> None:
    """Let Redis finish the previous round's disk work (an everysec fsync, a rewrite of its
    append-only file) before the next round starts, so no path is charged for another's."""
    time.sleep(1.1)


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """CPU time (user + system) of each process so far (Linux /proc; zeros elsewhere)."""
    out = {}
    for name, pid in pids.items():
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[name] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except OSError:
            out[name] = 0.0
    return out


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=1536, help="groups per measured round")
    # 32 groups (256 sequences): a typical rollout batch, what a trainer leases per step
    parser.add_argument("--groups-per-call", type=int, default=32, help="groups per PutGroups / LeaseBatch")
    parser.add_argument("--writers", type=int, default=2, help="concurrent PutGroups callers")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds per path (best kept)")
    parser.add_argument("--json-sequences", type=int, default=1600, help="sequences per JSON round")
    parser.add_argument("--json-concurrency", type=int, default=4, help="concurrent JSON posters")
    parser.add_argument(
        "--cache-megabytes", type=int, default=None, help="the buffer's group cache (default: its own default; 0 = off)"
    )
    parser.add_argument("--serve-json", nargs=2, metavar=("PORT", "REDIS_URL"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_json:
        serve_json(int(args.serve_json[0]), args.serve_json[1])
        return
    opts = Options(
        args.groups, args.groups_per_call, args.writers, args.rounds, args.json_sequences, args.json_concurrency
    )
    ensure_stack_token()  # the buffer processes and the clients here share it

    work = tempfile.mkdtemp(prefix="rlmesh-bench-buffer-")
    procs: list[subprocess.Popen] = []
    server = start_redis(os.path.join(work, "redis"))
    try:
        groups = templates()
        raws = [g.SerializeToString() for g in groups]
        payloads = json_payloads(groups)
        group_bytes = sum(len(r) for r in raws) / len(raws)

        port = free_port()
        procs.append(spawn_buffer(server.url, port, work, "buffer", args.cache_megabytes))
        json_port = free_port()
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "bench.buffer", "--serve-json", str(json_port), server.url],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
            )
        )
        address, json_url = f"127.0.0.1:{port}", f"http://127.0.0.1:{json_port}"
        wait_grpc(address, procs[0])
        wait_until_ready(lambda: http_ready(json_url), procs[1], "the JSON trajectory server", timeout=60)
        dataset = os.path.join(work, "prompts.jsonl")
        with open(dataset, "w") as f:
            f.write(json.dumps({"prompt": "unused", "label": ""}) + "\n")

        # warm up each path (connections, scripts, allocator), then measure interleaved
        asyncio.run(create_run(address, "warmup", dataset))
        asyncio.run(grpc_round(address, groups, Options(64, opts.groups_per_call, opts.writers, 1, 0, 1), "warmup"))
        raw_redis_round(server.url, raws, 64, opts.groups_per_call, "warmup")
        asyncio.run(json_round(json_url, payloads, Options(0, 0, 0, 1, 64, opts.json_concurrency)))

        raw_rates, grpc_rates, json_rates = [], [], []
        pids = {"redis": server.process.pid, "buffer": procs[0].pid, "client": os.getpid()}
        grpc_cpu: dict[str, float] = {}
        raw_cpu: dict[str, float] = {}
        for r in range(opts.rounds):
            settle()
            before = cpu_seconds(pids)
            raw_rates.append(raw_redis_round(server.url, raws, opts.groups, opts.groups_per_call, f"r{r}"))
            used = {k: (v - before[k]) / opts.groups * 1e6 for k, v in cpu_seconds(pids).items()}
            if raw_rates[-1] == max(raw_rates):
                raw_cpu = used
            asyncio.run(create_run(address, f"bench{r}", dataset))
            settle()
            before = cpu_seconds(pids)
            grpc_rates.append(asyncio.run(grpc_round(address, groups, opts, f"bench{r}")))
            used = {k: (v - before[k]) / opts.groups * 1e6 for k, v in cpu_seconds(pids).items()}
            if grpc_rates[-1] == max(grpc_rates):
                grpc_cpu = used
            settle()
            json_rates.append(asyncio.run(json_round(json_url, payloads, opts)))

        grpc_gps, raw_gps, json_sps = (statistics.median(r) for r in (grpc_rates, raw_rates, json_rates))
        grpc_sps = grpc_gps * SAMPLES_PER_GROUP
        ratio = statistics.median(g / r for g, r in zip(grpc_rates, raw_rates))
        print(
            f"payload: {SAMPLES_PER_GROUP} samples x 1024 tokens per group, {group_bytes / 1024:.1f} KiB serialized; "
            f"{opts.groups} groups per round, {opts.groups_per_call} per call, {opts.writers} writers; "
            f"median of {opts.rounds} rounds; {os.cpu_count()} CPUs, shared"
        )
        print(f"{'path':<48}{'groups/s':>12}{'sequences/s':>14}{'best':>8}{'rounds':>30}")
        rows = [
            ("buffer over gRPC (write -> lease -> ack)", grpc_gps, grpc_rates),
            ("raw redis-py, same bytes (write -> read+delete)", raw_gps, raw_rates),
            (
                "JSON over HTTP, FastAPI (write only)",
                json_sps / SAMPLES_PER_GROUP,
                [x / SAMPLES_PER_GROUP for x in json_rates],
            ),
        ]
        for name, gps, rates in rows:
            print(
                f"{name:<48}{gps:>12.0f}{gps * SAMPLES_PER_GROUP:>14.0f}{max(rates):>8.0f}"
                f"{' '.join(f'{x:.0f}' for x in rates):>30}"
            )
        result = {
            "grpc_groups_per_s": round(grpc_gps, 1),
            "raw_redis_groups_per_s": round(raw_gps, 1),
            "ratio": round(ratio, 3),
            "ratio_of_best_rounds": round(max(grpc_rates) / max(raw_rates), 3),
            "grpc_sequences_per_s": round(grpc_sps, 1),
            "json_http_sequences_per_s": round(json_sps, 1),
            "grpc_vs_json_http_ratio": round(grpc_sps / json_sps, 2),
            "group_bytes": int(group_bytes),
            "groups_per_call": opts.groups_per_call,
            "wire_form": "raw little-endian bytes fields (int32 tokens, float32 log-probs, uint8 masks)",
        }
        for name, used in (("gRPC path", grpc_cpu), ("raw Redis", raw_cpu)):
            print(
                f"CPU per group, {name} (best round): "
                + ", ".join(f"{k} {v:.0f} us" for k, v in used.items() if name == "gRPC path" or k != "buffer")
            )
        print(
            f"ratio (gRPC / raw Redis): {result['ratio']:.2f}   "
            f"gRPC vs JSON over HTTP: {result['grpc_vs_json_http_ratio']:.1f}x"
        )
        print_table(
            [
                {
                    "path": name,
                    "groups/s": f"{gps:.0f}",
                    "sequences/s": f"{gps * SAMPLES_PER_GROUP:.0f}",
                    "best round groups/s": f"{max(rates):.0f}",
                }
                for name, gps, rates in rows
            ]
            + [
                {"path": "gRPC / raw Redis (median of paired rounds)", "groups/s": f"{result['ratio']:.2f}x"},
                {"path": "gRPC / JSON over HTTP", "sequences/s": f"{result['grpc_vs_json_http_ratio']:.1f}x"},
            ],
            f"python -m bench.buffer: {SAMPLES_PER_GROUP} samples x 1024 tokens per group, {opts.groups} groups per "
            f"round, {opts.groups_per_call} per call, {opts.writers} writers, median of {opts.rounds} rounds, "
            f"{os.cpu_count()} CPUs",
        )
        print(json.dumps(result))
    finally:
        for p in procs:
            stop(p)
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
