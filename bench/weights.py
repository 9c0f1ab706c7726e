"""The measurement behind weight pushes: how close a full push (the gRPC handshake
through the rollout service, the broadcast, the engine's load) comes to a raw
torch.distributed broadcast of the same bytes, how it compares with the disk path, and
how small a delta push is after one optimizer step.

Everything is local and real: a Llama-architecture model of about 1 GB in bfloat16 is
built with random weights under a temporary directory, the CPU reference engine serves
it in its own process (dtype bfloat16), the rollout service runs in this process, and
the trainer side holds float32 master weights pushed as bfloat16 (the trainer's
weight_sync_dtype), over gloo on loopback.

- raw broadcast: rank 0 broadcasts the push's bytes (the bfloat16 weights, bucketed as the
  push buckets them, each bucket flattened beforehand) to a second process that receives
  them into a preallocated buffer: the transport's ceiling. The bytes sent are real: an
  untouched `torch.empty` buffer reads as the kernel's zero page, which stays in cache and
  made the broadcast look ~20% faster than any real weights can go.
- full push: WeightPusher.push_distributed, delta off (every byte sent), of bfloat16
  parameters (a bf16 trainer's; push_gb_per_s) and of the float32 master weights
  converted on the way (push_from_fp32_gb_per_s).
- colocated push (weight_sync.method "colocated"): the trainer writes the weights once
  into an rlmesh weight file in /dev/shm, the engine maps it and takes its pages as its
  parameters (UpdateWeightsFromTensor through the rollout service), no copy on the engine's
  side and none over a network; of the same
  bfloat16 parameters (colocated_gb_per_s; colocated_vs_push against the distributed push's
  median, measured in earlier rounds) and from the float32 master weights. Then the
  engine's weights are compared with what was pushed, bit for bit.
- disk push: save safetensors, then UpdateWeightsFromDisk.
- delta push: one AdamW step (lr 1e-6, a usual RL learning rate; random gradients) on the
  float32 master weights, then a push with delta on: only the elements whose bfloat16
  bits changed travel. The engine's weights are then compared with the trainer's.

    python -m bench.weights [--layers 9] [--rounds 3]

It ends with its summary as a markdown table (the form docs/benchmarks.md keeps), then
one line: a JSON object with the results.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
import torch.distributed as dist

from bench.report import print_table
from rlmesh.common import weight_file
from rlmesh.common.auth import client_headers, ensure_stack_token
from rlmesh.common.net import free_port
from rlmesh.common.run_config import WeightSyncConfig
from rlmesh.common.weight_group import destroy_weight_group, init_weight_group, rendezvous_socket
from rlmesh.rollout.config import Settings as RolloutSettings
from rlmesh.rollout.server import start as start_rollout
from rlmesh.trainer.colocated import ColocatedPusher
from rlmesh.trainer.weight_sync import WeightPusher, flatten_bucket, plan_buckets

GB = 1e9

RAW_RECEIVER = """
import json, sys
import torch, torch.distributed as dist
from rlmesh.common.weight_group import init_weight_group
port, name, sizes, rounds = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
group = init_weight_group("gloo", "127.0.0.1", port, 2, 1, name, 300)
buffer = torch.empty(max(sizes), dtype=torch.uint8)
for _ in range(rounds):
    for n in sizes:
        dist.broadcast(buffer[:n], src=0, group=group)
dist.barrier(group=group)  # exits only once rank 0 is done: never during a measured push
dist.destroy_process_group(group)
"""


def build_model(out: Path, layers: int) -> Path:
    """A Llama-architecture model (hidden 2048, vocab 32000, tied embeddings) with random
    bfloat16 weights, saved as a Hugging Face directory with the tiny character tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlmesh.cli.tiny_model import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=16,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(config, torch_dtype=torch.bfloat16)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model
    gc.collect()
    return out


def master_weights(model_dir: Path) -> list[tuple[str, torch.Tensor]]:
    """The trainer's float32 copy of the checkpoint, in file order."""
    from safetensors import safe_open

    named = []
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as reader:
            for name in reader.keys():  # noqa: SIM118 (a safetensors reader, not a dict)
                named.append((name, reader.get_tensor(name).float()))
    return named


