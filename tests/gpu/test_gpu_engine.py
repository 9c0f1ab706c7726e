"""The reference engine on CUDA, and colocated weight updates on CUDA (marked gpu: skipped
without one).

- The engine generates on CUDA: greedy tokens and their log-probs as the Hugging Face model
  on the same GPU computes them (float32, 1e-4 on log-probs).
- A colocated update from an rlmesh weight file lands in the engine's CUDA parameters bit
  for bit.
- CUDA IPC in SGLang's /update_weights_from_tensor format: the payload the trainer builds
  for SGLang engines (rlmesh.trainer.colocated.sglang_payload) is opened in another process,
  as SGLang's scheduler opens it, and the tensors it maps are the trainer's, bit for bit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlmesh.common import weight_file
from rlmesh.common.auth import client_headers
from rlmesh.common.model_building import build_hf_model
from rlmesh.common.weight_group import GPU_KEY, gpu_uuid
from rlmesh.engine.config import Settings
from rlmesh.engine.server import start
from rlmesh.trainer.colocated import sglang_payload

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def cuda_engine(loop_thread, tiny_model_dir, tmp_path):
    settings = Settings(
        model_path=str(tiny_model_dir), device="cuda", num_threads=1, seed=0, weight_file_dir=str(tmp_path / "shm")
    )
    server, port = loop_thread.run(start(settings))
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120, headers=client_headers()) as c:
        yield c
    loop_thread.run(server.stop())


def test_the_engine_generates_on_cuda_as_the_model_does(cuda_engine, tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = build_hf_model(AutoModelForCausalLM.from_pretrained, tiny_model_dir, dtype=torch.float32).to("cuda").eval()
    prompt = tokenizer("rev ab=")["input_ids"]
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
    }
    out = cuda_engine.post("/generate", json=body).json()
    assert out["meta_info"]["completion_tokens"] == 8
    tokens = prompt + out["output_ids"]
    with torch.no_grad():
        logp = model(torch.tensor([tokens], device="cuda")).logits[0].float().log_softmax(-1).cpu()
    for j, (lp, token, _) in enumerate(out["meta_info"]["output_token_logprobs"]):
        position = len(prompt) + j - 1
        assert token == int(logp[position].argmax())  # greedy
        assert lp == pytest.approx(float(logp[position, token]), abs=1e-4)


def test_a_colocated_update_lands_in_cuda_parameters_bit_for_bit(cuda_engine, tiny_model_dir, tmp_path):
    model = build_hf_model(AutoModelForCausalLM.from_pretrained, tiny_model_dir, dtype=torch.float32)
    named = [(n, t.detach() + 0.125) for n, t in model.state_dict().items()]
    writer = weight_file.Writer(tmp_path / "shm" / "run.rlmw")
    writer.write(named)
    assert cuda_engine.post("/release_memory_occupation", json={}).status_code == 200
    assert cuda_engine.post("/resume_memory_occupation", json={"tags": ["weights"]}).status_code == 200
    body = {
        "serialized_named_tensors": [str(writer.path)],
        "load_format": weight_file.LOAD_FORMAT,
        "weight_version": "2",
    }
    r = cuda_engine.post("/update_weights_from_tensor", json=body)
    assert r.status_code == 200, r.text
    assert cuda_engine.post("/resume_memory_occupation", json={}).status_code == 200
    for name, tensor in named:
        got = cuda_engine.post("/get_weights_by_name", json={"name": name, "truncate_size": 10**6}).json()
        assert torch.equal(torch.tensor(got, dtype=torch.float32), tensor), name


# What SGLang's scheduler does with a payload: decode, unpickle (torch's reductions map the
# CUDA IPC handles), and read the tensors. Here it checks them against the values sent.
_SGLANG_SIDE = """
import base64, io, sys, torch, torch.multiprocessing
from multiprocessing.reduction import ForkingPickler
from rlmesh.common.model_building import build_hf_model
payload, expected = sys.argv[1], torch.load(sys.argv[2], weights_only=True)
named = ForkingPickler.loads(base64.b64decode(payload))
assert [n for n, _ in named] == list(expected), [n for n, _ in named]
for name, t in named:
    assert t.is_cuda, name
    assert torch.equal(t.cpu(), expected[name]), name
print("ok", len(named))
"""


def test_a_colocated_update_over_cuda_ipc_in_sglangs_format_is_bit_exact(tmp_path):
    g = torch.Generator(device="cuda").manual_seed(0)
    named = [
        ("model.embed_tokens.weight", torch.randn(64, 32, device="cuda", generator=g)),
        ("model.norm.weight", torch.randn(32, device="cuda", generator=g).bfloat16()),
        ("lm_head.weight", torch.randn(64, 32, device="cuda", generator=g)[:, :16]),  # a view: its own offset
    ]
    torch.save({n: t.cpu() for n, t in named}, tmp_path / "expected.pt")
    (payload,) = sglang_payload(named, tp_size=1)
    torch.cuda.synchronize()
    proc = subprocess.run(
        [sys.executable, "-c", _SGLANG_SIDE, payload, str(tmp_path / "expected.pt")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and proc.stdout.startswith("ok 3"), proc.stdout + proc.stderr[-3000:]


def test_the_engine_names_its_gpu_so_the_trainer_sends_no_nccl_push_to_its_own(cuda_engine):
    # (NCCL refuses two ranks on one GPU: a single-GPU machine's weights go over gloo)
    assert cuda_engine.get("/get_server_info").json()[GPU_KEY] == gpu_uuid("cuda")
