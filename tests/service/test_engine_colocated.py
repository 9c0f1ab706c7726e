"""The reference engine's colocated-mode routes over real HTTP: memory released and resumed
(SGLang's /release_memory_occupation and /resume_memory_occupation, with tags), and updates
in place from an rlmesh weight file (/update_weights_from_tensor); bad files, paths outside
the engine's weight_file_dir and SGLang's pickled format are refused with a message."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from rlmesh.common import weight_file
from rlmesh.common.auth import client_headers
from rlmesh.engine.config import Settings
from rlmesh.engine.server import start
from tests.helpers.weight_group import in_background

LONG = {"max_new_tokens": 100_000, "ignore_eos": True, "temperature": 0}


@pytest.fixture
def shm_dir(tmp_path) -> Path:
    return tmp_path / "shm"


@pytest.fixture
def client(loop_thread, tiny_model_dir, shm_dir):
    settings = Settings(
        model_path=str(tiny_model_dir), num_threads=1, max_batch_size=8, seed=0, weight_file_dir=str(shm_dir)
    )
    server, port = loop_thread.run(start(settings))
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60, headers=client_headers()) as c:
        yield c
    loop_thread.run(server.stop())


def _trained(tiny_model_dir: Path, shift: float) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, moved: weights no engine holds yet."""
    tensors = load_file(str(next(tiny_model_dir.glob("*.safetensors"))))
    return [(n, t + shift) for n, t in tensors.items()]


def _update(client: httpx.Client, path: Path | str, version: str, **extra) -> httpx.Response:
    body = {
        "serialized_named_tensors": [str(path)],
        "load_format": weight_file.LOAD_FORMAT,
        "weight_version": version,
        "flush_cache": True,
        **extra,
    }
    return client.post("/update_weights_from_tensor", json=body)


def _weights(client: httpx.Client, name: str) -> torch.Tensor:
    r = client.post("/get_weights_by_name", json={"name": name, "truncate_size": 100_000})
    assert r.status_code == 200, r.text
    return torch.tensor(r.json())


def _version(client: httpx.Client) -> str:
    return client.get("/get_model_info").json()["weight_version"]


def test_update_in_place_from_a_weight_file_is_bit_exact(client, tiny_model_dir, shm_dir):
    assert client.get("/get_server_info").json()["rlmesh_weight_file"] == weight_file.FORMAT
    named = _trained(tiny_model_dir, 0.25)
    writer = weight_file.Writer(shm_dir / "run.rlmw")
    writer.write(named)
    r = _update(client, writer.path, "3")
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert _version(client) == "3"
    for name, tensor in named[:4]:
        assert torch.equal(_weights(client, name), tensor), name
    # The engine's weights are now the file's pages (no copy), and it holds the file: the next
    # push goes to another file and leaves the engine's weights as they are until its update.
    first = writer.path
    moved = [(n, t - 1) for n, t in named]
    writer.write(moved)
    assert writer.path != first
    assert torch.equal(_weights(client, named[0][0]), named[0][1])
    assert _update(client, writer.path, "4").status_code == 200
    assert torch.equal(_weights(client, moved[0][0]), moved[0][1])
    out = client.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2}}).json()
    assert out["meta_info"]["weight_version"] == "4"
    # The update let the first file go: the push after that rewrites it (in place), and again
    # the engine's weights stay put until they are updated.
    writer.write(named)
    assert writer.path == first
    assert torch.equal(_weights(client, moved[0][0]), moved[0][1])
    assert _update(client, writer.path, "5").status_code == 200
    assert all(torch.equal(_weights(client, n), t) for n, t in named[:4])
    # A release drops the weights, and the file with them.
    assert client.post("/release_memory_occupation", json={"tags": ["weights"]}).status_code == 200
    writer.write(moved)
    assert writer.path == first


