"""The CPU reference engine as its own process, as `rlmesh serve engine` runs it: SIGTERM
answers what is in flight, and weight updates arrive from a real gloo group (this test
process plays the trainer, rank 0; one process cannot hold both ends of a group)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
import torch

from rlmesh.cli.launcher import http_ready, wait_until_ready
from rlmesh.common.auth import client_headers
from rlmesh.common.net import free_port
from rlmesh.common.weight_group import destroy_weight_group
from tests.helpers.engine import LONG, wait_until_in_flight
from tests.helpers.weight_group import WeightSender, in_background, join_body

_ENGINE_MAIN = (
    "import asyncio, logging, sys\n"
    "logging.basicConfig(level=logging.INFO)\n"
    "from rlmesh.engine.config import Settings\n"
    "from rlmesh.engine.server import serve\n"
    "asyncio.run(serve(Settings(model_path=sys.argv[1], port=int(sys.argv[2]), num_threads=1, seed=0,\n"
    "                           context_length=1_000_000)))\n"
)


def _launch_engine(model_dir: Path, log_path: Path) -> tuple[subprocess.Popen, str]:
    """`serve(settings)` in its own process, as `rlmesh serve engine` runs it."""
    port = free_port()
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-c", _ENGINE_MAIN, str(model_dir), str(port)],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(lambda: http_ready(url), proc, "the reference engine", timeout=120)
    except RuntimeError as e:
        proc.kill()
        pytest.fail(f"{e}:\n{log_path.read_text()}")
    return proc, url


@pytest.fixture(scope="module")
def engine_process(tiny_model_dir, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("engine") / "engine.log"
    proc, url = _launch_engine(tiny_model_dir, log_path)
    yield url
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, log_path.read_text()


def test_sigterm_answers_in_flight_requests_with_their_partial_output(tiny_model_dir, tmp_path):
    proc, url = _launch_engine(tiny_model_dir, tmp_path / "engine.log")
    try:
        with httpx.Client(base_url=url, timeout=60, headers=client_headers()) as client:
            pending = in_background(client.post, "/generate", json={"text": "go", "sampling_params": LONG})
            wait_until_in_flight(client)
            proc.send_signal(signal.SIGTERM)
            response = pending.result(60)
        assert response.status_code == 200
        assert response.json()["meta_info"]["finish_reason"]["type"] == "abort"
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def _new_weights(hf_model, seed: int, dtype: torch.dtype = torch.float32) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(n, (torch.randn(p.shape, generator=gen) * 0.05).to(dtype)) for n, p in hf_model.named_parameters()]


def _assert_engine_has(client: httpx.Client, named: list[tuple[str, torch.Tensor]]) -> None:
    for name, tensor in named:
        got = client.post("/get_weights_by_name", json={"name": name, "truncate_size": 100_000}).json()
        assert got == tensor.float().tolist(), name


@pytest.mark.parametrize("flattened", [False, True], ids=["per-tensor", "flattened_bucket"])
def test_update_weights_from_distributed(engine_process, hf_model, flattened):
    with httpx.Client(base_url=engine_process, timeout=60, headers=client_headers()) as client:
        assert client.post("/begin_weight_update", json={"selector": "all"}).json()["success"] is True
        trainer = WeightSender(client, f"wu-{'flat' if flattened else 'plain'}")
        version = f"v-{flattened}"
        named = _new_weights(hf_model, seed=1 + flattened)
        r = trainer.send(named, version, flattened=flattened)
        assert r.status_code == 200 and r.json()["success"] is True, r.text
        assert client.post("/end_weight_update", json={}).json()["success"] is True
        _assert_engine_has(client, named)
        assert client.get("/get_model_info").json()["weight_version"] == version
        out = client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 3}}).json()
        assert out["meta_info"]["weight_version"] == version
        trainer.close()


def test_bad_weight_update_is_refused_and_changes_nothing(engine_process, hf_model):
    with httpx.Client(base_url=engine_process, timeout=60, headers=client_headers()) as client:
        trainer = WeightSender(client, "wu-bad")
        good = _new_weights(hf_model, seed=5)
        assert trainer.send(good, "good").json()["success"] is True
        bad = [(good[0][0], torch.zeros(good[0][1].shape)), ("model.no_such.weight", torch.zeros(3))]
        r = trainer.send(bad, "bad")
        assert r.status_code == 400 and r.json()["success"] is False
        assert "model.no_such.weight" in r.json()["message"]
        _assert_engine_has(client, good[:1])
        assert client.get("/get_model_info").json()["weight_version"] == "good"
        # bfloat16 on the wire is converted into the float32 model.
        halves = [(n, t.to(torch.bfloat16)) for n, t in _new_weights(hf_model, seed=6)[:2]]
        assert trainer.send(halves, "bf16", flattened=True).json()["success"] is True
        _assert_engine_has(client, halves)
        trainer.close()
        again = client.post("/destroy_weights_update_group", json={"group_name": "wu-bad"})
        assert again.status_code == 400 and again.json()["success"] is False
        missing = client.post(
            "/update_weights_from_distributed",
            json={"names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "wu-bad"},
        )
        assert missing.status_code == 400 and "init_weights_update_group" in missing.json()["message"]


# Rank 0 in its own process: joins, sends the first tensor of a bucket, and dies.
_DYING_TRAINER = (
    "import os, sys, torch\n"
    "from rlmesh.common.weight_group import init_weight_group\n"
    "group = init_weight_group('gloo', '127.0.0.1', int(sys.argv[1]), 2, 0, sys.argv[2], timeout_seconds=60)\n"
    "torch.distributed.broadcast(torch.ones([int(d) for d in sys.argv[3:]]), src=0, group=group)\n"
    "os._exit(0)\n"
)


def test_a_push_whose_trainer_died_part_way_frees_its_group(engine_process, hf_model):
    """The trainer dies between two tensors of a bucket: the engine's update fails, and the
    engine frees the group then instead of holding it until it exits; the next push, in a
    new group of the same name, lands."""
    with httpx.Client(base_url=engine_process, timeout=60, headers=client_headers()) as client:
        port, name = free_port(), "wu-cut"
        (first, first_param), (second, second_param) = list(hf_model.named_parameters())[:2]
        dying = subprocess.Popen(
            [sys.executable, "-c", _DYING_TRAINER, str(port), name, *map(str, first_param.shape)],
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
        )
        try:
            joined = client.post(
                "/init_weights_update_group",
                json=join_body(port, name),
            )
            assert joined.json()["success"] is True, joined.text
            cut = client.post(
                "/update_weights_from_distributed",
                json={
                    "names": [first, second],
                    "dtypes": ["float32"] * 2,
                    "group_name": name,
                    "shapes": [list(first_param.shape), list(second_param.shape)],
                },
            )
            assert dying.wait(timeout=60) == 0
            assert cut.status_code == 400 and "receiving the broadcast failed" in cut.json()["message"], cut.text
            freed = client.post("/destroy_weights_update_group", json={"group_name": name})
            assert freed.status_code == 400 and "does not exist" in freed.json()["message"]
        finally:
            dying.kill()  # (a no-op once it has exited)
        again = WeightSender(client, name)
        named = _new_weights(hf_model, seed=8)
        assert again.send(named, "after-the-cut").json()["success"] is True
        _assert_engine_has(client, named[:2])
        again.close()


def test_the_weight_group_rendezvous_is_the_one_sglang_clients_use(engine_process, hf_model):
    """slime, AReaL, OpenRLHF and SkyRL build rank 0 with torch's `tcp://` rendezvous,
    whose store waits until every rank has checked in: the engine must check in."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    with httpx.Client(base_url=engine_process, timeout=60, headers=client_headers()) as client:
        port, group_name = free_port(), "sglang-style"
        joined = in_background(
            client.post,
            "/init_weights_update_group",
            json=join_body(port, group_name),
        )
        timeout = timedelta(seconds=30)
        store, rank, world_size = next(rendezvous(f"tcp://127.0.0.1:{port}", 0, 2, timeout=timeout))
        store.set_timeout(timeout)
        group, _ = _new_process_group_helper(
            world_size,
            rank,
            [],
            Backend("gloo"),
            PrefixStore(group_name, store),
            group_name=group_name,
            timeout=timeout,
            backend_options=None,
        )
        _world.pg_group_ranks[group] = {0: 0, 1: 1}
        r = joined.result(60)
        assert r.status_code == 200 and r.json()["success"] is True, r.text

        name, tensor = _new_weights(hf_model, seed=11)[0]
        answer = in_background(
            client.post,
            "/update_weights_from_distributed",
            json={
                "names": [name],
                "dtypes": ["float32"],
                "shapes": [list(tensor.shape)],
                "group_name": group_name,
                "weight_version": "sglang-style",
            },
        )
        torch.distributed.broadcast(tensor, src=0, group=group)
        assert answer.result(60).json()["success"] is True
        _assert_engine_has(client, [(name, tensor)])
        assert client.get("/get_weight_version").json() == {"weight_version": "sglang-style"}
        assert client.post("/destroy_weights_update_group", json={"group_name": group_name}).json()["success"] is True
        destroy_weight_group(group, group_name)