def start_engine(
    model_dir: Path, log_path: Path, weight_file_dir: Path, weight_root: Path
) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "rlmesh.cli",
        "serve",
        "engine",
        "--model-path",
        str(model_dir),
        "--port",
        str(port),
        "--dtype",
        "bfloat16",
        "--num-threads",
        "1",
        "--max-batch-size",
        "1",
        "--context-length",
        "64",
        "--weight-file-dir",
        str(weight_file_dir),
        "--weight-roots",
        json.dumps([str(weight_root)]),  # (the disk push's directory)
    ]
    with open(log_path, "ab") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the engine exited:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    raise RuntimeError("the engine did not start in 600 s")


class RawBroadcast:
    """Rank 0 of a two-rank gloo group whose other rank only receives."""

    def __init__(self, buckets: list[torch.Tensor], rounds: int) -> None:
        self.buckets = [b.view(torch.uint8) for b in buckets]
        sizes = [b.numel() for b in self.buckets]
        name = f"raw-{free_port()}"
        port, fd = rendezvous_socket("127.0.0.1")
        self.receiver = subprocess.Popen(
            [sys.executable, "-c", RAW_RECEIVER, str(port), name, json.dumps(sizes), str(rounds)]
        )
        self.group = init_weight_group("gloo", "127.0.0.1", port, 2, 0, name, 300, fd)
        self.name = name

    def once(self) -> float:
        start = time.perf_counter()
        for bucket in self.buckets:
            dist.broadcast(bucket, src=0, group=self.group)
        return time.perf_counter() - start

    def close(self) -> None:
        dist.barrier(group=self.group)
        self.receiver.wait(timeout=120)
        destroy_weight_group(self.group, self.name)
        self.buckets.clear()  # a copy of the weights


def adamw_step(named: list[tuple[str, torch.Tensor]], lr: float) -> None:
    """One AdamW step with random gradients, one parameter at a time (the optimizer's
    state is dropped after each, to keep memory at the weights' size)."""
    generator = torch.Generator().manual_seed(1)
    for _, t in named:
        p = torch.nn.Parameter(t, requires_grad=True)
        p.grad = torch.randn(t.shape, generator=generator)
        optimizer = torch.optim.AdamW([p], lr=lr, weight_decay=0.0)
        optimizer.step()
        del optimizer, p


def engine_tensor(url: str, name: str, rows: int) -> torch.Tensor:
    r = httpx.post(
        f"{url}/get_weights_by_name", json={"name": name, "truncate_size": rows}, headers=client_headers(), timeout=300
    )
    r.raise_for_status()
    return torch.tensor(r.json(), dtype=torch.float32)


