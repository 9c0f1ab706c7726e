"""Colocated weight pushes: the trainer and the engines share this machine (and its
accelerators), so weights cross without a network copy (docs/weight-sync.md).

- Engines that map rlmesh weight files (the reference engine: ListEngines says
  weight_file_format "rlmesh-weights-v1"): the trainer writes every tensor once, in the wire
  dtype, into a file in shared memory (rlmesh.common.weight_file: one no engine holds, so
  two alternate) and the rollout service tells each engine to load it
  (/update_weights_from_tensor, load_format "rlmesh_weight_file": the engine takes the
  file's pages as its parameters). No pickle.
- SGLang engines: SGLang's own /update_weights_from_tensor format, CUDA tensors passed as
  CUDA IPC handles (the engine maps the trainer's GPU memory and copies from it). That
  format is SGLang's: a base64 ForkingPickler dump of the [(name, tensor)] list per TP rank,
  which SGLang unpickles with its allowlist. It needs the weights on a CUDA device; the
  trainer writes it and never reads one. Buckets of bucket_bytes bound the extra memory of
  converting to the wire dtype.
"""

from __future__ import annotations

import asyncio
import base64
import io
import time
from collections.abc import Sequence
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import grpc
import torch
import torch.multiprocessing
from torch import Tensor

from rlmesh.common import errors, weight_file
from rlmesh.common.grpc_server import aio_channel
from rlmesh.trainer.engine_pause import UNREACHABLE_WAIT_SECONDS, EnginePause, when_reachable
from rlmesh.trainer.weight_sync import PushResult, plan_buckets
from rlmesh.v1 import rollout_pb2
from rlmesh.v1.rollout_pb2_grpc import RolloutStub


def sglang_payload(named: Sequence[tuple[str, Tensor]], tp_size: int) -> list[str]:
    """SGLang's serialized_named_tensors for one call: the same [(name, tensor)] list for
    each of the engine's TP ranks (each rank takes its own shard from the full tensors)."""
    buf = io.BytesIO()
    ForkingPickler(buf).dump([(name, t) for name, t in named])
    encoded = base64.b64encode(buf.getvalue()).decode()
    return [encoded] * tp_size


def run_weight_file(directory: Path, run_id: str) -> Path:
    """The first of a run's weight files (weight_file.Writer names the others after it)."""
    return directory / f"{run_id}.rlmw"


def discard_weight_files(directory: Path, run_id: str) -> None:
    """A run's weight files removed (an engine that maps one keeps its pages until it moves on)."""
    weight_file.Writer(run_weight_file(directory, run_id)).close(remove=True)


