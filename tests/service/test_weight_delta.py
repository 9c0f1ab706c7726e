"""Delta weight pushes (weight_sync.delta): only the elements whose bits changed travel,
to real reference-engine processes over a real gloo group through the real rollout
service, and the engines end up holding exactly what a full push gives them."""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from rlmesh.common.auth import client_headers
from rlmesh.common.grpc_server import sync_channel
from rlmesh.common.model_building import build_hf_model
from rlmesh.common.run_config import WeightSyncConfig
from rlmesh.common.weight_group import WEIGHT_DELTA_FORMAT
from rlmesh.engine.weights import ReceivedDelta, TensorPool, TensorSpec, WeightUpdateError, apply_delta, parse_delta
from rlmesh.rollout.config import Settings as RolloutSettings
from rlmesh.rollout.server import start as start_rollout
from rlmesh.trainer.weight_sync import WeightPusher, changed_elements, delta_payload
from rlmesh.v1 import rollout_pb2
from rlmesh.v1.rollout_pb2_grpc import RolloutStub
from tests.helpers.trainer import EngineProcess
from tests.helpers.weight_group import WeightSender

BF16 = torch.bfloat16
SYNC = WeightSyncConfig(backend="gloo", bucket_bytes=64 * 1024, delta=True)


@pytest.fixture(scope="module")
def bf16_engine(tiny_model_dir, tmp_path_factory):
    process = EngineProcess(tiny_model_dir, tmp_path_factory.mktemp("engine") / "bf16.log", ("--dtype", "bfloat16"))
    yield process
    process.stop()


@pytest.fixture(scope="module")
def full_only_engine(tiny_model_dir, tmp_path_factory):
    """An engine without delta updates, as SGLang is."""
    process = EngineProcess(tiny_model_dir, tmp_path_factory.mktemp("engine") / "full.log", ("--no-weight-delta",))
    yield process
    process.stop()


@contextlib.contextmanager
def rollout(loop_thread, *engines: EngineProcess):
    server, port = loop_thread.run(start_rollout(RolloutSettings(port=0, engine_urls=[e.url for e in engines])))
    try:
        yield f"127.0.0.1:{port}"
    finally:
        loop_thread.run(server.stop(None))


def trainer_weights(model_dir) -> list[tuple[str, torch.Tensor]]:
    """float32 weights as a trainer holds them (pushed as bfloat16)."""
    model = build_hf_model(AutoModelForCausalLM.from_pretrained, model_dir, dtype=torch.float32)
    return [(n, p.detach().clone()) for n, p in model.named_parameters()]


def nudge(weights, fraction: float, seed: int) -> None:
    """What an optimizer step does to a bf16 view: a few elements move by more than a
    bf16 step, most by far less (their bf16 bits stay)."""
    generator = torch.Generator().manual_seed(seed)
    for _, t in weights:
        t.add_(1e-7)
        picked = torch.rand(t.shape, generator=generator) < fraction
        t[picked] *= 1.05


def assert_engine_holds(engine: EngineProcess, weights) -> None:
    """Bit for bit what a full bfloat16 push of `weights` gives (the engine's values
    come back as float32, which holds every bfloat16 exactly, -0.0 included)."""
    for name, t in weights:
        held = engine.tensor(name).to(BF16).view(torch.int16)
        assert torch.equal(held, t.to(BF16).view(torch.int16)), name


def push(loop_thread, pusher: WeightPusher, weights, version: int, sync: WeightSyncConfig = SYNC):
    return loop_thread.run(pusher.push_distributed(weights, version, sync, wire_dtype=BF16))


def test_changed_elements_compares_bits():
    old = torch.tensor([0.0, 1.0, float("nan"), 2.0], dtype=BF16)
    new = torch.tensor([-0.0, 1.0, float("nan"), 2.5], dtype=BF16)
    assert changed_elements(new, old).tolist() == [0, 3]  # -0.0 is a change, the same NaN is not


def test_delta_payload_holds_indices_then_values():
    flat = torch.arange(10, dtype=BF16)
    payload, index_dtype = delta_payload(flat, torch.tensor([2, 7]))
    assert index_dtype == "int32" and payload.dtype == torch.uint8 and payload.numel() == 2 * 4 + 2 * 2
    assert payload[:8].view(torch.int32).tolist() == [2, 7]
    assert payload[8:].view(BF16).tolist() == [2.0, 7.0]