async def run(args: argparse.Namespace, work: Path) -> dict:
    model_dir = build_model(work / "model", args.layers)
    named = master_weights(model_dir)
    wire = torch.bfloat16
    wire_bytes = sum(t.numel() for _, t in named) * wire.itemsize
    print(f"model: {len(named)} tensors, {wire_bytes / GB:.3f} GB as bfloat16", flush=True)

    shm = weight_file.default_dir().parent / f"rlmesh-bench-{os.getpid()}"
    engine, url = start_engine(model_dir, work / "engine.log", shm, work)
    rollout, port = await start_rollout(RolloutSettings(port=0, engine_urls=[url]))
    pusher = WeightPusher(f"127.0.0.1:{port}", "bench", timeout_seconds=600)
    colocated = ColocatedPusher(f"127.0.0.1:{port}", "bench", shm, timeout_seconds=600)
    full = WeightSyncConfig(backend="gloo", load_format=args.load_format, bucket_bytes=args.bucket_mb * 2**20)
    cpu = torch.device("cpu")
    raw = RawBroadcast(
        [flatten_bucket(b, cpu, wire) for b in plan_buckets(named, full.bucket_bytes, wire)],
        1 + args.rounds * (1 if args.push_only else 3),  # a warm-up; the bf16, fp32 and colocated rounds
    )
    try:
        version = 0
        first = await pusher.push_distributed(named, version, full, wire)  # opens the group
        print(f"first push (with the group's setup): {first.seconds:.2f} s", flush=True)

        # A bf16 trainer (bf16 parameters, fp32 master weights in the optimizer) pushes its
        # parameters as they are; an fp32 one converts each bucket on the way.
        as_sent = [(n, t.to(wire)) for n, t in named]
        push_s, cast_s, raw_s = [], [], []
        gaps: list[float] = []  # per bucket: rank 0 idle between one bucket's broadcast and the next's
        # The distributed pushes first, then the colocated ones: a colocated push slows the same
        # engine's next few distributed pushes (0.65-1.7 s against 0.5 s measured; not
        # profiled), which no run meets (its method is fixed), so the paths are not interleaved.
        # One round untimed: the first after the group's setup is slow on both sides alike
        # (raw ~1.2 s, push ~2 s against ~0.5 s after: memory touched for the first time).
        version += 1
        warm_raw, warm_push = await asyncio.to_thread(raw.once), await pusher.push_distributed(as_sent, version, full)
        print(f"warm-up round (not timed): raw broadcast {warm_raw:.2f} s, push {warm_push.seconds:.2f} s", flush=True)
        for _ in range(args.rounds):  # each against the raw broadcast just before it: load drifts
            raw_s.append(await asyncio.to_thread(raw.once))
            version += 1
            pushed = await pusher.push_distributed(as_sent, version, full)
            push_s.append(pushed.seconds)
            gaps += bucket_gaps(pushed)
            print_buckets(pushed, wire_bytes)
            print(f"raw broadcast {raw_s[-1]:.2f} s, push {push_s[-1]:.2f} s", flush=True)
        if args.push_only:
            raw.close()
            return push_summary(wire_bytes, full, args, push_s, raw_s, gaps)
        # Then the fp32 master weights, converted on the way: in their own rounds, after one
        # untimed push (a run pushes in one form; switching churns both sides' memory).
        version += 1
        await pusher.push_distributed(named, version, full, wire)
        cast_raw_s = []
        for _ in range(args.rounds):
            cast_raw_s.append(await asyncio.to_thread(raw.once))
            version += 1
            cast = await pusher.push_distributed(named, version, full, wire)
            cast_s.append(cast.seconds)
            print_buckets(cast, wire_bytes, "from fp32")
            print(f"raw broadcast {cast_raw_s[-1]:.2f} s, push from fp32 {cast_s[-1]:.2f} s", flush=True)

        first_colocated = []  # the two weight files' pages written (used in turn: the engine maps one)
        for _ in range(2):
            version += 1
            first_colocated.append((await colocated.push(as_sent, version, None, full.bucket_bytes)).seconds)
        print(f"first colocated pushes (the weight files' pages written): {first_colocated} s", flush=True)
        colo_s, colo_cast_s, colo_raw_s = [], [], []
        for _ in range(args.rounds):
            colo_raw_s.append(await asyncio.to_thread(raw.once))
            version += 1
            colo_s.append((await colocated.push(as_sent, version, None, full.bucket_bytes)).seconds)
            version += 1
            colo_cast_s.append((await colocated.push(named, version, wire, full.bucket_bytes)).seconds)
            print(
                f"raw broadcast {colo_raw_s[-1]:.2f} s, colocated {colo_s[-1]:.2f} s, "
                f"colocated from fp32 {colo_cast_s[-1]:.2f} s",
                flush=True,
            )
        raw.close()
        # The engine now holds the colocated push of the fp32 weights converted to bf16: bit for bit?
        colocated_exact = all(
            torch.equal(engine_tensor(url, n, 64), t[:64].to(wire).float()) for n, t in named[: args.check_tensors]
        )
        del as_sent
        push_time, cast_time, raw_time = (statistics.median(x) for x in (push_s, cast_s, raw_s))
        colo_time, colo_cast_time = statistics.median(colo_s), statistics.median(colo_cast_s)

        def save(target: Path) -> Path:
            from safetensors.torch import save_file

            target.mkdir(parents=True, exist_ok=True)
            save_file({n: t.to(wire).contiguous() for n, t in named}, str(target / "model.safetensors"))
            return target

        version += 1
        disk = await pusher.push_from_disk(save, work / "disk", version)
        print(f"disk push {disk.seconds:.2f} s", flush=True)
        shutil.rmtree(work / "disk", ignore_errors=True)

        delta_cfg = full.model_copy(update={"delta": True})
        version += 1
        base = await pusher.push_distributed(named, version, delta_cfg, wire)  # the delta's base
        await asyncio.to_thread(adamw_step, named, args.lr)
        version += 1
        delta = await pusher.push_distributed(named, version, delta_cfg, wire)
        print(
            f"delta push after one AdamW step: {delta.bytes} bytes of {base.bytes} ({delta.seconds:.2f} s)", flush=True
        )
        exact = all(
            torch.equal(engine_tensor(url, n, 64), t[:64].to(wire).float()) for n, t in named[: args.check_tensors]
        )
    except BaseException:
        print(f"engine log (tail):\n{(work / 'engine.log').read_text()[-4000:]}", file=sys.stderr)
        raise
    finally:
        await pusher.close()
        await colocated.close()
        shutil.rmtree(shm, ignore_errors=True)
        await rollout.stop(None)
        engine.terminate()
        engine.wait(timeout=60)

    return {
        "model_bytes": wire_bytes,
        "bucket_bytes": full.bucket_bytes,
        "load_format": args.load_format or "per_tensor",
        "push_gb_per_s": round(wire_bytes / push_time / GB, 3),
        "raw_broadcast_gb_per_s": round(wire_bytes / raw_time / GB, 3),
        # Paired: each round's push against the raw broadcast just before it (the machine's
        # load drifts between rounds), the median of those ratios.
        "push_vs_raw": round(statistics.median(r / p for r, p in zip(raw_s, push_s)), 3),
        "push_vs_raw_rounds": [round(r / p, 3) for r, p in zip(raw_s, push_s)],
        "bucket_gap_ms_median": round(1000 * statistics.median(gaps), 2) if gaps else None,
        "push_from_fp32_gb_per_s": round(wire_bytes / cast_time / GB, 3),
        "push_from_fp32_vs_raw": round(statistics.median(r / p for r, p in zip(cast_raw_s, cast_s)), 3),
        "dist_push_s": round(push_time, 3),
        "colocated_gb_per_s": round(wire_bytes / colo_time / GB, 3),
        "colocated_from_fp32_gb_per_s": round(wire_bytes / colo_cast_time / GB, 3),
        "colocated_push_s": round(colo_time, 3),
        "colocated_vs_push": round(push_time / colo_time, 2),  # medians (measured in separate rounds)
        # Paired as push_vs_raw: each round's colocated push against that round's raw broadcast.
        "colocated_vs_raw": round(statistics.median(r / c for r, c in zip(colo_raw_s, colo_s)), 2),
        "colocated_exact_on_checked_tensors": colocated_exact,
        "disk_push_s": round(disk.seconds, 3),
        "dist_vs_disk_speedup": round(disk.seconds / push_time, 2),
        "full_push_bytes": base.bytes,
        "delta_push_bytes": delta.bytes,
        "delta_fraction": round(delta.bytes / base.bytes, 4),
        "delta_push_s": round(delta.seconds, 3),
        "delta_exact_on_checked_tensors": exact,
    }


