"""The coordinator's REST API under load while a run trains: readers of its run, its list
and its metrics, and writers of bad requests, against one `rlmesh up` stack on this machine.

One run of the demo's task (sync, the tiny model) trains throughout. Its speed, RL
iterations per second from its own records (`iteration/seconds`), is measured in windows
of --steps iterations that alternate unloaded and loaded (unloaded first and last, so a
drift of the machine's speed hits both); the first iteration after each switch is not
counted. While loaded, --readers clients each ask for GET /runs/{id}, GET /runs or
GET /runs/{id}/metrics (every reader one of them, with the defaults a dashboard would
use), and --writers clients each send bad requests (malformed JSON, invalid configs, a
second run while one is active, an oversized body, unknown or malformed run ids, a
delete of the active run, no token); each client waits --interval seconds after each
answer (0: at once). All clients start at the same moment, so the first wave is a burst
of readers + writers requests at once.

Figures: requests answered, their status codes (a 5xx is a failure of the API: there
must be none), latency p50/p99/max over every request, and the run's unloaded and loaded
iterations per second, measured in the same run, and their ratio.

    python -m bench.load [--readers 200] [--writers 50] [--steps 20] [--rounds 2] [--interval 1]

It ends with one line: a JSON object with the results.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

from bench.report import print_table
from rlmesh.cli.demo import demo_config, write_task
from rlmesh.cli.launcher import datasets_dir, start_stack
from rlmesh.cli.tiny_model import build_tiny_model
from rlmesh.common.auth import client_headers

WARMUP_ITERATIONS = 2


class Connection:
    """One keep-alive HTTP/1.1 connection, the least a client can do (httpx's own work per
    request, about 5 ms with hundreds of connections, would be what this measured)."""

    def __init__(self, host: str, port: int, headers: dict[str, str]) -> None:
        self.host, self.port, self.headers = host, port, headers
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> int:
        """The answer's status code (its body is read and dropped)."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        fields = {"host": f"{self.host}:{self.port}", **self.headers, **(headers or {})}
        if body or method == "POST":
            fields.setdefault("content-length", str(len(body)))
        head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in fields.items()) + "\r\n"
        try:
            self.writer.write(head.encode() + body)
            await self.writer.drain()
            status = int((await self.reader.readline()).split()[1])
            length, close = 0, False
            while (line := await self.reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                name, value = name.strip().lower(), value.strip().lower()
                if name == "content-length":
                    length = int(value)
                elif name == "connection" and value == "close":
                    close = True
                elif name == "transfer-encoding":
                    raise RuntimeError(f"{method} {path}: a {value} answer (this client reads content-length only)")
            await self.reader.readexactly(length)
        except BaseException:
            self.close()
            raise
        if close:
            self.close()
        return status

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


Request = tuple[str, str, bytes, dict[str, str]]  # method, path, body, headers


def bad_requests(run_id: str, config: dict) -> list[Request]:
    """What the bad writers send, in turn."""
    as_json = {"content-type": "application/json"}

    def body(value) -> bytes:
        return json.dumps(value).encode()

    return [
        ("POST", "/runs", b'{"model_path": ', as_json),  # not JSON: 422
        ("POST", "/runs", body({**config, "num_rollouts": "many"}), as_json),  # invalid: 422
        ("POST", "/runs", body({**config, "rollout": {"rollout_batch_size": 2**40}}), as_json),  # past the limits
        ("POST", "/runs", body(config), as_json),  # a second run while one is active: 409
        ("POST", "/runs", b"", {**as_json, "content-length": str(64 * 1024 * 1024)}),  # declared too large: 413
        ("POST", "/runs/0123456789ab/stop", b"", {}),  # unknown run: 404
        ("POST", "/runs/..%2F..%2Fx/pause", b"", {}),  # malformed id
        ("DELETE", f"/runs/{run_id}", b"", {}),  # the active run: 409
        ("POST", "/runs", body(config), {**as_json, "authorization": "Bearer wrong"}),  # 401
        ("POST", "/reward-services", body({"name": "", "url": "ftp://x"}), as_json),  # invalid: 422
    ]


class Load:
    """Readers and bad writers, started and stopped between measuring windows."""

    def __init__(self, url: str, run_id: str, config: dict, args) -> None:
        address = httpx.URL(url)
        self.host, self.port = address.host, address.port
        self.run_id, self.config, self.args = run_id, config, args
        self.statuses: Counter[str] = Counter()
        self.latencies: list[float] = []
        self.stop = asyncio.Event()
        self.tasks: list[asyncio.Task] = []

    async def _client(self, requests: list[Request], first: int) -> None:
        connection = Connection(self.host, self.port, client_headers())
        i = first
        while not self.stop.is_set():
            method, path, body, headers = requests[i % len(requests)]
            i += 1
            started = time.perf_counter()
            try:
                self.statuses[str(await connection.request(method, path, body, headers))] += 1
            except (OSError, ValueError, IndexError, asyncio.IncompleteReadError) as e:
                self.statuses[type(e).__name__] += 1
            self.latencies.append(time.perf_counter() - started)
            if self.args.interval:
                try:
                    await asyncio.wait_for(self.stop.wait(), self.args.interval)
                except TimeoutError:
                    pass
        connection.close()

    def start(self) -> None:
        self.stop.clear()
        reads: list[Request] = [
            ("GET", f"/runs/{self.run_id}", b"", {}),
            ("GET", "/runs", b"", {}),
            ("GET", f"/runs/{self.run_id}/metrics", b"", {}),
        ]
        writes = bad_requests(self.run_id, self.config)
        self.tasks = [asyncio.create_task(self._client([reads[i % len(reads)]], 0)) for i in range(self.args.readers)]
        self.tasks += [asyncio.create_task(self._client(writes, i)) for i in range(self.args.writers)]

    async def finish(self) -> None:
        self.stop.set()
        await asyncio.gather(*self.tasks)


class Iterations:
    """The run's RL iterations as they are recorded: their seconds, in order."""

    def __init__(self, client: httpx.AsyncClient, run_id: str) -> None:
        self.client, self.run_id, self.since = client, run_id, 0
        self.pending: list[float] = []
        self.failed = 0  # the bench's own requests that the API failed

    async def _poll(self) -> None:
        r = await self.client.get(
            f"/runs/{self.run_id}/metrics", params={"since": self.since, "fields": "iteration/seconds"}
        )
        if r.status_code != 200:  # (an API that fails under the load: asked again)
            self.failed += 1
            return
        page = r.json()
        self.since = page["next"]
        self.pending += [rec["iteration/seconds"] for rec in page["records"] if "iteration/seconds" in rec]

    async def flush(self) -> None:
        """Forget the iterations recorded so far (they ended before now)."""
        await self._poll()
        self.pending = []

    async def next(self, n: int) -> list[float]:
        """The next n iterations' seconds, once they are recorded."""
        while len(self.pending) < n:
            await self._poll()
            if len(self.pending) < n:
                r = await self.client.get(f"/runs/{self.run_id}", params={"metrics_last": 0})
                status = r.json() if r.status_code == 200 else {"status": "unknown"}
                if status["status"] in ("completed", "failed", "stopped"):
                    raise SystemExit(f"the run ended ({status['status']}: {status['error']}) before the bench did")
                await asyncio.sleep(0.1)
        taken, self.pending = self.pending[:n], self.pending[n:]
        return taken


async def measure(url: str, config: dict, args) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=60, headers=client_headers()) as client:
        r = await client.post("/runs", json=config)
        r.raise_for_status()
        run_id = r.json()["id"]
        iterations = Iterations(client, run_id)
        await iterations.next(WARMUP_ITERATIONS)
        load = Load(url, run_id, config, args)
        windows: dict[str, list[float]] = {"unloaded": [], "loaded": []}
        for window in range(2 * args.rounds + 1):
            loaded = window % 2 == 1
            await iterations.flush()
            if loaded:
                load.start()
            await iterations.next(1)  # (the switch happened during this one)
            windows["loaded" if loaded else "unloaded"] += await iterations.next(args.steps)
            if loaded:
                await load.finish()
            print(
                f"window {window + 1}: {'loaded  ' if loaded else 'unloaded'} "
                f"{args.steps / sum(windows['loaded' if loaded else 'unloaded'][-args.steps :]):.2f} iterations/s",
                flush=True,
            )
        await client.post(f"/runs/{run_id}/stop")
    latencies = sorted(load.latencies)
    unloaded = len(windows["unloaded"]) / sum(windows["unloaded"])
    loaded = len(windows["loaded"]) / sum(windows["loaded"])
    return {
        "requests": len(latencies),
        "statuses": dict(sorted(load.statuses.items())),
        "status_5xx": sum(n for s, n in load.statuses.items() if s.startswith("5")),
        "client_errors": sum(n for s, n in load.statuses.items() if not s.isdigit()),
        "monitor_failures": iterations.failed,
        "p50_ms": round(1000 * statistics.median(latencies), 1),
        "p99_ms": round(1000 * latencies[int(0.99 * (len(latencies) - 1))], 1),
        "max_ms": round(1000 * latencies[-1], 1),
        "unloaded_iterations_per_s": round(unloaded, 3),
        "loaded_iterations_per_s": round(loaded, 3),
        "loaded_over_unloaded": round(loaded / unloaded, 3),
        "readers": args.readers,
        "writers": args.writers,
        "interval_s": args.interval,
        "steps_per_window": args.steps,
        "rounds": args.rounds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--readers", type=int, default=200, help="concurrent reading clients")
    parser.add_argument("--writers", type=int, default=50, help="concurrent clients sending bad requests")
    parser.add_argument("--steps", type=int, default=20, help="RL iterations measured per window")
    parser.add_argument("--rounds", type=int, default=2, help="loaded windows (between unloaded ones)")
    parser.add_argument(
        "--interval", type=float, default=1.0, help="seconds each client waits after an answer (0: none)"
    )
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"  # one thread per torch process (engine, trainer)

    with tempfile.TemporaryDirectory(prefix="rlmesh-bench-load-") as tmp:
        data_dir = Path(tmp)
        model = build_tiny_model(data_dir / "tiny-model")
        train, held_out = write_task(datasets_dir(data_dir) / "demo")
        # (+ slack: the iterations that end while a window is switched are not counted)
        rollouts = WARMUP_ITERATIONS + (2 * args.rounds + 1) * (args.steps + 3) + 20
        config = demo_config(str(model), train, held_out, sft_steps=2, rollouts=rollouts).model_dump(mode="json")
        config["name"] = "bench.load"
        config["eval"] = {**config["eval"], "interval": 0, "limit": 8}
        print("starting rlmesh (embedded Redis, CPU reference engine, tiny model):", flush=True)
        stack = start_stack(data_dir, str(model))
        try:
            result = asyncio.run(measure(stack.coordinator_url, config, args))
        finally:
            stack.stop()
    print(
        f"{result['requests']} requests ({args.readers} readers, {args.writers} bad writers, "
        f"{args.interval:g} s apart): {result['statuses']}; p50 {result['p50_ms']} ms, p99 {result['p99_ms']} ms, "
        f"max {result['max_ms']} ms"
    )
    print(
        f"run: {result['unloaded_iterations_per_s']} iterations/s unloaded, {result['loaded_iterations_per_s']} "
        f"loaded ({result['loaded_over_unloaded']:.0%})"
    )
    print_table(
        [
            {
                "requests": result["requests"],
                "5xx": result["status_5xx"],
                "p50 ms": result["p50_ms"],
                "p99 ms": result["p99_ms"],
                "max ms": result["max_ms"],
                "run iterations/s unloaded": result["unloaded_iterations_per_s"],
                "loaded": result["loaded_iterations_per_s"],
                "loaded / unloaded": f"{result['loaded_over_unloaded']:.0%}",
            }
        ],
        f"python -m bench.load: {args.readers} readers, {args.writers} bad writers, {args.interval:g} s between "
        f"a client's requests, {args.rounds} loaded windows of {args.steps} iterations between unloaded ones, "
        f"{os.cpu_count()} CPUs",
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
