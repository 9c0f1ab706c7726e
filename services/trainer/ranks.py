"""A backend spread over several processes: rank 0 serves gRPC and leads, the others follow.

A parallel backend (megatron TP/PP, or the torch backend with data_parallel 'fsdp2')
needs every rank to run every call with the same arguments. The trainer service is one
gRPC process, so under torchrun (`torchrun --nproc-per-node N -m rlmesh.cli serve
trainer ...`) rank 0 runs the service as usual, with its backend wrapped in a `Leader`:
each call is first announced to the other ranks, which sit in `follow()` and make the
same call on their own backend (they ignore SIGTERM, see server.serve: they leave when
rank 0 says exit, after its graceful shutdown, or when rank 0 is gone).
Commands travel over a gloo group of their own as an op name, JSON arguments and bytes
(sample groups as their protobuf encoding), never pickle. After each command every rank
reports whether it succeeded, so a failure on any rank is an error on rank 0 (the gRPC
caller sees it) rather than a hang.

With one process (no torchrun) nothing here is used beyond `open_backend`.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from rlmesh.common import errors
from rlmesh.common.run_config import TrainerRunConfig
from rlmesh.common.sample import SampleGroup, group_from_proto, group_to_proto
from rlmesh.trainer.backend import TorchBackend
from rlmesh.v1 import sample_pb2

log = logging.getLogger(__name__)

# Followers wait for the next command as long as the service lives (between runs, for
# hours): the command group's collectives must not time out.
IDLE_TIMEOUT = timedelta(days=365)


def world_size() -> int:
    """Processes of this trainer: torchrun's WORLD_SIZE, else 1."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def backend_class(config: TrainerRunConfig) -> type[TorchBackend]:
    if config.backend == "megatron":
        try:
            from rlmesh.trainer.megatron.backend import MegatronBackend
        except ImportError as e:
            raise errors.InvalidArgument(
                f"backend 'megatron' needs megatron-core in the trainer's environment (pip install 'rlmesh[megatron]'): {e}"
            ) from None
        return MegatronBackend
    return TorchBackend


def open_backend(config: TrainerRunConfig, device: torch.device, mixed_precision: bool, resume_from: Path | None):
    """The run's backend; under torchrun, rank 0's Leader of the same backend on every rank."""
    cls = backend_class(config)
    if world_size() == 1:
        return cls(config, device, mixed_precision, resume_from)
    if cls is TorchBackend and config.data_parallel == "none":
        raise errors.InvalidArgument(
            f"backend 'torch' without data_parallel runs in one process, but this trainer runs {world_size()} ranks "
            "(torchrun); use data_parallel 'fsdp2' or backend 'megatron', or start the trainer without torchrun"
        )
    return Leader.start(config, device, mixed_precision, resume_from)


# --------------------------------------------------------------------------------------
# Commands over torch.distributed
# --------------------------------------------------------------------------------------


# The first failure of the command group's own collectives (a peer gone, a broken
# connection): the group cannot be used again, so every later command would fail too. The
# rank's health endpoint reports it (rank_health.py), so that the pod is restarted.
_GROUP_FAILURE = ""


def group_failure() -> str:
    """Why this rank's command group failed ("" while it works)."""
    return _GROUP_FAILURE


def _transport(method):
    """A collective of the command group: a failure of it marks the group failed."""

    @functools.wraps(method)
    def guarded(*args, **kwargs):
        global _GROUP_FAILURE
        try:
            return method(*args, **kwargs)
        except Exception as e:
            _GROUP_FAILURE = _GROUP_FAILURE or f"the ranks' command group failed: {type(e).__name__}: {e}"
            raise

    return guarded


class Commands:
    """Rank 0 -> every rank: (op, JSON args, bytes), then every rank's outcome -> rank 0."""

    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)

    @_transport
    def _broadcast_bytes(self, data: bytes | None) -> bytes:
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.long)
        dist.broadcast(size, src=0, group=self.group)
        buffer = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(int(size), dtype=torch.uint8)
        )
        if int(size):
            dist.broadcast(buffer, src=0, group=self.group)
        return data if data is not None else bytes(buffer.numpy().tobytes())

    def send(self, op: str, args: dict | None = None, payload: bytes = b"") -> None:
        self._broadcast_bytes(json.dumps({"op": op, "args": args or {}}).encode())
        self._broadcast_bytes(payload)

    def receive(self) -> tuple[str, dict, bytes]:
        header = json.loads(self._broadcast_bytes(None))
        return header["op"], header["args"], self._broadcast_bytes(None)

    @_transport
    def outcome(self, error: str = "") -> str:
        """Every rank's error ("" = fine), joined on rank 0 ("" elsewhere)."""
        mine = f"rank {dist.get_rank()}: {error}".encode() if error else b""
        size = torch.tensor([len(mine)], dtype=torch.long)
        sizes = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(sizes, size, group=self.group)
        width = max(int(s) for s in sizes)
        if not width:
            return ""
        padded = torch.zeros(width, dtype=torch.uint8)
        padded[: len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8) if mine else padded[:0]
        parts = [torch.zeros(width, dtype=torch.uint8) for _ in sizes]
        dist.all_gather(parts, padded, group=self.group)
        return "; ".join(
            bytes(p[: int(n)].numpy().tobytes()).decode() for p, n in zip(parts, sizes, strict=True) if int(n)
        )


