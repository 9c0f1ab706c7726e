"""The trainer service across the ranks of a torchrun job (data_parallel 'fsdp2'):

    torchrun --nproc_per_node N -m rlmesh.cli serve trainer --port 50054 ...

Rank 0 serves gRPC exactly as a one-process trainer does; its backend is a LeaderBackend,
which tells the other ranks what to do before doing it itself. Ranks 1..N-1 serve
nothing: they `follow`, building the same TorchBackend and taking part in every step,
weight gather and shutdown. Commands travel over a gloo group of their own as bytes: a
JSON header and the batch as protobuf SampleGroup messages (no pickle). Every rank runs
the same code on the same input, so a bad batch or config fails alike on every rank,
before any collective, and the ranks stay in step.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from rlmesh.common.run_config import TrainerRunConfig
from rlmesh.common.sample import SampleGroup, group_from_proto, group_to_proto
from rlmesh.trainer.backend import CheckpointSnapshot, TorchBackend
from rlmesh.v1 import sample_pb2

log = logging.getLogger(__name__)

# Followers wait for rank 0's next command however long the run idles between calls.
COMMAND_TIMEOUT = timedelta(days=30)


def in_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init_ranks(device: str) -> dist.ProcessGroup:
    """The job's default group (the model's collectives: nccl on GPU, gloo on CPU) and a
    gloo group for commands; returns the latter."""
    cuda = device != "cpu" and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    return dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)


class _Channel:
    """Rank 0 -> all: a JSON header and a list of byte strings, as one uint8 tensor."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def send(self, header: dict, parts: Sequence[bytes] = ()) -> None:
        head = json.dumps({**header, "sizes": [len(p) for p in parts]}).encode()
        blob = len(head).to_bytes(8, "little") + head + b"".join(parts)
        self._broadcast(blob)

    def receive(self) -> tuple[dict, list[bytes]]:
        blob = self._broadcast(None)
        n = int.from_bytes(blob[:8], "little")
        header = json.loads(blob[8 : 8 + n])
        parts, at = [], 8 + n
        for size in header.pop("sizes"):
            parts.append(blob[at : at + size])
            at += size
        return header, parts

    def _broadcast(self, blob: bytes | None) -> bytes:
        length = torch.tensor([len(blob) if blob is not None else 0], dtype=torch.int64)
        dist.broadcast(length, src=0, group=self.group)
        data = (torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob is not None
                else torch.empty(int(length), dtype=torch.uint8))
        if int(length):
            dist.broadcast(data, src=0, group=self.group)
        return bytes(data.numpy()) if blob is None else blob


def _encode(groups: Sequence[SampleGroup]) -> list[bytes]:
    return [group_to_proto(g).SerializeToString() for g in groups]


def _decode(parts: Sequence[bytes]) -> list[SampleGroup]:
    groups = []
    for part in parts:
        msg = sample_pb2.SampleGroup()
        msg.ParseFromString(part)
        groups.append(group_from_proto(msg))
    return groups


class LeaderBackend:
    """Rank 0's backend: each call that the ranks make together is announced first."""

    def __init__(self, channel: _Channel, config: TrainerRunConfig, device: torch.device, mixed_precision: bool = True,
                 resume_from: Path | None = None) -> None:
        self._channel = channel
        channel.send({"op": "init", "config": config.model_dump_json(), "device": str(device),
                      "mixed_precision": mixed_precision, "resume": str(resume_from) if resume_from else None})
        self._local = TorchBackend(config, device, mixed_precision, resume_from)

    def __getattr__(self, name: str):  # step, vocab_size, resumed_state, ... of the local backend
        return getattr(self._local, name)

    def train_step(self, groups: Sequence[SampleGroup]) -> dict[str, float]:
        self._channel.send({"op": "train"}, _encode(groups))
        return self._local.train_step(groups)

    def sft_step(self, groups: Sequence[SampleGroup]) -> dict[str, float]:
        self._channel.send({"op": "sft"}, _encode(groups))
        return self._local.sft_step(groups)

    def state_dict_for_sync(self) -> Iterator[tuple[str, Tensor]]:
        self._channel.send({"op": "sync"})
        return iter(list(self._local.state_dict_for_sync()))  # gathered now, with the other ranks

    def save_weights(self, path: Path) -> Path:
        self._channel.send({"op": "save_weights"})
        return self._local.save_weights(path)

    def snapshot(self) -> CheckpointSnapshot:
        self._channel.send({"op": "snapshot"})
        return self._local.snapshot()

    def close(self) -> None:
        self._channel.send({"op": "close"})
        self._local.close()


def leader_factory(group: dist.ProcessGroup):
    """Trainer(backend_factory=...) for rank 0."""
    channel = _Channel(group)

    def make(config: TrainerRunConfig, device: torch.device, mixed_precision: bool = True,
             resume_from: Path | None = None) -> LeaderBackend:
        return LeaderBackend(channel, config, device, mixed_precision, resume_from)

    return make


def follow(group: dist.ProcessGroup) -> None:
    """Ranks 1..N-1: do what rank 0 announces, until it shuts down. An error is logged and
    the rank waits for the next command: rank 0 met the same error on the same input."""
    channel = _Channel(group)
    backend: TorchBackend | None = None
    log.info("rank %d follows rank 0", dist.get_rank())
    while True:
        header, parts = channel.receive()
        op = header["op"]
        try:
            if op == "shutdown":
                return
            if op == "init":
                config = TrainerRunConfig.model_validate_json(header["config"])
                device = torch.device(header["device"])
                resume = Path(header["resume"]) if header["resume"] else None
                backend = TorchBackend(config, device, header["mixed_precision"], resume)
            elif backend is None:
                log.error("rank %d: %r before any run was set up", dist.get_rank(), op)
            elif op == "train":
                backend.train_step(_decode(parts))
            elif op == "sft":
                backend.sft_step(_decode(parts))
            elif op == "sync":
                for _ in backend.state_dict_for_sync():
                    pass
            elif op == "save_weights":  # rank 0 writes; this rank only helps gather
                backend.save_weights(Path("."))
            elif op == "snapshot":
                backend.snapshot()
            elif op == "close":
                backend.close()
                backend = None
        except Exception:
            log.exception("rank %d: %s failed (as on rank 0)", dist.get_rank(), op)


def shutdown(group: dist.ProcessGroup) -> None:
    """Rank 0, on its way out: release the followers (those still there)."""
    try:
        _Channel(group).send({"op": "shutdown"})
    except RuntimeError as e:
        log.warning("the other ranks could not be told to shut down (already gone?): %s", e)
