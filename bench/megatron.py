"""The megatron backend at TP=2 (and PP=2) beside the torch backend, on CPU: tokens per
second of an RL training step (GRPO: the pre-update forward, then forward/backward and
the optimizer step), on the same Llama-family model and batch, measured in the same run.

Every process runs one thread: the torch backend is one process, each megatron
configuration two processes under torchrun (gloo). Two figures per case: wall-clock
tokens/s, and the CPU seconds a step costs (all processes together), which does not
depend on what else the machine runs. Tensor parallelism halves each rank's matmuls but
adds two all-reduces per layer over loopback TCP and repeats the norms and the loss on
every rank; pipeline stages run one after the other (no overlap, see
rlmesh.trainer.megatron.backend).
On a busy machine two processes also get a bigger share of the cores than one, which the
wall-clock figure shows and the CPU figure does not. (Megatron's place is many GPUs; this
shows that the CPU path works and what it costs, not a GPU speed-up.)

    python -m bench.megatron

It ends with its summary as a markdown table (the form docs/benchmarks.md keeps), then
one line: a JSON object with the results.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.report import print_table
from rlmesh.common.net import free_port
from rlmesh.common.run_config import TrainerRunConfig
from rlmesh.common.sample import Sample, SampleGroup, Status

WARMUP_STEPS = 1
STEPS = 3
GROUPS, PER_GROUP, PROMPT, RESPONSE = 4, 4, 96, 96
MODEL = dict(
    vocab_size=2048,
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
REPO = Path(__file__).resolve().parents[1]


def build_model(path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**MODEL)).save_pretrained(path)
    return path


def batch() -> list[SampleGroup]:
    g = torch.Generator().manual_seed(0)
    groups = []
    for i in range(GROUPS):
        prompt = torch.randint(3, MODEL["vocab_size"], (PROMPT,), generator=g).tolist()
        samples = [
            Sample(
                index=j,
                tokens=prompt + torch.randint(3, MODEL["vocab_size"], (RESPONSE,), generator=g).tolist(),
                response_length=RESPONSE,
                reward=float(j % 2),
                status=Status.COMPLETED,
            )
            for j in range(PER_GROUP)
        ]
        groups.append(SampleGroup(f"g{i}", i, samples))
    return groups


def run_config(model: Path, backend: str = "torch", tp: int = 1, pp: int = 1) -> TrainerRunConfig:
    return TrainerRunConfig(
        model_path=str(model),
        backend=backend,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        micro_batch_size=8,
        device="cpu",
    )


def time_steps(backend) -> tuple[float, float]:
    """(Wall seconds, CPU seconds of this process) per train_step, means over STEPS after
    WARMUP_STEPS. CPU time shows the work done whatever else the machine runs."""
    groups = batch()
    for _ in range(WARMUP_STEPS):
        backend.train_step(groups)
    started, cpu_started = time.perf_counter(), time.process_time()
    for _ in range(STEPS):
        backend.train_step(groups)
    return (time.perf_counter() - started) / STEPS, (time.process_time() - cpu_started) / STEPS


TOKENS_PER_STEP = GROUPS * PER_GROUP * (PROMPT + RESPONSE)


def worker(argv: list[str]) -> None:
    """One rank of a megatron configuration (under torchrun); rank 0 writes the result."""
    import torch.distributed as dist

    from rlmesh.trainer.megatron.backend import MegatronBackend

    model, tp, pp, out = Path(argv[0]), int(argv[1]), int(argv[2]), Path(argv[3])
    torch.set_num_threads(1)
    backend = MegatronBackend(run_config(model, "megatron", tp, pp), torch.device("cpu"), mixed_precision=False)
    seconds, cpu = time_steps(backend)
    cpu_all = torch.tensor([cpu], dtype=torch.float64)
    dist.all_reduce(cpu_all)  # CPU time of all ranks together
    if dist.get_rank() == 0:
        out.write_text(json.dumps({"seconds_per_step": seconds, "cpu_seconds_per_step": float(cpu_all)}))
    dist.destroy_process_group()


def megatron(model: Path, tp: int, pp: int, work: Path) -> tuple[float, float]:
    out = work / f"tp{tp}pp{pp}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(tp * pp),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "-m",
        "bench.megatron",
        "--worker",
        str(model),
        str(tp),
        str(pp),
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"megatron TP={tp} PP={pp} failed:\n{proc.stderr[-4000:]}")
    result = json.loads(out.read_text())
    return result["seconds_per_step"], result["cpu_seconds_per_step"]


def main() -> None:
    from rlmesh.trainer.backend import TorchBackend

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = build_model(work / "model")
        print(
            f"model: Llama-family {MODEL['num_hidden_layers']} layers, hidden {MODEL['hidden_size']}, "
            f"{MODEL['num_attention_heads']} heads / {MODEL['num_key_value_heads']} KV groups, vocab {MODEL['vocab_size']}; "
            f"batch {GROUPS}x{PER_GROUP} samples of {PROMPT}+{RESPONSE} tokens ({TOKENS_PER_STEP} tokens/step)"
        )

        torch.set_num_threads(1)
        backend = TorchBackend(run_config(model), torch.device("cpu"), mixed_precision=False)
        seconds, cpu = time_steps(backend)
        backend.close()
        base_tps, base_cpu = TOKENS_PER_STEP / seconds, cpu
        results = {"torch_backend_tokens_per_s": base_tps, "torch_backend_cpu_s_per_step": base_cpu}
        rows = [
            {
                "backend": "torch (baseline)",
                "processes": 1,
                "tokens/s": f"{base_tps:.0f}",
                "CPU-s/step (all processes)": f"{base_cpu:.2f}",
            }
        ]
        print(
            f"baseline: torch backend, 1 process: {seconds:.2f} s/step, {base_tps:.0f} tokens/s, {cpu:.2f} CPU-s/step"
        )
        for tp, pp in ((2, 1), (1, 2)):
            seconds, cpu = megatron(model, tp, pp, work)
            key = f"megatron_tp{tp}_pp{pp}"
            results[f"{key}_tokens_per_s"] = TOKENS_PER_STEP / seconds
            results[f"{key}_cpu_s_per_step"] = cpu
            rows.append(
                {
                    "backend": f"megatron TP={tp} PP={pp}",
                    "processes": tp * pp,
                    "tokens/s": f"{TOKENS_PER_STEP / seconds:.0f}",
                    "CPU-s/step (all processes)": f"{cpu:.2f}",
                }
            )
            print(
                f"megatron TP={tp} PP={pp}, {tp * pp} processes (gloo): {seconds:.2f} s/step, "
                f"{TOKENS_PER_STEP / seconds:.0f} tokens/s ({TOKENS_PER_STEP / seconds / base_tps:.2f}x the baseline), "
                f"{cpu:.2f} CPU-s/step over all ranks ({cpu / base_cpu:.2f}x the baseline's)"
            )
        results.update(tokens_per_step=TOKENS_PER_STEP, steps=STEPS)
        print_table(
            rows,
            f"python -m bench.megatron: {MODEL['num_hidden_layers']}-layer model, {TOKENS_PER_STEP} "
            f"tokens/step, one thread per process, {os.cpu_count()} CPUs",
        )
        print(json.dumps(results))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2:])
    else:
        main()
