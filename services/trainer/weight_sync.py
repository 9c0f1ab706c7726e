"""Pushing the trainer's weights to the inference engines: the trainer's side of
docs/architecture.md "Weight updates", over the rollout service's gRPC API.

Distributed push (the default):
1. ListEngines gives the weight group's world size (1 + the engines' TP sizes).
2. The first push, or one after the engines changed, opens a group: the trainer starts
   InitWeightUpdateGroup (which blocks until every rank has joined) and at the same
   time joins as rank 0, hosting the rendezvous store on a free port. The group is
   kept for later pushes.
3. Per bucket of parameters (up to bucket_bytes, one dtype per bucket): the trainer
   starts UpdateWeights with the bucket's names, dtypes and shapes, and at the same
   time broadcasts the tensors from rank 0 (one broadcast per tensor, or one uint8
   broadcast of their bytes concatenated in order for load_format="flattened_bucket";
   with one dtype per bucket every offset is a multiple of the element size).

Disk push (the fallback): save a Hugging Face directory, then UpdateWeightsFromDisk.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch
import torch.distributed as dist
from torch import Tensor

from rlmesh.common import errors
from rlmesh.common.grpc_server import aio_channel
from rlmesh.common.run_config import WeightSyncConfig
from rlmesh.common.weight_group import destroy_weight_group, init_weight_group, rendezvous_socket
from rlmesh.v1 import rollout_pb2
from rlmesh.v1.rollout_pb2_grpc import RolloutStub

log = logging.getLogger(__name__)

@dataclass
class PushResult:
    seconds: float
    bytes: int
    buckets: int


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16", the spelling SGLang's weight update API uses."""
    return str(dtype).removeprefix("torch.")


def plan_buckets(
    tensors: Sequence[tuple[str, Tensor]], bucket_bytes: int, wire_dtype: torch.dtype | None = None
) -> list[list[tuple[str, Tensor]]]:
    """Cut the (name, tensor) list, in order, into buckets of at most bucket_bytes (as
    sent, in wire_dtype when given) holding one dtype each. A tensor larger than
    bucket_bytes travels alone."""
    buckets: list[list[tuple[str, Tensor]]] = []
    current: list[tuple[str, Tensor]] = []
    current_bytes = 0
    current_dtype: torch.dtype | None = None
    for name, t in tensors:
        dtype = wire_dtype or t.dtype
        size = t.numel() * dtype.itemsize
        if current and (current_bytes + size > bucket_bytes or dtype != current_dtype):
            buckets.append(current)
            current, current_bytes = [], 0
        current.append((name, t))
        current_bytes += size
        current_dtype = dtype
    if current:
        buckets.append(current)
    return buckets


def resolve_backend(backend: str) -> str:
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend


def broadcast_bucket(
    bucket: Sequence[tuple[str, Tensor]],
    group: dist.ProcessGroup,
    flattened: bool,
    device: torch.device,
    wire_dtype: torch.dtype | None = None,
) -> int:
    """Send one bucket from rank 0; returns the bytes sent."""
    tensors = [t.detach().to(device=device, dtype=wire_dtype or t.dtype).contiguous() for _, t in bucket]
    if flattened:
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])
        dist.broadcast(flat, src=0, group=group)
        return flat.numel()
    for t in tensors:
        dist.broadcast(t, src=0, group=group)
    return sum(t.numel() * t.element_size() for t in tensors)


def _destroy_if_created(name: str) -> Callable[[asyncio.Future], None]:
    def destroy(joined: asyncio.Future) -> None:
        if not joined.cancelled() and joined.exception() is None:
            destroy_weight_group(joined.result(), name)

    return destroy


@dataclass
class _Group:
    group: dist.ProcessGroup
    name: str
    key: tuple  # what the engines looked like when it was opened
    version: str = ""  # the weight version last pushed through it


