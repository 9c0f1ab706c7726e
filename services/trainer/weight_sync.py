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
   Buckets are pipelined (rlmesh.trainer.bucket_stream): the next bucket is prepared
   (converted, flattened) while one is broadcast, and over gloo its UpdateWeights starts
   as soon as the first tensor of the bucket before it has left rank 0 (every engine is
   inside that bucket's update then, and takes the next one's request as soon as it is
   done); the answers are collected as they come, all of them before the push returns.
   Each bucket's timing (started, first tensor sent, all sent) comes back with the result.
4. Delta pushes (weight_sync.delta, engines advertising the rlmesh delta format): the
   trainer keeps each bucket as last sent; a bucket is then sent as the flat indices of
   the elements whose bits changed plus their values (one uint8 broadcast), or whole when
   more than delta_max_changed_fraction of it changed. Unchanged buckets are skipped (but
   the last, which carries the version). The engines check that they hold the delta's
   base version, so a delta never lands on other weights; a failed or disk push drops
   the copy and the next push is full.

Disk push (the fallback): save a Hugging Face directory, then UpdateWeightsFromDisk.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch
import torch.distributed as dist
from torch import Tensor

from rlmesh.common import errors
from rlmesh.common.grpc_server import aio_channel
from rlmesh.common.run_config import WeightSyncConfig
from rlmesh.common.weight_group import (
    WEIGHT_DELTA_FORMAT,
    destroy_weight_group,
    gpu_uuid,
    init_weight_group,
    rendezvous_socket,
)
from rlmesh.trainer.bucket_stream import BucketStream, BucketTiming, OutgoingBucket
from rlmesh.trainer.engine_pause import UNREACHABLE_WAIT_SECONDS, EnginePause, when_reachable
from rlmesh.v1 import rollout_pb2
from rlmesh.v1.rollout_pb2_grpc import RolloutStub

log = logging.getLogger(__name__)


@dataclass
class PushResult:
    seconds: float
    bytes: int  # broadcast (delta buckets count their indices and values)
    buckets: int
    delta_buckets: int = 0  # buckets sent as deltas (skipped unchanged ones included)
    timings: list[BucketTiming] = field(default_factory=list)  # per bucket sent, in order (distributed pushes)
    version: int = 0  # the weight version the engines now report (set by the trainer)
    engines_continued: bool = False  # paused for the push (pause_mode) and generating again


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


def group_backend(requested: str, own_gpu: str, engines: Sequence[rollout_pb2.EngineInfo]) -> tuple[str, str]:
    """The weight group's backend, and a warning ("" if none): "auto" is NCCL on a GPU and
    gloo on CPU, and gloo too when an engine runs on the trainer's own GPU (a single-GPU
    machine): NCCL refuses two ranks of one group on one GPU ("Duplicate GPU detected"),
    while gloo stages through host memory. An explicit "nccl" there is refused."""
    if requested == "nccl" and not torch.cuda.is_available():
        raise errors.FailedPrecondition(
            "weight_sync.backend 'nccl' needs the trainer on a GPU and this trainer has none: use 'auto' (gloo on CPU)"
        )
    sharing = ", ".join(e.url for e in engines if own_gpu and e.gpu_uuid == own_gpu)
    if requested == "nccl" and sharing:
        raise errors.FailedPrecondition(
            f"weight_sync.backend 'nccl' cannot reach {sharing}: it runs on the trainer's own GPU "
            f"({own_gpu}) and NCCL refuses two ranks on one GPU; use backend 'auto' (gloo there) or "
            "method 'colocated' (the fast path when engine and trainer share a GPU)"
        )
    if requested != "auto":
        return requested, ""
    if not torch.cuda.is_available():
        return "gloo", ""
    if sharing:
        return "gloo", (
            f"engines on the trainer's own GPU ({sharing}): weights go over gloo through host memory, not "
            "NCCL, which refuses two ranks on one GPU (weight_sync.method 'colocated' is faster there)"
        )
    return "nccl", ""