def bucket_gaps(result) -> list[float]:
    """Seconds rank 0 was idle between one bucket's broadcast ending and the next's starting
    (the next bucket's request went out while this one was sent, and it was prepared meanwhile)."""
    t = getattr(result, "timings", [])
    return [b.started - a.finished for a, b in itertools.pairwise(t)]


def print_buckets(result, wire_bytes: int, label: str = "") -> None:
    t = getattr(result, "timings", [])
    if not t:
        return
    per = sorted(b.finished - b.started for b in t)
    gaps = sorted(bucket_gaps(result)) or [0.0]
    # A bucket's first tensor leaves once every engine has posted its receive, and its own
    # transfer is in the figure too (on this model the first bucket's is the 131 MB embedding).
    first = sorted(b.first_sent - b.started for b in t[1:]) or [0.0]
    print(
        f"  {label + ': ' if label else ''}{len(t)} buckets: each {1000 * per[0]:.1f}-{1000 * per[-1]:.1f} ms (median {1000 * per[len(per) // 2]:.1f}), "
        f"rank 0 idle between buckets {1000 * gaps[len(gaps) // 2]:.2f} ms median ({1000 * gaps[-1]:.2f} max), "
        f"a later bucket's first tensor out after {1000 * first[len(first) // 2]:.1f} ms median (with its own transfer), "
        f"{wire_bytes / len(t) / 2**20:.0f} MiB a bucket; the first broadcast began at {1000 * t[0].started:.1f} ms, "
        f"the answers came {1000 * (result.seconds - t[-1].finished):.1f} ms after the last left",
        flush=True,
    )


