"""Generation for GRPO on the CPU reference engine against plain Hugging Face `generate`
with static batches, on the same tiny model, in the same run.

The workload is what a rollout service sends: groups of n samples of one prompt arrive
over time (one group every --interval seconds, on a fixed random schedule), each sample its
own request (the rollout service now sends a group as one batch; this measures the engine
alone); prompts share an instruction prefix and differ in length; each sample has its own
output length (max_new_tokens, EOS ignored), as a group's samples end at different times.
Sampling at temperature 1.

- hf static: the baseline. Whenever the model is free, the requests that have arrived (up
  to --batch) go to `model.generate` as one left-padded batch, run until its longest
  output; each request is done when its batch is.
- engine, no prefix cache: the reference engine (`rlmesh serve engine`, its own process)
  with --prefix-cache-mb 0: continuous batching only.
- engine: the reference engine as deployed: continuous batching and prefix sharing (a
  group's prompt is computed once, the shared instruction once for all).

Every path gets one torch thread. The figure is generated tokens per second over the
stream (first arrival to last answer); the request latency (arrival to answer) is shown too.

    python -m bench.engine_prefix [--groups 24] [--n 8] [--interval 0.25]

It ends with its summary as a markdown table (the form docs/benchmarks.md keeps), then
one line: a JSON object with the results.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from bench.report import print_table
from rlmesh.cli.tiny_model import build_tiny_model
from rlmesh.common.auth import client_headers, ensure_stack_token
from rlmesh.common.net import free_port


@dataclass
class Request:
    group: int
    arrival: float  # seconds after the stream starts
    prompt: list[int]
    max_new_tokens: int


def workload(args: argparse.Namespace, vocab: int) -> list[Request]:
    rng = random.Random(args.seed)
    instruction = [rng.randrange(3, vocab) for _ in range(args.prefix_tokens)]
    requests, t = [], 0.0
    for g in range(args.groups):
        question = [rng.randrange(3, vocab) for _ in range(rng.randint(16, args.max_question_tokens))]
        for _ in range(args.n):
            requests.append(Request(g, t, instruction + question, rng.randint(args.min_new, args.max_new)))
        t += rng.expovariate(1 / args.interval)
    return requests


def summarize(name: str, requests: list[Request], done: list[float], span: float) -> dict:
    latency = [d - r.arrival for r, d in zip(requests, done)]
    tokens = sum(r.max_new_tokens for r in requests)
    return {
        "path": name,
        "tokens/s": tokens / span,
        "seconds": span,
        "latency mean s": statistics.mean(latency),
        "latency p90 s": sorted(latency)[int(0.9 * (len(latency) - 1))],
    }


def run_hf_static(model_dir: Path, requests: list[Request], batch: int) -> dict:
    """Static batches: what has arrived, up to `batch` requests, generated together to the
    batch's longest output."""
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = model.config.pad_token_id
    config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=pad, eos_token_id=None)
    done = [0.0] * len(requests)
    start, i = time.monotonic(), 0
    with torch.inference_mode():
        while i < len(requests):
            now = time.monotonic() - start
            if requests[i].arrival > now:
                time.sleep(requests[i].arrival - now)
                continue
            j = i
            while j < len(requests) and j - i < batch and requests[j].arrival <= now:
                j += 1
            chunk = requests[i:j]
            width = max(len(r.prompt) for r in chunk)
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, r in enumerate(chunk):
                ids[row, width - len(r.prompt) :] = torch.tensor(r.prompt)
                mask[row, width - len(r.prompt) :] = 1
            longest = max(r.max_new_tokens for r in chunk)
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                generation_config=config,
                max_new_tokens=longest,
                min_new_tokens=longest,
            )
            finished = time.monotonic() - start
            for k in range(i, j):
                done[k] = finished
            i = j
    row = summarize("hf generate, static batches", requests, done, max(done) - requests[0].arrival)
    row["prompt tokens reused"] = 0.0
    return row


def start_engine(model_dir: Path, batch: int, prefix_cache_mb: float, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "rlmesh.cli", "serve", "engine", "--model-path", str(model_dir)]
    command += ["--port", str(port), "--num-threads", "1", "--max-batch-size", str(batch), "--seed", "0"]
    command += ["--prefix-cache-mb", str(prefix_cache_mb)]
    with open(log_path, "ab") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the engine exited:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    process.kill()
    raise RuntimeError("the engine did not start in 120 s")