def flatten_bucket(
    bucket: Sequence[tuple[str, Tensor]],
    device: torch.device,
    wire_dtype: torch.dtype | None,
    out: list[Tensor] | None = None,
) -> Tensor:
    """The bucket's tensors end to end in one 1-D tensor of the wire dtype: one pass,
    converting as it copies. With `out` (a one-element list), that tensor's memory is
    reused when large enough, and replaced otherwise."""
    dtype = wire_dtype or bucket[0][1].dtype
    numel = sum(t.numel() for _, t in bucket)
    if out is not None and out[0] is not None and out[0].numel() >= numel and out[0].dtype == dtype:
        flat = out[0][:numel]
    else:
        flat = torch.empty(numel, dtype=dtype, device=device)
        if out is not None:
            out[0] = flat
    offset = 0
    for _, t in bucket:
        flat[offset : offset + t.numel()].view(t.shape).copy_(t.detach())
        offset += t.numel()
    return flat


def sendable_as_is(bucket: Sequence[tuple[str, Tensor]], device: torch.device, wire_dtype: torch.dtype | None) -> bool:
    """Whether every tensor of the bucket can be broadcast as it is (no conversion, no copy)."""
    return all(t.device == device and t.dtype == (wire_dtype or t.dtype) and t.is_contiguous() for _, t in bucket)


def broadcast_bucket(
    bucket: Sequence[tuple[str, Tensor]],
    group: dist.ProcessGroup,
    flattened: bool,
    device: torch.device,
    wire_dtype: torch.dtype | None = None,
    flat: Tensor | None = None,
    first_sent: Callable[[], None] = lambda: None,
) -> int:
    """Send one bucket whole from rank 0 (from `flat`, its flatten_bucket, when given);
    `first_sent` is called once its first broadcast has left. Returns the bytes sent."""
    if flat is None and not flattened and sendable_as_is(bucket, device, wire_dtype):
        for i, (_, t) in enumerate(bucket):  # already as sent: no copy
            dist.broadcast(t.detach(), src=0, group=group)
            if i == 0:
                first_sent()
        return sum(t.numel() * t.element_size() for _, t in bucket)
    if flat is None:
        flat = flatten_bucket(bucket, device, wire_dtype)
    if flattened:
        dist.broadcast(flat.view(torch.uint8), src=0, group=group)
        first_sent()
    else:
        offset = 0
        for _, t in bucket:
            dist.broadcast(flat[offset : offset + t.numel()], src=0, group=group)
            if offset == 0:
                first_sent()
            offset += t.numel()
    return flat.numel() * flat.element_size()


_SAME_SIZE_INTEGER = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def changed_elements(new: Tensor, old: Tensor) -> Tensor:
    """Flat indices (int64, increasing) where the bits of two flat tensors of one dtype
    differ: compared as integers, so -0.0 vs 0.0 and NaN payloads count as changes."""
    bits = _SAME_SIZE_INTEGER[new.element_size()]
    return (new.view(bits) != old.view(bits)).nonzero().squeeze(1)


def delta_payload(flat: Tensor, indices: Tensor) -> tuple[Tensor, str]:
    """One uint8 tensor: the indices (int32 when the bucket allows, else int64), then the
    values at them. The values start at a multiple of the index size, aligned for any dtype."""
    index_dtype = torch.int32 if flat.numel() <= torch.iinfo(torch.int32).max else torch.int64
    index_bytes = indices.numel() * index_dtype.itemsize
    payload = torch.empty(index_bytes + indices.numel() * flat.element_size(), dtype=torch.uint8, device=flat.device)
    payload[:index_bytes].view(index_dtype).copy_(indices)
    torch.index_select(flat, 0, indices, out=payload[index_bytes:].view(flat.dtype))
    return payload, dtype_name(index_dtype)


def _broadcast_payload(payload: Tensor, group: dist.ProcessGroup, first_sent: Callable[[], None]) -> int:
    if payload.numel():  # an empty delta (the unchanged last bucket) has nothing to send
        dist.broadcast(payload, src=0, group=group)
    first_sent()
    return payload.numel()


def _destroy_if_created(name: str) -> Callable[[asyncio.Future], None]:
    def destroy(joined: asyncio.Future) -> None:
        if not joined.cancelled() and joined.exception() is None:
            destroy_weight_group(joined.result(), name)

    return destroy


