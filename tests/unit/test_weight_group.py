"""The weight group's rendezvous store listens on the configured interface only (torch's
store alone would listen on every interface), and its backend never asks NCCL for two ranks
on one GPU."""

from __future__ import annotations

import socket

import pytest
import torch

from rlmesh.common.errors import FailedPrecondition
from rlmesh.common.weight_group import rendezvous_socket
from rlmesh.trainer.weight_sync import group_backend
from rlmesh.v1 import rollout_pb2


def test_the_rendezvous_listens_on_the_configured_interface_only():
    port, fd = rendezvous_socket("127.0.0.1")
    with socket.socket(fileno=fd) as sock:
        assert sock.getsockname() == ("127.0.0.1", port)


def test_an_address_of_another_machine_is_a_clear_error():
    with pytest.raises(OSError, match="weight_sync_bind_address"):
        rendezvous_socket("192.0.2.1")  # TEST-NET-1: never an address of this machine


def _engines(*gpus: str) -> list[rollout_pb2.EngineInfo]:
    return [rollout_pb2.EngineInfo(url=f"http://engine-{i}", gpu_uuid=g) for i, g in enumerate(gpus)]


def test_auto_is_gloo_on_cpu_and_nccl_between_gpus(monkeypatch):
    assert group_backend("auto", "", _engines("")) == ("gloo", "")
    with pytest.raises(FailedPrecondition, match="'nccl' needs the trainer on a GPU.*'auto'"):
        group_backend("nccl", "", _engines(""))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # (a fake: no GPU here)
    assert group_backend("auto", "GPU-a", _engines("GPU-b", "")) == ("nccl", "")


def test_an_engine_on_the_trainers_own_gpu_gets_gloo_or_a_clear_refusal(monkeypatch):
    # NCCL refuses two ranks of one group on one GPU ("Duplicate GPU detected"): on a
    # single-GPU machine the distributed push would never land.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # (a fake: no GPU here)
    backend, warning = group_backend("auto", "GPU-a", _engines("GPU-b", "GPU-a"))
    assert backend == "gloo" and "http://engine-1" in warning and "colocated" in warning
    with pytest.raises(FailedPrecondition, match="engine-1: it runs on the trainer.s own GPU.*colocated"):
        group_backend("nccl", "GPU-a", _engines("GPU-b", "GPU-a"))
    assert group_backend("gloo", "GPU-a", _engines("GPU-a")) == ("gloo", "")
