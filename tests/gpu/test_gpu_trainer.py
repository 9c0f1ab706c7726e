"""The trainer on CUDA (marked gpu: skipped without one). A bf16 step (autocast, float32
master weights: the trainer's default on CUDA) against the CPU float32 step on the same
model and batch, and megatron-core on CUDA at TP=1 without the CPU shims against the torch
backend on CUDA (TP=2 and PP=2 when two GPUs are present), and FSDP2 over NCCL on two GPUs
against one process on one GPU.

Tolerances. bf16 keeps 8 bits of mantissa, so the step's gradient norm may differ from
float32's by a few percent (5 % allowed). AdamW's first step moves every weight by about
lr * sign(gradient) whatever the gradient's size, so the weights after it agree to
within 2 lr where bf16 flips the sign of a near-zero gradient, and the updates point the same
way overall (cosine >= 0.9: a sign-like update's cosine is about 1 - 2 x the share of flipped signs). megatron-core against the torch backend on the same GPU, both
float32: only the order of floating-point sums differs (fused QKV and gate/up matmuls),
1e-4 absolute on logits and loss, 1e-4 on the weights after the script's steps. FSDP2 on
two GPUs against one, float32: sums in another order again (two shards and an all-reduce),
so the CPU test's tolerances, doubled for CUDA's kernels (which may sum in any order)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlmesh.common.net import free_port
from rlmesh.trainer.backend import TorchBackend
from tests.helpers.fsdp_worker import STEPS
from tests.helpers.trainer import CPU, config, make_groups

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[2]
LR = 1e-3


def test_a_bf16_step_on_cuda_matches_the_cpu_float32_step(tiny_model_dir):
    cuda = torch.device("cuda")
    cpu = TorchBackend(config(tiny_model_dir, device="cpu"), CPU, mixed_precision=False)
    gpu = TorchBackend(config(tiny_model_dir, device="cuda"), cuda, mixed_precision=True)
    try:
        before = {n: t.detach().clone() for n, t in cpu.state_dict_for_sync()}
        m_cpu, m_gpu = cpu.train_step(make_groups()), gpu.train_step(make_groups())
        assert gpu.policy.device.type == "cuda"
        assert m_gpu["grad_norm"] == pytest.approx(m_cpu["grad_norm"], rel=0.05)
        assert m_gpu["samples"] == m_cpu["samples"] and m_gpu["trained_tokens"] == m_cpu["trained_tokens"]
        after_cpu = dict(cpu.state_dict_for_sync())
        after_gpu = {n: t.detach().float().cpu() for n, t in gpu.state_dict_for_sync()}
        assert list(after_gpu) == list(after_cpu)
        d_cpu, d_gpu = [], []
        for name, w in after_cpu.items():
            assert after_gpu[name].dtype == torch.float32  # master weights stay float32
            assert (after_gpu[name] - w).abs().max() <= 2 * LR + 1e-6, name
            d_cpu.append((w - before[name]).flatten())
            d_gpu.append((after_gpu[name] - before[name]).flatten())
        cosine = torch.nn.functional.cosine_similarity(torch.cat(d_cpu), torch.cat(d_gpu), dim=0)
        assert cosine >= 0.9, float(cosine)
    finally:
        cpu.close()
        gpu.close()


def _megatron_on_cuda(model_dir: Path, tp: int, pp: int, out: Path) -> dict:
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
        "tests.helpers.gpu_megatron_worker",
        str(model_dir),
        str(tp),
        str(pp),
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return {
        **torch.load(out / "rank0.pt", weights_only=True),
        **torch.load(out / "last_stage.pt", weights_only=True),
        "report": json.loads((out / "report.json").read_text()),
    }


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)], ids=["TP1", "TP2", "PP2"])
def test_megatron_core_on_cuda_without_the_cpu_shims_matches_the_torch_backend(tmp_path, tp, pp):
    pytest.importorskip("megatron.core", reason="the megatron extra is not installed")
    if tp * pp > torch.cuda.device_count():
        pytest.skip(f"needs {tp * pp} GPUs")
    from tests.helpers.megatron_models import build_model
    from tests.helpers.megatron_worker import run_config, script

    model_dir = build_model("llama", tmp_path / "llama")
    got = _megatron_on_cuda(model_dir, tp, pp, tmp_path)
    assert got["report"]["shims"] is False and got["report"]["device"].startswith("cuda")
    torch.manual_seed(0)
    backend = TorchBackend(
        run_config(model_dir).model_copy(update={"device": "cuda"}), torch.device("cuda"), mixed_precision=False
    )
    try:
        want = script(backend)
    finally:
        backend.close()
    torch.testing.assert_close(got["logits"], want["logits"].cpu(), atol=1e-4, rtol=0)
    torch.testing.assert_close(got["loss"], want["loss"].cpu(), atol=1e-4, rtol=0)
    assert list(got["weights"]) == list(want["weights"])
    for name, w in want["weights"].items():
        torch.testing.assert_close(
            got["weights"][name], w.cpu(), atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_fsdp2_over_nccl_on_two_gpus_trains_like_one_gpu(tiny_model_dir, tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    case = {"num_steps_per_rollout": 2, "optimizer": {"lr": LR, "grad_clip": 100.0}}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(REPO / "tests" / "helpers" / "fsdp_worker.py"),
        str(tiny_model_dir),
        str(tmp_path),
        json.dumps({"grpo": case}),
        "cuda",
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    sharded = torch.load(tmp_path / "grpo.pt", weights_only=True)
    assert sharded["device"].startswith("cuda") and "nccl" in sharded["backend"], (
        sharded["device"],
        sharded["backend"],
    )
    one = TorchBackend(config(tiny_model_dir, device="cuda", **case), torch.device("cuda"), mixed_precision=False)
    try:
        for step in range(STEPS):
            single, both = one.train_step(make_groups()), sharded["metrics"][step]
            assert set(both) == set(single)
            for key, value in single.items():
                assert both[key] == pytest.approx(value, rel=2e-4, abs=2e-5), (step, key)
        total = sum(p.numel() for p in one.policy.parameters())
        assert sharded["held"] == pytest.approx(total / 2, rel=0.01)  # rank 0 held half of the model
        for name, value in one.state_dict_for_sync():
            torch.testing.assert_close(sharded["weights"][name], value.cpu(), atol=2e-4, rtol=0, msg=name)
    finally:
        one.close()