@dataclass
class _Group:
    group: dist.ProcessGroup
    name: str
    backend: str
    key: tuple  # what the engines looked like when it was opened
    version: str = ""  # the weight version last pushed through it
    delta_ok: bool = False  # every engine accepts rlmesh delta updates
    # Per bucket (its names), what the engines hold as last sent through this group: the
    # base of the next delta. Empty when delta pushes are off or the engines' state is unsure.
    sent: dict[tuple[str, ...], Tensor] = field(default_factory=dict)
    # On CPU, the two buffers that buckets are converted or flattened into, alternating, kept
    # from one push to the next: fresh memory costs page faults (0.1-0.8 s a push for 2 x 200
    # MiB). On a GPU the caching allocator recycles freed memory, which training needs meanwhile.
    staging: list[list[Tensor | None]] = field(default_factory=lambda: [[None], [None]])


def _forget_sent(group: _Group, pending: list[asyncio.Future], ready: dict[int, asyncio.Future]) -> None:
    """After a failed push: the calls not answered yet are cancelled, and the copies of what
    was last sent are dropped (also those the buckets being prepared, `ready`, add), so the
    next push is full."""
    group.sent.clear()  # what the engines hold is unsure now: the next push is full
    for answer in pending:
        answer.cancel()
    for preparing in ready.values():  # let them finish before the copies are dropped
        if not preparing.done():
            preparing.add_done_callback(lambda _: group.sent.clear())


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

    async def _reach(self, what: str, make_call: Callable[[], Awaitable]):
        """A call safe to repeat, waited for while the rollout service is unreachable."""
        budget = min(self.timeout, UNREACHABLE_WAIT_SECONDS)
        return await self._call(what, when_reachable(what, self.rollout_address, make_call, budget))

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

    async def _ensure_group(self, requested_backend: str) -> _Group:
        engines = await self._reach(
            "ListEngines", lambda: self._stub.ListEngines(rollout_pb2.ListEnginesRequest(), timeout=self.timeout)
        )
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
        backend, warning = group_backend(requested_backend, gpu_uuid(), up)
        key = (backend, world_size, tuple((e.url, e.tp_size) for e in up))
        delta_ok = all(e.weight_delta_format == WEIGHT_DELTA_FORMAT for e in up)
        if self._group is not None:
            # An engine that does not report the version we last pushed has restarted (or
            # been updated by someone else): it is no longer in our group.
            stale = [e.url for e in up if e.weight_version != self._group.version]
            if self._group.key == key and not stale:
                self._group.delta_ok = delta_ok
                return self._group
            log.info("engines changed since the weight group was opened (%s): opening a new one", stale or "membership")
            await self._close_group()

        if warning:  # (once per group, not per push)
            log.warning("%s", warning)
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
        self._group = _Group(group=group, name=name, backend=backend, key=key, delta_ok=delta_ok)
        log.info("weight group %s open: %d ranks over %s", name, world_size, backend)
        return self._group

    def _abandon_group(self, pending: asyncio.Future | None) -> None:
        group, self._group = self._group, None
        if group is None:
            return
        if pending is None:
            destroy_weight_group(group.group, group.name)
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
        pause_mode: str = "",
    ) -> PushResult:
        """With `pause_mode` the engines are paused in that mode (while the engines are listed)
        until all have answered the last bucket (engine_pause.py)."""
        start_time = time.monotonic()
        pause = EnginePause(self._stub, pause_mode, self._reach)
        # Both to the end, even when one fails: a group setup left running could race the retry's.
        group, paused = await asyncio.gather(self._ensure_group(config.backend), pause.begin(), return_exceptions=True)
        for outcome in (group, paused):
            if isinstance(outcome, BaseException):
                raise outcome
        device = torch.device("cuda") if group.backend == "nccl" else torch.device("cpu")
        flattened = config.load_format == "flattened_bucket"
        buckets = plan_buckets(tensors, config.bucket_bytes, wire_dtype)
        use_delta = config.delta and group.delta_ok
        if not use_delta:
            group.sent.clear()
        # Bucket k's staging buffer is reused by bucket k+2, prepared only once bucket k has
        # left rank 0 (over NCCL: once the engines have answered for it).
        staging = group.staging if device.type == "cpu" else [[None], [None]]

        def prepare(k: int) -> OutgoingBucket | None:
            """Bucket k as it will travel; None when it is unchanged and may be skipped."""
            bucket = buckets[k]
            last = k == len(buckets) - 1
            request = rollout_pb2.UpdateWeightsRequest(
                group_name=group.name,
                tensors=[
                    rollout_pb2.TensorMeta(name=name, dtype=dtype_name(wire_dtype or t.dtype), shape=list(t.shape))
                    for name, t in bucket
                ],
                # The version and the cache flush come with the last bucket only: an engine
                # never reports a version it holds only part of.
                weight_version=str(version) if last else "",
                flush_cache=last,
                load_format=config.load_format,
            )
            if not use_delta:
                flat = None
                if flattened or not sendable_as_is(bucket, device, wire_dtype):
                    flat = flatten_bucket(bucket, device, wire_dtype, staging[k % 2])  # here, beside the last broadcast
                return whole(request, bucket, flat)
            key = tuple(name for name, _ in bucket)
            flat = flatten_bucket(bucket, device, wire_dtype)
            base = group.sent.pop(key, None)  # popped: if this push fails, the base is unsure
            if base is not None and base.dtype == flat.dtype and base.numel() == flat.numel() and group.version:
                indices = changed_elements(flat, base)
                del base
                if indices.numel() <= config.delta_max_changed_fraction * flat.numel():
                    group.sent[key] = flat
                    if not indices.numel() and not last:
                        return None
                    payload, index_dtype = delta_payload(flat, indices)
                    request.load_format = ""
                    request.delta.CopyFrom(
                        rollout_pb2.WeightDelta(
                            count=indices.numel(), index_dtype=index_dtype, base_version=group.version
                        )
                    )
                    return OutgoingBucket(request, lambda first: _broadcast_payload(payload, group.group, first), True)
            group.sent[key] = flat
            return whole(request, bucket, flat)

        def whole(request: rollout_pb2.UpdateWeightsRequest, bucket: list, flat: Tensor | None) -> OutgoingBucket:
            return OutgoingBucket(
                request,
                lambda first: broadcast_bucket(bucket, group.group, flattened, device, flat=flat, first_sent=first),
                False,
            )

        stream = BucketStream(
            len(buckets),
            prepare,
            call=lambda what, request: self._call(what, self._stub.UpdateWeights(request, timeout=self.timeout)),
            abandon=self._abandon_group,
            early=group.backend == "gloo",
        )
        try:
            await stream.run()
        except BaseException:
            _forget_sent(group, stream.pending, stream.ready)
            raise
        group.version = str(version)
        await pause.end()
        return PushResult(
            seconds=time.monotonic() - start_time,
            bytes=stream.sent_bytes,
            buckets=len(buckets),
            delta_buckets=stream.delta_buckets,
            timings=stream.timings,
            engines_continued=pause.continued,
        )

    async def push_from_disk(
        self, save: Callable[[Path], Path], directory: Path, version: int, pause_mode: str = ""
    ) -> PushResult:
        """Save the weights under directory/v<version>, have the engines load them (paused
        meanwhile, with pause_mode), then drop older versions' directories."""
        start = time.monotonic()
        pause = EnginePause(self._stub, pause_mode, self._reach)
        target = directory / f"v{version}"
        await asyncio.to_thread(save, target)
        await pause.begin()
        await self._call(
            "UpdateWeightsFromDisk",
            self._stub.UpdateWeightsFromDisk(
                rollout_pb2.UpdateWeightsFromDiskRequest(model_path=str(target.resolve()), weight_version=str(version)),
                timeout=self.timeout,
            ),
        )
        await pause.end()
        if self._group is not None:
            self._group.version = str(version)  # the engines moved on together; the group still holds
            self._group.sent.clear()  # ... but hold the checkpoint's weights, not what we last broadcast
        for old in directory.glob("v*"):
            if old != target and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
        size = sum(f.stat().st_size for f in target.glob("*.safetensors"))
        return PushResult(seconds=time.monotonic() - start, bytes=size, buckets=0, engines_continued=pause.continued)

    async def close(self) -> None:
        await self._close_group()
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