class WeightPusher:
    """Holds a run's weight-update group and its channel to the rollout service."""

    def __init__(
        self,
        rollout_address: str,
        run_id: str,
        master_address: str = "127.0.0.1",
        timeout_seconds: float = 300.0,
        bind_address: str = "",
    ) -> None:
        if not rollout_address:
            raise errors.FailedPrecondition(
                "this trainer has no rollout_address (RLMESH_TRAINER_ROLLOUT_ADDRESS): it cannot push weights"
            )
        self.rollout_address = rollout_address
        self.run_id = run_id
        self.master_address = master_address
        self.bind_address = bind_address or master_address  # the rendezvous listens here only
        self.timeout = timeout_seconds
        self._channel: grpc.aio.Channel | None = None  # made on first use, inside the event loop
        self._group: _Group | None = None

    @property
    def _stub(self) -> RolloutStub:
        if self._channel is None:
            self._channel = aio_channel(self.rollout_address)
        return RolloutStub(self._channel)

    # ---------------------------------------------------------------- calls

    async def _call(self, what: str, call: Awaitable):
        try:
            return await call
        except grpc.aio.AioRpcError as e:
            raise errors.upstream_error(f"rollout service ({what})", self.rollout_address, e) from None

    async def _together(
        self,
        what: str,
        call: Awaitable,
        local: Callable[[], object],
        abandon: Callable[[asyncio.Future], None],
    ):
        """Run a blocking gRPC call and our side of the collective at the same time;
        each waits for the other. If one side fails, the other may never complete:
        `abandon` gets our still-running side so it can clean up once it gives up."""
        rpc = asyncio.ensure_future(self._call(what, call))
        mine = asyncio.ensure_future(asyncio.to_thread(local))
        await asyncio.wait({rpc, mine}, return_when=asyncio.FIRST_EXCEPTION)
        if rpc.done() and not rpc.cancelled() and rpc.exception() is not None:
            abandon(mine)
            raise rpc.exception()
        if mine.done() and mine.exception() is not None:
            rpc.cancel()
            abandon(mine)
            e = mine.exception()
            raise errors.Unavailable(f"weight transfer ({what}) failed on the trainer side: {type(e).__name__}: {e}")
        return await rpc, await mine

    # ---------------------------------------------------------------- group

    async def _ensure_group(self, backend: str) -> _Group:
        engines = await self._call("ListEngines", self._stub.ListEngines(rollout_pb2.ListEnginesRequest(), timeout=self.timeout))
        # world size: 1 + the TP ranks of the engines that answer. One that is down is
        # left out of the pool (and this group) and joins a later group once it answers.
        world_size = engines.weight_group_world_size
        if not engines.engines:
            raise errors.FailedPrecondition(
                f"the rollout service at {self.rollout_address} has no engines to receive weights"
            )
        up = [e for e in engines.engines if e.healthy]
        down = [e.url for e in engines.engines if not e.healthy]
        if not up:
            raise errors.Unavailable(f"engines not answering, weights not pushed: {', '.join(down)}")
        if down:
            log.warning("pushing weights to the engines that answer; left out until they answer: %s", ", ".join(down))
        key = (backend, world_size, tuple((e.url, e.tp_size) for e in up))
        if self._group is not None:
            # An engine that does not report the version we last pushed has restarted (or
            # been updated by someone else): it is no longer in our group.
            stale = [e.url for e in up if e.weight_version != self._group.version]
            if self._group.key == key and not stale:
                return self._group
            log.info("engines changed since the weight group was opened (%s): opening a new one", stale or "membership")
            await self._close_group()

        # Unique across restarts: an engine may still hold a group a dead trainer opened.
        name = f"rlmesh-{self.run_id}-{uuid.uuid4().hex[:8]}"
        port, listen_fd = rendezvous_socket(self.bind_address)
        request = rollout_pb2.InitWeightUpdateGroupRequest(
            master_address=self.master_address,
            master_port=port,
            world_size=world_size,
            group_name=name,
            backend=backend,
        )
        _, group = await self._together(
            "InitWeightUpdateGroup",
            self._stub.InitWeightUpdateGroup(request, timeout=self.timeout),
            lambda: init_weight_group(backend, self.master_address, port, world_size, 0, name, self.timeout, listen_fd),
            abandon=lambda pending: pending.add_done_callback(_destroy_if_created(name)),
        )
        self._group = _Group(group=group, name=name, key=key)
        log.info("weight group %s open: %d ranks over %s", name, world_size, backend)
        return self._group

    def _abandon_group(self, pending: asyncio.Future) -> None:
        group, self._group = self._group, None
        if group is None:
            return
        # A thread may still be blocked in a collective on it: free it only afterwards.
        pending.add_done_callback(lambda _: destroy_weight_group(group.group, group.name))

    async def _close_group(self) -> None:
        group, self._group = self._group, None
        if group is None:
            return
        try:
            await self._stub.DestroyWeightUpdateGroup(
                rollout_pb2.DestroyWeightUpdateGroupRequest(group_name=group.name), timeout=30
            )
        except grpc.aio.AioRpcError as e:  # the engines may be gone already
            log.warning("DestroyWeightUpdateGroup %s failed: %s", group.name, e.details())
        destroy_weight_group(group.group, group.name)

    # ---------------------------------------------------------------- pushes

    async def push_distributed(
        self,
        tensors: Sequence[tuple[str, Tensor]],
        version: int,
        config: WeightSyncConfig,
        wire_dtype: torch.dtype | None = None,
    ) -> PushResult:
        start = time.monotonic()
        backend = resolve_backend(config.backend)
        device = torch.device("cuda") if backend == "nccl" else torch.device("cpu")
        group = await self._ensure_group(backend)
        flattened = config.load_format == "flattened_bucket"
        buckets = plan_buckets(tensors, config.bucket_bytes, wire_dtype)
        sent = 0
        for k, bucket in enumerate(buckets):
            request = rollout_pb2.UpdateWeightsRequest(
                group_name=group.name,
                tensors=[
                    rollout_pb2.TensorMeta(name=name, dtype=dtype_name(wire_dtype or t.dtype), shape=list(t.shape))
                    for name, t in bucket
                ],
                # The version and the cache flush come with the last bucket only: an engine
                # never reports a version it holds only part of.
                weight_version=str(version) if k == len(buckets) - 1 else "",
                flush_cache=k == len(buckets) - 1,
                load_format=config.load_format,
            )
            _, nbytes = await self._together(
                f"UpdateWeights bucket {k + 1}/{len(buckets)}",
                self._stub.UpdateWeights(request, timeout=self.timeout),
                lambda b=bucket: broadcast_bucket(b, group.group, flattened, device, wire_dtype),
                abandon=self._abandon_group,
            )
            sent += nbytes
        group.version = str(version)
        return PushResult(seconds=time.monotonic() - start, bytes=sent, buckets=len(buckets))

    async def push_from_disk(self, save: Callable[[Path], Path], directory: Path, version: int) -> PushResult:
        """Save the weights under directory/v<version>, have the engines load them, then
        drop older versions' directories."""
        start = time.monotonic()
        target = directory / f"v{version}"
        await asyncio.to_thread(save, target)
        await self._call(
            "UpdateWeightsFromDisk",
            self._stub.UpdateWeightsFromDisk(
                rollout_pb2.UpdateWeightsFromDiskRequest(model_path=str(target.resolve()), weight_version=str(version)),
                timeout=self.timeout,
            ),
        )
        if self._group is not None:
            self._group.version = str(version)  # the engines moved on together; the group still holds
        for old in directory.glob("v*"):
            if old != target and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
        size = sum(f.stat().st_size for f in target.glob("*.safetensors"))
        return PushResult(seconds=time.monotonic() - start, bytes=size, buckets=0)

    async def close(self) -> None:
        await self._close_group()
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