def test_engine_applies_a_delta_only_over_its_base_version():
    model = torch.nn.Linear(3, 2, bias=False).to(BF16)
    before = model.weight.detach().clone()
    specs = [TensorSpec("weight", BF16, (2, 3))]
    delta = ReceivedDelta(specs, torch.tensor([1, 5]), torch.tensor([7.0, 9.0], dtype=BF16), base_version="3")
    with pytest.raises(WeightUpdateError, match="applies to weight version '3' but the engine holds '4'"):
        apply_delta(model, delta, "4")
    assert torch.equal(model.weight, before)  # nothing changed
    assert apply_delta(model, delta, "3") == 2
    expected = before.reshape(-1).clone()
    expected[[1, 5]] = torch.tensor([7.0, 9.0], dtype=BF16)
    assert torch.equal(model.weight.reshape(-1), expected)


def test_engine_checks_a_delta_announcement():
    specs = [TensorSpec("a", BF16, (2, 3)), TensorSpec("b", BF16, (4,))]
    assert parse_delta({"count": 10, "index_dtype": "int32", "base_version": "7"}, specs).count == 10
    for bad, message in [
        ({"count": 11, "index_dtype": "int32", "base_version": "7"}, r"count must be an integer in \[0, 10\]"),
        ({"count": 1, "index_dtype": "float32", "base_version": "7"}, "index_dtype must be one of"),
        ({"count": 1, "index_dtype": "int64", "base_version": ""}, "base_version must name"),
        ([1], "must be an object"),
    ]:
        with pytest.raises(WeightUpdateError, match=message):
            parse_delta(bad, specs)
    with pytest.raises(WeightUpdateError, match="one dtype"):
        parse_delta(
            {"count": 1, "index_dtype": "int32", "base_version": "7"}, [*specs, TensorSpec("c", torch.float32, (1,))]
        )


@pytest.mark.slow
def test_delta_pushes_are_bit_exact_and_fall_back_to_full(loop_thread, bf16_engine, tiny_model_dir):
    weights = trainer_weights(tiny_model_dir)
    numel = sum(t.numel() for _, t in weights)
    with rollout(loop_thread, bf16_engine) as address:
        pusher = WeightPusher(address, "r-delta", timeout_seconds=60)
        try:
            first = push(loop_thread, pusher, weights, 1)  # nothing to compare with yet
            assert first.delta_buckets == 0 and first.bytes == numel * 2 and first.buckets > 1

            nudge(weights, 0.01, seed=1)
            delta = push(loop_thread, pusher, weights, 2)
            assert delta.delta_buckets == delta.buckets and 0 < delta.bytes < 0.1 * first.bytes
            assert bf16_engine.weight_version() == "2"
            assert_engine_holds(bf16_engine, weights)

            unchanged = push(loop_thread, pusher, weights, 3)  # only the last bucket goes, for the version
            assert unchanged.bytes == 0 and bf16_engine.weight_version() == "3"

            for _, t in weights:  # most elements change: whole buckets are cheaper
                t.add_(0.01)
            large = push(loop_thread, pusher, weights, 4)
            assert large.delta_buckets == 0 and large.bytes == first.bytes
            assert_engine_holds(bf16_engine, weights)

            # The engines report another version than the trainer pushed (someone else
            # updated them): no delta against what they hold, a full push in a new group.
            pusher._group.version = "5"
            nudge(weights, 0.01, seed=2)
            recovered = push(loop_thread, pusher, weights, 6)
            assert recovered.delta_buckets == 0 and recovered.bytes == first.bytes
            assert_engine_holds(bf16_engine, weights)

            bf16_engine.restart()  # back at its checkpoint's weights: no base for a delta
            nudge(weights, 0.01, seed=3)
            restarted = push(loop_thread, pusher, weights, 7)
            assert restarted.delta_buckets == 0 and restarted.bytes == first.bytes
            nudge(weights, 0.01, seed=4)
            assert push(loop_thread, pusher, weights, 8).delta_buckets > 0
            assert_engine_holds(bf16_engine, weights)

            off = push(loop_thread, pusher, weights, 9, SYNC.model_copy(update={"delta": False}))
            assert off.delta_buckets == 0 and off.bytes == first.bytes
        finally:
            loop_thread.run(pusher.close())