def test_release_holds_generation_until_resumed_and_weights_come_back_by_update(client, tiny_model_dir, shm_dir):
    r = client.post("/release_memory_occupation", json={"tags": None})
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert _version(client) == "released"  # the weights are gone: no version holds
    held = in_background(client.post, "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    time.sleep(0.3)
    assert not held.done()
    assert client.post("/resume_memory_occupation", json={"tags": ["weights"]}).status_code == 200
    time.sleep(0.3)
    assert not held.done()  # the KV cache is still released
    # An update after a release must carry every parameter (nothing else holds them now).
    named = _trained(tiny_model_dir, 0.5)
    writer = weight_file.Writer(shm_dir / "run.rlmw")
    writer.write(named[:3])
    partial = _update(client, writer.path, "7")
    assert partial.status_code == 400 and "every parameter" in partial.json()["message"]
    writer.write(named)
    assert _update(client, writer.path, "7").status_code == 200
    assert client.post("/resume_memory_occupation", json={}).status_code == 200  # no tags: all
    out = held.result(30).json()
    assert out["meta_info"]["weight_version"] == "7"
    assert all(torch.equal(_weights(client, n), t) for n, t in named)


def test_resumed_weights_are_not_sampled_until_an_update_carries_them_all(client, tiny_model_dir):
    assert client.post("/release_memory_occupation", json={"tags": None}).status_code == 200
    held = in_background(client.post, "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert client.post("/resume_memory_occupation", json={}).status_code == 200
    # Resumed memory holds nothing: a clear 503 (a caller retries), never noise or a 500.
    for answer in (held.result(30), client.post("/generate", json={"text": "hi"})):
        assert answer.status_code == 503, answer.text
        assert "full weight update" in answer.json()["error"]["message"]
    assert client.get("/health_generate").status_code == 503
    # Any update carrying every parameter brings it back (here the checkpoint, from disk).
    loaded = client.post("/update_weights_from_disk", json={"model_path": str(tiny_model_dir), "weight_version": "8"})
    assert loaded.status_code == 200, loaded.text
    out = client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert out.status_code == 200 and out.json()["meta_info"]["weight_version"] == "8"
    assert client.get("/health_generate").status_code == 200


def test_release_is_refused_while_requests_run_and_tags_are_checked(client):
    running = in_background(client.post, "/generate", json={"text": "go", "sampling_params": LONG})
    while client.post("/flush_cache", json={}).status_code != 400:  # (400 while requests are in flight)
        time.sleep(0.01)
    busy = client.post("/release_memory_occupation", json={"tags": ["kv_cache"]})
    assert busy.status_code == 400 and "in flight" in busy.json()["message"]
    client.post("/abort_request", json={"abort_all": True})
    running.result(30)
    bad = client.post("/release_memory_occupation", json={"tags": ["gpu"]})
    assert bad.status_code == 400 and "unknown tag" in bad.json()["message"]
    assert client.post("/resume_memory_occupation", json={"tags": "weights"}).status_code == 400
    # Resuming what was never released is harmless (callers resume to be sure).
    assert client.post("/resume_memory_occupation", json={"tags": ["weights", "kv_cache"]}).status_code == 200
    ok = client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200


def test_bad_weight_files_and_formats_are_refused(client, tiny_model_dir, shm_dir, tmp_path):
    named = _trained(tiny_model_dir, 1.0)
    outside = weight_file.Writer(tmp_path / "elsewhere.rlmw")
    outside.write(named)
    r = _update(client, outside.path, "9")
    assert r.status_code == 400 and "not under" in r.json()["message"]
    shm_dir.mkdir(parents=True, exist_ok=True)
    escape = shm_dir / "link.rlmw"
    escape.symlink_to(outside.path)
    assert "not under" in _update(client, escape, "9").json()["message"]
    garbage = shm_dir / "garbage.rlmw"
    garbage.write_bytes(b"\x80\x04" + b"\0" * 100)  # a pickle's opening bytes
    r = _update(client, garbage, "9")
    assert r.status_code == 400 and "not an rlmesh weight file" in r.json()["message"]
    missing = _update(client, shm_dir / "missing.rlmw", "9")
    assert missing.status_code == 400 and "does not exist" in missing.json()["message"]
    wrong_shape = weight_file.Writer(shm_dir / "shape.rlmw")
    wrong_shape.write([("model.norm.weight", torch.zeros(3))])
    r = _update(client, wrong_shape.path, "9")
    assert r.status_code == 400 and "shape mismatch" in r.json()["message"]
    sglang = _update(client, "gASVAAAA", "9", load_format=None)
    assert sglang.status_code == 400 and "pickled" in sglang.json()["message"]
    assert client.post("/update_weights_from_tensor", json={"load_format": weight_file.LOAD_FORMAT}).status_code == 400
    assert _version(client) == "default"  # nothing was applied
