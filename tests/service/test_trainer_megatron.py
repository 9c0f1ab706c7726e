"""The megatron-core backend against the torch backend, on the same model and batch.

Tiny Llama (untied embeddings) and Qwen2 (tied embeddings, QKV bias) models, both with
grouped-query attention, are built from a config and run at TP=2 and at PP=2: two real
processes under torchrun with a gloo group, megatron-core on CPU. Tolerance: float32
throughout, so the backends differ only by the order of floating-point sums (fused QKV
and gate/up matmuls, sharded reductions): 1e-5 absolute on logits, loss and gradients,
2e-5 on the weights after seven optimizer steps (three RL batches of two steps, one SFT step).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="the megatron extra is not installed")

from rlmesh.common.net import free_port
from rlmesh.trainer.backend import TorchBackend
from tests.helpers.megatron_models import build_model
from tests.helpers.megatron_worker import run_config, script

REPO = Path(__file__).resolve().parents[2]
ATOL = 1e-5
WEIGHTS_ATOL = 2e-5


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, build_model(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def torch_result(model) -> dict:
    torch.manual_seed(0)
    backend = TorchBackend(run_config(model[1]), torch.device("cpu"), mixed_precision=False)
    try:
        return script(backend)
    finally:
        backend.close()


def torchrun_worker(mode: str, model_dir: Path, tp: int, pp: int, out: Path) -> None:
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
        "tests.helpers.megatron_worker",
        mode,
        str(model_dir),
        str(tp),
        str(pp),
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def run_megatron(model_dir: Path, tp: int, pp: int, out: Path) -> dict:
    torchrun_worker("compare", model_dir, tp, pp, out)
    return {
        **torch.load(out / "rank0.pt", weights_only=True),
        **torch.load(out / "last_stage.pt", weights_only=True),
        "metrics": json.loads((out / "metrics.json").read_text()),
    }


def assert_close_dicts(got: dict, want: dict, atol: float, what: str) -> None:
    assert list(got) == list(want), f"{what}: the names (and their order) differ"
    for name, tensor in want.items():
        assert got[name].shape == tensor.shape, f"{what} {name}"
        torch.testing.assert_close(got[name], tensor, atol=atol, rtol=1e-4, msg=lambda m, n=name: f"{what} {n}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["TP2", "PP2"])
def test_megatron_matches_the_torch_backend(model, torch_result, tp, pp, tmp_path):
    _, model_dir = model
    got = run_megatron(model_dir, tp, pp, tmp_path)
    want = torch_result

    torch.testing.assert_close(got["logits"], want["logits"], atol=ATOL, rtol=0)
    torch.testing.assert_close(got["loss"], want["loss"], atol=ATOL, rtol=0)
    assert_close_dicts(got["grads"], want["grads"], ATOL, "gradient")
    torch.testing.assert_close(got["grad_norm"], want["grad_norm"].to(got["grad_norm"].dtype), atol=ATOL, rtol=1e-5)

    # A few optimizer steps stay together: the same metrics under the same names ...
    assert len(got["metrics"]) == len(want["metrics"])
    for step, (g, w) in enumerate(zip(got["metrics"], want["metrics"], strict=True)):
        assert set(g) == set(w), f"step {step}: metric names differ"
        for name in w:
            assert g[name] == pytest.approx(w[name], rel=1e-4, abs=1e-5), f"step {step} metric {name}"
    # ... and the weight set a push sends: HF names, shapes and values as the torch backend's.
    assert_close_dicts(got["weights"], want["weights"], WEIGHTS_ATOL, "pushed weight")


@pytest.mark.slow
def test_a_checkpoint_resumes_at_other_parallel_sizes(tmp_path):
    """A checkpoint written at TP=2 (HF weights, AdamW moments by HF name, step, scheduler)
    resumed at PP=2: the next step gives the weights the uninterrupted TP=2 run has."""
    model_dir = build_model("qwen2", tmp_path / "qwen2")
    torchrun_worker("resume-save", model_dir, 2, 1, tmp_path)
    torchrun_worker("resume-load", model_dir, 1, 2, tmp_path)
    assert json.loads((tmp_path / "checkpoint" / "trainer_state.json").read_text())["step"] == 2
    continued = torch.load(tmp_path / "resume-save.pt", weights_only=True)
    resumed = torch.load(tmp_path / "resume-load.pt", weights_only=True)
    assert_close_dicts(resumed, continued, WEIGHTS_ATOL, "weight after resuming")