@pytest.mark.slow
def test_engines_without_delta_updates_get_full_pushes(loop_thread, bf16_engine, full_only_engine, tiny_model_dir):
    weights = trainer_weights(tiny_model_dir)
    numel = sum(t.numel() for _, t in weights)
    with rollout(loop_thread, bf16_engine, full_only_engine) as address:
        engines = RolloutStub(sync_channel(address)).ListEngines(rollout_pb2.ListEnginesRequest()).engines
        formats = {e.url: e.weight_delta_format for e in engines}
        assert formats == {bf16_engine.url: WEIGHT_DELTA_FORMAT, full_only_engine.url: ""}
        pusher = WeightPusher(address, "r-mixed", timeout_seconds=60)
        try:
            push(loop_thread, pusher, weights, 1)
            nudge(weights, 0.01, seed=5)
            second = push(loop_thread, pusher, weights, 2)
            assert second.delta_buckets == 0 and second.bytes == numel * 2
            for engine in (bf16_engine, full_only_engine):  # the float32 engine holds the bf16 values
                assert engine.weight_version() == "2"
                assert_engine_holds(engine, weights)
        finally:
            loop_thread.run(pusher.close())


def test_engine_recycles_only_whole_tensors_of_the_same_size():
    pool = TensorPool()
    pool.limit_bytes = 64
    spec = TensorSpec("w", BF16, (4, 4))  # 32 bytes
    whole = torch.ones(4, 4, dtype=BF16)
    pool.give(whole[:2])  # a view of a larger storage: never recycled
    pool.give(torch.ones(8, dtype=BF16))  # another size
    pool.give(whole)
    again = pool.take(spec, torch.device("cpu"))
    assert again.data_ptr() == whole.data_ptr() and again.shape == (4, 4) and again.dtype == BF16
    assert pool.take(spec, torch.device("cpu")).data_ptr() != whole.data_ptr()  # none left: fresh memory
    big = torch.ones(64, dtype=BF16)
    pool.give(big)  # more than limit_bytes: dropped
    assert pool.take(TensorSpec("x", BF16, (64,)), torch.device("cpu")).data_ptr() != big.data_ptr()


@pytest.mark.slow
def test_the_engine_applies_a_delta_over_its_base_version_only(bf16_engine):
    """The engine's side of the wire form, driven by hand over HTTP and a gloo group."""
    name = "model.norm.weight"
    with httpx.Client(base_url=bf16_engine.url, timeout=60, headers=client_headers()) as client:
        trainer = WeightSender(client, "wu-delta")
        try:
            old = (torch.randn(64) * 0.05).to(BF16)
            assert trainer.send([(name, old)], "d1").json()["success"] is True
            new = old.clone()
            new[[3, 40]] += 1

            def send_delta(indices: torch.Tensor, base_version: str) -> httpx.Response:
                payload, index_dtype = delta_payload(new, indices)
                body = {
                    "names": [name],
                    "dtypes": ["bfloat16"],
                    "shapes": [[64]],
                    "group_name": "wu-delta",
                    "weight_version": "d2",
                    "rlmesh_delta": {
                        "count": indices.numel(),
                        "index_dtype": index_dtype,
                        "base_version": base_version,
                    },
                }
                with ThreadPoolExecutor(1) as pool:
                    answer = pool.submit(client.post, "/update_weights_from_distributed", json=body)
                    torch.distributed.broadcast(payload, src=0, group=trainer.group)
                    return answer.result(60)

            indices = changed_elements(new, old)
            for bad_indices, base, message in [
                (indices, "d0", "applies to weight version 'd0' but the engine holds 'd1'"),
                (indices.flip(0), "d1", "strictly increasing"),
            ]:
                r = send_delta(bad_indices, base)
                assert r.status_code == 400 and message in r.json()["message"], r.text
                assert bf16_engine.weight_version() == "d1"
                assert_engine_holds(bf16_engine, [(name, old)])  # nothing changed
            assert send_delta(indices, "d1").json()["success"] is True
            assert bf16_engine.weight_version() == "d2"
            assert_engine_holds(bf16_engine, [(name, new)])
        finally:
            trainer.close()