def push_summary(wire_bytes: int, full: WeightSyncConfig, args, push_s: list, raw_s: list, gaps: list) -> dict:
    ratios = [r / p for r, p in zip(raw_s, push_s)]
    return {
        "model_bytes": wire_bytes,
        "bucket_bytes": full.bucket_bytes,
        "load_format": args.load_format or "per_tensor",
        "push_gb_per_s": round(wire_bytes / statistics.median(push_s) / GB, 3),
        "raw_broadcast_gb_per_s": round(wire_bytes / statistics.median(raw_s) / GB, 3),
        "push_vs_raw": round(statistics.median(ratios), 3),
        "push_vs_raw_rounds": [round(x, 3) for x in ratios],
        "bucket_gap_ms_median": round(1000 * statistics.median(gaps), 2) if gaps else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=9, help="decoder layers (9: about 1.06 GB in bfloat16)")
    parser.add_argument("--rounds", type=int, default=3, help="timed full pushes and raw broadcasts (medians)")
    parser.add_argument(
        "--bucket-mb",
        type=int,
        default=WeightSyncConfig().bucket_bytes // 2**20,
        help="bucket size in MiB (default: the run config's)",
    )
    parser.add_argument(
        "--load-format",
        default="",
        choices=["", "flattened_bucket"],
        help='the run config\'s load_format (default "": one broadcast per tensor)',
    )
    parser.add_argument("--lr", type=float, default=1e-6, help="learning rate of the optimizer step before the delta")
    parser.add_argument("--check-tensors", type=int, default=12, help="tensors compared with the engine afterwards")
    parser.add_argument(
        "--push-only", action="store_true", help="only the distributed push against the raw broadcast (no other paths)"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    ensure_stack_token()  # the engine and rollout processes started here and their clients share it
    work = Path(tempfile.mkdtemp(prefix="rlmesh-bench-weights-"))
    try:
        results = asyncio.run(run(args, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.push_only:
        print(json.dumps(results))
        return
    gb = results["model_bytes"] / GB
    print_table(
        [
            {
                "push": f"distributed, load_format {results['load_format']}",
                "GB/s": f"{results['push_gb_per_s']:.2f}",
                "seconds": f"{results['dist_push_s']:.2f}",
                "bytes sent": results["full_push_bytes"],
            },
            {
                "push": "same, from float32 weights converted on the way",
                "GB/s": f"{results['push_from_fp32_gb_per_s']:.2f}",
                "seconds": f"{results['push_from_fp32_vs_raw']:.2f} of the raw broadcast (paired rounds)",
            },
            {
                "push": "colocated (weight file in /dev/shm), same bf16 parameters",
                "GB/s": f"{results['colocated_gb_per_s']:.2f}",
                "seconds": f"{results['colocated_push_s']:.2f}",
                "bytes sent": f"0 over the network (bit-exact: {results['colocated_exact_on_checked_tensors']})",
            },
            {
                "push": "same, from float32 weights converted on the way",
                "GB/s": f"{results['colocated_from_fp32_gb_per_s']:.2f}",
            },
            {
                "push": "colocated / distributed push (medians)",
                "GB/s": f"{results['colocated_vs_push']:.2f}x",
            },
            {"push": "colocated / raw broadcast (paired)", "GB/s": f"{results['colocated_vs_raw']:.2f}x"},
            {"push": "raw torch.distributed broadcast (baseline)", "GB/s": f"{results['raw_broadcast_gb_per_s']:.2f}"},
            {
                "push": "push / raw broadcast (median of paired rounds; each round)",
                "GB/s": f"{results['push_vs_raw']:.2f} ({', '.join(f'{x:.2f}' for x in results['push_vs_raw_rounds'])})",
                "seconds": f"rank 0 idle between buckets: {results['bucket_gap_ms_median']} ms (median)",
            },
            {"push": "disk", "GB/s": f"{gb / results['disk_push_s']:.2f}", "seconds": f"{results['disk_push_s']:.2f}"},
            {
                "push": "delta, after one AdamW step",
                "GB/s": "",
                "seconds": f"{results['delta_push_s']:.2f}",
                "bytes sent": f"{results['delta_push_bytes']} ({results['delta_fraction']:.1%})",
            },
        ],
        f"python -m bench.weights: {gb:.3f} GB in bfloat16, {results['bucket_bytes'] // 2**20} MiB buckets, "
        f"medians of {args.rounds} rounds",
    )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
