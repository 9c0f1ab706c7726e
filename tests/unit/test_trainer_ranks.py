"""The parts of the trainer's multi-rank plumbing that need no second process (the
processes themselves: tests/service/test_trainer_megatron_service.py)."""

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
    with pytest.raises(errors.InvalidArgument, match="backend 'torch' without data_parallel runs in one process, but this trainer runs 2 ranks"):
        ranks.open_backend(TrainerRunConfig(model_path=str(tmp_path)), torch.device("cpu"), False, None)