async def drive_engine(url: str, requests: list[Request]) -> tuple[list[float], int]:
    """Send each request at its arrival time; when each was answered, and the prompt tokens
    the engine reported as reused."""
    done = [0.0] * len(requests)
    cached = 0
    limits = httpx.Limits(max_connections=len(requests))
    async with httpx.AsyncClient(base_url=url, timeout=600, headers=client_headers(), limits=limits) as client:
        # One warm request (the first forward pass pays for setting torch up), then the stream.
        await client.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}})
        await client.get("/flush_cache")
        start = time.monotonic()

        async def one(k: int, r: Request) -> None:
            nonlocal cached
            await asyncio.sleep(max(r.arrival - (time.monotonic() - start), 0))
            params = {"max_new_tokens": r.max_new_tokens, "ignore_eos": True, "temperature": 1.0}
            answer = await client.post(
                "/generate", json={"input_ids": r.prompt, "sampling_params": params, "return_logprob": True}
            )
            answer.raise_for_status()
            meta = answer.json()["meta_info"]
            assert meta["completion_tokens"] == r.max_new_tokens, meta
            cached += meta["cached_tokens"]
            done[k] = time.monotonic() - start

        await asyncio.gather(*(one(k, r) for k, r in enumerate(requests)))
    return done, cached


def run_engine(model_dir: Path, requests: list[Request], batch: int, prefix_cache_mb: float, log_path: Path) -> dict:
    process, url = start_engine(model_dir, batch, prefix_cache_mb, log_path)
    try:
        done, cached = asyncio.run(drive_engine(url, requests))
    finally:
        process.terminate()
        process.wait(30)
    name = "engine" if prefix_cache_mb else "engine, no prefix cache"
    row = summarize(name, requests, done, max(done) - requests[0].arrival)
    row["prompt tokens reused"] = cached / sum(len(r.prompt) for r in requests)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=24, help="prompt groups in the stream")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--interval", type=float, default=0.25, help="mean seconds between groups' arrivals")
    parser.add_argument("--batch", type=int, default=32, help="largest batch (static) / running requests (engine)")
    parser.add_argument("--prefix-tokens", type=int, default=192, help="the instruction every prompt starts with")
    parser.add_argument("--max-question-tokens", type=int, default=192, help="each prompt's own part: 16 to this")
    parser.add_argument("--min-new", type=int, default=8, help="shortest output")
    parser.add_argument("--max-new", type=int, default=96, help="longest output")
    parser.add_argument("--hidden", type=int, default=256, help="the tiny model's hidden size")
    parser.add_argument("--layers", type=int, default=4, help="the tiny model's layers")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    ensure_stack_token()
    with tempfile.TemporaryDirectory(prefix="bench-engine-prefix-") as tmp:
        model_dir = build_tiny_model(
            Path(tmp) / "model", hidden_size=args.hidden, num_layers=args.layers, num_heads=4, max_positions=1024
        )
        vocab = AutoModelForCausalLM.from_pretrained(model_dir).config.vocab_size
        requests = workload(args, vocab)
        log_path = Path(tmp) / "engine.log"
        print(
            f"{len(requests)} requests ({args.groups} groups of {args.n}) over "
            f"{requests[-1].arrival:.1f} s, tiny Llama {args.hidden}x{args.layers}",
            flush=True,
        )
        rows = [run_hf_static(model_dir, requests, args.batch)]
        print(rows[-1], flush=True)
        for mb in (0.0, 256.0):
            rows.append(run_engine(model_dir, requests, args.batch, mb, log_path))
            print(rows[-1], flush=True)
    baseline = rows[0]["tokens/s"]
    for row in rows:
        row["vs hf static"] = row["tokens/s"] / baseline
    print_table(
        rows, title=f"python -m bench.engine_prefix --groups {args.groups} --n {args.n} --interval {args.interval}"
    )
    print(json.dumps({"rows": rows, "ratio": rows[-1]["vs hf static"]}))


if __name__ == "__main__":
    main()