def encode_groups(groups: Sequence[SampleGroup]) -> tuple[dict, bytes]:
    encoded = [group_to_proto(g).SerializeToString() for g in groups]
    return {"sizes": [len(e) for e in encoded]}, b"".join(encoded)


def decode_groups(args: dict, payload: bytes) -> list[SampleGroup]:
    groups, at = [], 0
    for size in args["sizes"]:
        groups.append(group_from_proto(sample_pb2.SampleGroup.FromString(payload[at : at + size])))
        at += size
    return groups


_COMMANDS: Commands | None = None


def init_ranks(device_type: str = "cpu") -> Commands:
    """torch.distributed for this torchrun process (gloo, and NCCL for CUDA tensors) and the
    command group; once per process, on every rank, before anything else uses them."""
    global _COMMANDS
    if _COMMANDS is None:
        if device_type == "cuda":  # one GPU per rank of the node
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if not dist.is_initialized():
            dist.init_process_group("cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo")
        _COMMANDS = Commands()
    return _COMMANDS


def _run(commands: Commands, call: Callable[[], object]):
    """Run `call` on this rank, then agree with every rank on the outcome: rank 0 raises
    when any rank failed."""
    try:
        result = call()
    except Exception as e:  # reported to rank 0, which raises it to its caller
        if dist.get_rank() != 0:
            log.exception("command failed on this rank")
        failure, error = e, f"{type(e).__name__}: {e}"
    else:
        failure, error = None, ""
    errors_seen = commands.outcome(error)
    if dist.get_rank() == 0 and errors_seen:
        if isinstance(failure, errors.RlmeshError):
            raise failure
        raise RuntimeError(f"the trainer's ranks failed: {errors_seen}")  # INTERNAL, with the message
    return result if failure is None else None


# --------------------------------------------------------------------------------------
# Rank 0 and the others
# --------------------------------------------------------------------------------------


class Leader:
    """Rank 0's backend: every call is announced to the followers, then run here. Other
    attributes (step, vocab_size, resumed_state, ...) are the local backend's."""

    def __init__(self, backend, commands: Commands) -> None:
        self._backend = backend
        self._commands = commands
        self._lock = threading.Lock()  # the ranks must see the calls in one order

    @classmethod
    def start(cls, config: TrainerRunConfig, device: torch.device, mixed_precision: bool, resume_from: Path | None):
        commands = init_ranks(device.type)
        args = {
            "config": config.model_dump(mode="json"),
            "device": str(device),
            "mixed_precision": mixed_precision,
            "resume_from": str(resume_from) if resume_from else None,
        }
        commands.send("init", args)
        backend = _run(commands, lambda: backend_class(config)(config, device, mixed_precision, resume_from))
        return cls(backend, commands)

    def __getattr__(self, name: str):
        return getattr(self._backend, name)

    def _call(self, op: str, call: Callable[[], object], args: dict | None = None, payload: bytes = b""):
        with self._lock:
            self._commands.send(op, args, payload)
            return _run(self._commands, call)

    def train_step(self, groups: Sequence[SampleGroup]) -> dict[str, float]:
        return self._call("train_step", lambda: self._backend.train_step(groups), *encode_groups(groups))

    def sft_step(self, groups: Sequence[SampleGroup]) -> dict[str, float]:
        return self._call("sft_step", lambda: self._backend.sft_step(groups), *encode_groups(groups))

    def state_dict_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self._call("state_dict_for_sync", lambda: list(self._backend.state_dict_for_sync()))

    def save_weights(self, path: Path) -> Path:
        return self._call("save_weights", lambda: self._backend.save_weights(path), {"path": str(path)})

    def snapshot(self):
        return self._call("snapshot", self._backend.snapshot)

    def close(self) -> None:
        self._call("close", self._backend.close)


def stop_followers() -> None:
    """Rank 0, at shutdown: the followers leave follow()."""
    if _COMMANDS is not None:
        _COMMANDS.send("exit")


def follow(device_type: str = "cpu") -> None:
    """A rank other than 0: make every call rank 0 announces, until it says exit."""
    commands = init_ranks(device_type)
    backend = None
    while True:
        op, args, payload = commands.receive()
        if op == "exit":
            return
        result = _run(commands, functools.partial(_follower_call, backend, op, args, payload))
        if op == "init":
            backend = result
        elif op == "close":
            backend = None


def _follower_call(backend, op: str, args: dict, payload: bytes):
    """What a follower does for a command: the same call as rank 0's."""
    if op == "init":
        config = TrainerRunConfig.model_validate(args["config"])
        resume = Path(args["resume_from"]) if args["resume_from"] else None
        return backend_class(config)(config, torch.device(args["device"]), args["mixed_precision"], resume)
    if backend is None:
        raise RuntimeError(f"{op}: this rank holds no run")
    if op in ("train_step", "sft_step"):
        return getattr(backend, op)(decode_groups(args, payload))
    if op == "state_dict_for_sync":  # this rank helps gather each tensor; rank 0 pushes them
        for _ in backend.state_dict_for_sync():
            pass
        return None
    if op == "save_weights":
        return backend.save_weights(Path(args["path"]))
    if op == "snapshot":
        return backend.snapshot()
    if op == "close":
        return backend.close()
    raise RuntimeError(f"unknown command {op!r}")