class ColocatedPusher:
    """A run's colocated pushes: its weight file and its channel to the rollout service."""

    def __init__(self, rollout_address: str, run_id: str, directory: Path, timeout_seconds: float) -> None:
        if not rollout_address:
            raise errors.FailedPrecondition(
                "this trainer has no rollout_address (RLMESH_TRAINER_ROLLOUT_ADDRESS): it cannot push weights"
            )
        self.rollout_address = rollout_address
        self.timeout = timeout_seconds
        self.writer = weight_file.Writer(run_weight_file(directory, run_id))
        self._channel: grpc.aio.Channel | None = None

    @property
    def _stub(self) -> RolloutStub:
        if self._channel is None:
            self._channel = aio_channel(self.rollout_address)
        return RolloutStub(self._channel)

    async def _call(self, what: str, call):
        try:
            return await call
        except grpc.aio.AioRpcError as e:
            raise errors.upstream_error(f"rollout service ({what})", self.rollout_address, e) from None

    async def _reach(self, what: str, make_call):
        """A call safe to repeat, waited for while the rollout service is unreachable."""
        budget = min(self.timeout, UNREACHABLE_WAIT_SECONDS)
        return await self._call(what, when_reachable(what, self.rollout_address, make_call, budget))

    async def push(
        self,
        named: list[tuple[str, Tensor]],
        version: int,
        wire_dtype: torch.dtype | None,
        bucket_bytes: int,
        pause_mode: str = "",
    ) -> PushResult:
        """With `pause_mode` the engines are paused in that mode while they take the weights."""
        start = time.monotonic()
        pause = EnginePause(self._stub, pause_mode, self._reach)
        listing = asyncio.ensure_future(
            self._reach(
                "ListEngines", lambda: self._stub.ListEngines(rollout_pb2.ListEnginesRequest(), timeout=self.timeout)
            )
        )
        try:
            # Weights off CUDA can only go by file (CUDA IPC needs CUDA tensors): written while
            # the engines are listed.
            on_cpu = all(t.device.type != "cuda" for _, t in named)
            written = await self._write(named, wire_dtype) if on_cpu else None
            engines = await listing
        finally:
            listing.cancel()
        healthy = [e for e in engines.engines if e.healthy]
        if not healthy:
            raise errors.Unavailable("no engine answers: the weights cannot be pushed")
        formats = {e.weight_file_format for e in healthy}
        if formats == {weight_file.FORMAT}:
            nbytes = written if written is not None else await self._write(named, wire_dtype)
            await pause.begin()
            await self._update([str(self.writer.path)], weight_file.LOAD_FORMAT, str(version))
            calls = 1
        elif formats == {""}:
            await pause.begin()
            nbytes, calls = await self._push_cuda_ipc(named, version, wire_dtype, bucket_bytes, healthy)
        else:
            raise errors.FailedPrecondition(
                "the engines mix rlmesh weight files and SGLang's CUDA IPC tensors: a colocated push needs one kind"
            )
        await pause.end()
        return PushResult(
            seconds=time.monotonic() - start, bytes=nbytes, buckets=calls, engines_continued=pause.continued
        )

    async def _write(self, named: list[tuple[str, Tensor]], wire_dtype: torch.dtype | None) -> int:
        try:
            return await asyncio.to_thread(self.writer.write, named, wire_dtype)
        except weight_file.WeightFileError as e:
            raise errors.FailedPrecondition(f"colocated push: {e}") from None

    async def _push_cuda_ipc(
        self,
        named: list[tuple[str, Tensor]],
        version: int,
        wire_dtype: torch.dtype | None,
        bucket_bytes: int,
        engines: Sequence[rollout_pb2.EngineInfo],
    ) -> tuple[int, int]:
        if any(t.device.type != "cuda" for _, t in named):
            raise errors.FailedPrecondition(
                "SGLang engines take colocated updates as CUDA IPC handles only: this trainer's weights are not on a "
                "CUDA device (use weight_sync.method 'distributed' or 'disk')"
            )
        tp_size = max(e.tp_size for e in engines) or 1
        buckets = plan_buckets(named, bucket_bytes, wire_dtype)
        nbytes = 0
        for i, bucket in enumerate(buckets):
            sent = [(n, t.detach().to(wire_dtype) if wire_dtype else t.detach()) for n, t in bucket]
            torch.cuda.synchronize()  # the engine reads the memory as soon as it has the handles
            last = i == len(buckets) - 1
            await self._update(sglang_payload(sent, tp_size), "", str(version) if last else "")
            nbytes += sum(t.numel() * t.element_size() for _, t in sent)
            del sent  # (kept alive until the engines answered: they copied from it)
        return nbytes, len(buckets)

    async def _update(self, serialized: list[str], load_format: str, version: str) -> None:
        request = rollout_pb2.UpdateWeightsFromTensorRequest(
            serialized_named_tensors=serialized,
            load_format=load_format,
            weight_version=version,
            flush_cache=bool(version),
        )
        await self._call("UpdateWeightsFromTensor", self._stub.UpdateWeightsFromTensor(request, timeout=self.timeout))

    async def close(self, remove: bool = True) -> None:
        self.writer.close(remove=remove)
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
