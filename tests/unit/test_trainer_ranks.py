"""The parts of the trainer's multi-rank plumbing that need no trainer service: commands'
encoding, the refusal of a one-process backend under torchrun, and the ranks' agreement on
each command's outcome over a real 2-process gloo group (the services themselves:
tests/service/test_trainer_megatron_service.py, tests/service/test_trainer_fsdp.py)."""

from __future__ import annotations

import pytest
import torch

from rlmesh.common import errors
from rlmesh.common.run_config import TrainerRunConfig
from rlmesh.trainer import ranks
from tests.helpers.megatron_worker import groups


def test_sample_groups_travel_to_the_followers_as_protobuf_bytes():
    sent = groups()
    args, payload = ranks.encode_groups(sent)
    assert isinstance(payload, bytes) and len(args["sizes"]) == len(sent)
    received = ranks.decode_groups(args, payload)
    assert [g.group_id for g in received] == [g.group_id for g in sent]
    for got, want in zip(received, sent, strict=True):
        assert [(s.tokens, s.response_length, s.reward, s.status, s.loss_mask) for s in got.samples] == [
            (s.tokens, s.response_length, s.reward, s.status, s.loss_mask) for s in want.samples
        ]


def test_the_torch_backend_refuses_a_trainer_started_with_several_ranks(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(
        errors.InvalidArgument,
        match="backend 'torch' without data_parallel runs in one process, but this trainer runs 2 ranks",
    ):
        ranks.open_backend(TrainerRunConfig(model_path=str(tmp_path)), torch.device("cpu"), False, None)


def _agree_on_a_failure(rank: int, init_file: str, results) -> None:
    """One rank of a real 2-process gloo group: rank 1's call fails, rank 0's succeeds."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        commands = ranks.Commands()

        def call():
            if dist.get_rank() == 1:
                raise ValueError("out of memory on this rank")
            return "fine here"

        try:
            results.put((rank, "returned", ranks._run(commands, call)))
        except Exception as e:  # rank 0 is meant to get here
            results.put((rank, type(e).__name__, str(e)))
        # Both ranks are still in step: the next command goes through.
        results.put((rank, "next", ranks._run(commands, lambda: dist.get_rank())))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two processes that import torch: seconds each on a busy machine
def test_a_failure_on_a_follower_is_an_error_on_rank_0_not_a_hang(tmp_path):
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_agree_on_a_failure, args=(r, str(tmp_path / "init"), results)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    got = {(rank, what): value for rank, what, value in (results.get(timeout=5) for _ in range(4))}
    assert got == {
        (0, "RuntimeError"): "the trainer's ranks failed: rank 1: ValueError: out of memory on this rank",
        (1, "returned"): None,  # a follower logs its failure and waits for the next command
        (0, "next"): 0,
        (1, "next"): 1,
    }
