"""Weight updates for the reference engine, the way SGLang receives them:

- a weight-update process group joined with `rlmesh.common.weight_group` (the trainer is
  rank 0 and the source of every broadcast; this engine is rank `rank_offset`);
- `update_weights_from_distributed`: one `broadcast(src=0)` per tensor in `names` order,
  each allocated with its announced dtype and shape; or, with load_format
  "flattened_bucket", a single uint8 broadcast holding the tensors' bytes back to back in
  `names` order with no padding (SGLang's `FlattenedTensorBucket.from_specs`: tensor i
  starts where tensor i-1 ends);
- `update_weights_from_disk`: the safetensors (or .bin) files of a checkpoint directory;
- an rlmesh extension SGLang does not have, delta updates (docs/engine-api.md, "Delta
  weight updates"): `update_weights_from_distributed` with an `rlmesh_delta` field receives
  one uint8 broadcast holding only the changed elements of a bucket (their flat indices
  into the bucket, then their values) and writes them over the current weights, which
  must be at the delta's base version.

Tensors are matched to the model by Hugging Face name (`model.state_dict()` names, tied
aliases such as lm_head.weight included). Unlike SGLang, a bad name or shape is found
before anything is copied, so a failed update leaves the old weights whole. Everything
here is blocking; the server calls it from worker threads, and `load_into_model` from the
engine thread between decode steps."""

from __future__ import annotations

import ipaddress
import math
import threading
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlmesh.common.net import METADATA_HOSTS, is_host_name
from rlmesh.common.weight_group import destroy_weight_group, init_weight_group


class WeightUpdateError(ValueError):
    """An update that cannot be applied; answered as {"success": false, "message"} with 400."""


class BroadcastFailed(WeightUpdateError):
    """A broadcast of the group was not received whole (rank 0 gone, past the group's
    timeout, or no memory to receive it into): the group is out of step with rank 0 and
    cannot carry another update."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def parse_dtype(name: Any) -> torch.dtype:
    candidate = getattr(torch, str(name).removeprefix("torch."), None) if isinstance(name, str) else None
    if not isinstance(candidate, torch.dtype):
        raise WeightUpdateError(f"unknown dtype {name!r}; use torch dtype names such as 'bfloat16' or 'float32'")
    return candidate


def parse_specs(names: Any, dtypes: Any, shapes: Any) -> list[TensorSpec]:
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise WeightUpdateError("names must be a non-empty list of parameter names")
    if not isinstance(dtypes, list) or not isinstance(shapes, list) or not len(names) == len(dtypes) == len(shapes):
        raise WeightUpdateError(
            f"names, dtypes and shapes must be lists of equal length (got {len(names)}, "
            f"{len(dtypes) if isinstance(dtypes, list) else '?'}, {len(shapes) if isinstance(shapes, list) else '?'})"
        )
    specs = []
    for name, dtype, shape in zip(names, dtypes, shapes):
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise WeightUpdateError(f"shape of {name!r} must be a list of non-negative integers, got {shape!r}")
        specs.append(TensorSpec(name, parse_dtype(dtype), tuple(shape)))
    return specs


# -- the process group -------------------------------------------------------


# Where a weight group's rank 0 may be: never an address no trainer is at (link-local, such as
# a cloud's metadata service, multicast, unspecified), so a caller cannot point the engine there.
MAX_GROUP_NAME_CHARS = 128
MAX_WORLD_SIZE = 65536


def check_group_endpoint(address: str, port: int, world_size: int, group_name: str, backend: str) -> None:
    """The group's parameters, checked before anything waits on them (a join blocks until every
    rank arrives, and the weight routes queue behind it)."""
    if backend not in ("nccl", "gloo"):
        raise WeightUpdateError(f"backend must be 'nccl' or 'gloo', got {backend[:40]!r}")
    if not 1 <= port <= 65535:
        raise WeightUpdateError(f"master_port must be in [1, 65535], got {port}")
    if not 2 <= world_size <= MAX_WORLD_SIZE:
        raise WeightUpdateError(f"world_size must be in [2, {MAX_WORLD_SIZE}] (the trainer and the engines)")
    if not group_name or len(group_name) > MAX_GROUP_NAME_CHARS or not group_name.isprintable():
        raise WeightUpdateError(f"group_name must be 1..{MAX_GROUP_NAME_CHARS} printable characters")
    host = address.strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    if ip is None:
        if not host.isascii() or not all(c.isalnum() or c in "-_." for c in host) or not is_host_name(host):
            raise WeightUpdateError(f"master_address {address[:100]!r} is neither an IP address nor a host name")
        if host.lower().rstrip(".") in METADATA_HOSTS:
            raise WeightUpdateError(f"master_address {address!r} is a cloud metadata host, never a trainer")
    elif ip.is_link_local or ip.is_multicast or ip.is_unspecified:
        raise WeightUpdateError(
            f"master_address {address!r} is a link-local, multicast or unspecified address, never a trainer"
        )


class WeightGroups:
    """Weight-update groups this engine has joined, by group name."""

    def __init__(self, device: torch.device, timeout_s: float) -> None:
        self.device = device
        self.timeout_s = timeout_s
        self._groups: dict[str, dist.ProcessGroup] = {}

    def init(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> None:
        """Join the group as rank `rank_offset` (this engine has one TP rank); blocks until
        every rank, the trainer's rank 0 included, has joined."""
        check_group_endpoint(master_address, master_port, world_size, group_name, backend)
        if group_name in self._groups:
            raise WeightUpdateError(f"weight-update group {group_name!r} already exists; destroy it first")
        if not 1 <= rank_offset < world_size:
            raise WeightUpdateError(
                f"rank_offset must be in [1, world_size) (rank 0 is the trainer); got {rank_offset}"
            )
        if backend == "nccl" and self.device.type != "cuda":
            raise WeightUpdateError("backend 'nccl' needs a GPU; the reference engine on cpu joins with backend 'gloo'")
        try:
            group = init_weight_group(
                backend,
                master_address,
                master_port,
                world_size,
                rank_offset,
                group_name,
                timeout_seconds=self.timeout_s,
            )
        except Exception as e:
            raise WeightUpdateError(
                f"failed to join weight-update group {group_name!r}: {type(e).__name__}: {e}"
            ) from e
        self._groups[group_name] = group

    def get(self, group_name: str) -> dist.ProcessGroup:
        group = self._groups.get(group_name)
        if group is None:
            raise WeightUpdateError(
                f"weight-update group {group_name!r} not found (known: {sorted(self._groups)}); "
                "call /init_weights_update_group first"
            )
        return group

    def destroy(self, group_name: str) -> None:
        group = self._groups.pop(group_name, None)
        if group is None:
            raise WeightUpdateError(f"weight-update group {group_name!r} does not exist")
        destroy_weight_group(group, group_name)

    def destroy_all(self) -> None:
        for name in list(self._groups):
            self.destroy(name)


class ReceiveBuffers:
    """Receive buffers kept from one bucket to the next: receiving into a fresh 64 MiB
    tensor costs about as much in page faults as the transfer itself. A buffer is taken
    for a bucket and given back once the bucket is in the model; `keep` are kept."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes and b.device == device]
            if fits:  # the smallest that fits (list.remove would compare tensors by value)
                return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def give(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buffer)
            self._free.sort(key=torch.Tensor.numel, reverse=True)
            del self._free[self.keep :]

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


class TensorPool:
    """Memory for tensors received one per broadcast (load_format null), recycled by size:
    a received tensor is put in the model in place of the old one (no copy), and the old
    one's memory receives a later tensor of the same size (layers repeat their shapes), so
    a push neither copies nor page-faults fresh memory. Holds at most `limit_bytes` free."""

    def __init__(self) -> None:
        self.limit_bytes = 0
        self._free: dict[tuple[int, str], list[torch.Tensor]] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def take(self, spec: TensorSpec, device: torch.device) -> torch.Tensor:
        with self._lock:
            free = self._free.get((spec.nbytes, str(device)))
            if free:
                self._bytes -= spec.nbytes
                return free.pop().view(spec.dtype).reshape(spec.shape)
        return torch.empty(spec.shape, dtype=spec.dtype, device=device)

    def give(self, tensor: torch.Tensor) -> None:
        """Recycle a tensor's memory, if it is a whole storage nobody else uses."""
        nbytes = tensor.numel() * tensor.element_size()
        if (
            not tensor.is_contiguous()
            or tensor.storage_offset()
            or tensor.untyped_storage().nbytes() != nbytes
            or not nbytes
        ):
            return
        with self._lock:
            if self._bytes + nbytes <= self.limit_bytes:
                self._free.setdefault((nbytes, str(tensor.device)), []).append(
                    tensor.detach().reshape(-1).view(torch.uint8)
                )
                self._bytes += nbytes

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._bytes = 0


def receive(
    specs: Sequence[TensorSpec],
    group: dist.ProcessGroup,
    load_format: str | None,
    device: torch.device,
    buffer: torch.Tensor | None = None,
    pool: TensorPool | None = None,
) -> list[tuple[str, torch.Tensor]]:
    """Receive the tensors broadcast by rank 0, in `specs` order: one per broadcast into
    tensors from `pool` (or fresh ones), or a flattened bucket into `buffer` (uint8, at
    least the bucket's bytes) or fresh memory, the tensors returned being views of it."""
    if load_format not in (None, "flattened_bucket"):
        raise WeightUpdateError(f"unknown load_format {load_format!r}; use null or 'flattened_bucket'")
    try:
        if load_format is None:
            received = []
            for spec in specs:
                tensor = pool.take(spec, device) if pool else torch.empty(spec.shape, dtype=spec.dtype, device=device)
                dist.broadcast(tensor, src=0, group=group)
                received.append((spec.name, tensor))
            return received
        if buffer is None:
            buffer = torch.empty(receive_bytes(specs, load_format), dtype=torch.uint8, device=device)
        bucket = buffer[: receive_bytes(specs, load_format)]
        dist.broadcast(bucket, src=0, group=group)
    except Exception as e:
        raise BroadcastFailed(f"receiving the broadcast failed: {type(e).__name__}: {e}") from e
    received, offset = [], 0
    for spec in specs:
        chunk = bucket[offset : offset + spec.nbytes]
        if offset % spec.dtype.itemsize:
            # A dtype view needs its start aligned to the dtype size and the bucket has no
            # padding: only a bucket mixing dtypes gets here (rlmesh's hold one dtype each).
            chunk = chunk.clone()
        received.append((spec.name, chunk.view(spec.dtype).reshape(spec.shape)))
        offset += spec.nbytes
    return received


def receive_bytes(specs: Sequence[TensorSpec], load_format: str | None) -> int:
    return sum(s.nbytes for s in specs)


# -- delta updates (an rlmesh extension) ---------------------------------------

DELTA_INDEX_DTYPES = {"int32": torch.int32, "int64": torch.int64}


@dataclass(frozen=True)
class WeightDelta:
    """The changed elements of one bucket: `count` flat element indices into the bucket's
    tensors laid end to end in `names` order (strictly increasing), and their values in
    the bucket's one dtype, applied over the weights of version `base_version`."""

    count: int
    index_dtype: torch.dtype
    base_version: str


@dataclass
class ReceivedDelta:
    specs: list[TensorSpec]
    indices: torch.Tensor  # int64, strictly increasing, in [0, total elements)
    values: torch.Tensor
    base_version: str


def parse_delta(raw: Any, specs: Sequence[TensorSpec]) -> WeightDelta:
    if not isinstance(raw, dict):
        raise WeightUpdateError("rlmesh_delta must be an object {count, index_dtype, base_version}")
    count, index_dtype, base = raw.get("count"), raw.get("index_dtype"), raw.get("base_version")
    total = sum(math.prod(s.shape) for s in specs)
    if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count <= total:
        raise WeightUpdateError(
            f"rlmesh_delta.count must be an integer in [0, {total}] (the bucket's elements), got {count!r}"
        )
    if index_dtype not in DELTA_INDEX_DTYPES:
        raise WeightUpdateError(
            f"rlmesh_delta.index_dtype must be one of {sorted(DELTA_INDEX_DTYPES)}, got {index_dtype!r}"
        )
    if not isinstance(base, str) or not base:
        raise WeightUpdateError("rlmesh_delta.base_version must name the weight version the delta applies to")
    if len({s.dtype for s in specs}) != 1:
        raise WeightUpdateError("a delta bucket must hold tensors of one dtype")
    return WeightDelta(count, DELTA_INDEX_DTYPES[index_dtype], base)


def receive_delta(
    specs: Sequence[TensorSpec], delta: WeightDelta, group: dist.ProcessGroup, device: torch.device
) -> ReceivedDelta:
    """Receive one delta bucket (a uint8 broadcast: the indices, then the values), and
    check the indices before anything is applied."""
    value_dtype = specs[0].dtype
    index_bytes = delta.count * delta.index_dtype.itemsize
    try:
        payload = torch.empty(index_bytes + delta.count * value_dtype.itemsize, dtype=torch.uint8, device=device)
        if payload.numel():
            dist.broadcast(payload, src=0, group=group)
    except Exception as e:
        raise BroadcastFailed(f"receiving the delta broadcast failed: {type(e).__name__}: {e}") from e
    # The values start at a multiple of the index size (4 or 8), so their view is aligned.
    indices = payload[:index_bytes].view(delta.index_dtype).long()
    values = payload[index_bytes:].view(value_dtype)
    total = sum(math.prod(s.shape) for s in specs)
    if indices.numel() and (
        int(indices[0]) < 0 or int(indices[-1]) >= total or not bool((indices[1:] > indices[:-1]).all())
    ):
        raise WeightUpdateError(
            f"delta indices must be strictly increasing and in [0, {total}). No weights were changed."
        )
    return ReceivedDelta(list(specs), indices, values, delta.base_version)


def apply_delta(model: torch.nn.Module, delta: ReceivedDelta, weight_version: str) -> int:
    """Write a delta's values over the model's weights; run in the engine thread. The
    weights must be at the delta's base version, else nothing is changed. Values are
    converted to the model's dtype as a full update's copy converts them, so the result
    is bit for bit the one a full update of the same tensors gives."""
    if weight_version != delta.base_version:
        raise WeightUpdateError(
            f"this delta applies to weight version {delta.base_version!r} but the engine holds {weight_version!r}; "
            "push the weights in full. No weights were changed."
        )
    targets = model_tensors(model)
    starts = [0]
    for spec in delta.specs:
        starts.append(starts[-1] + math.prod(spec.shape))
    bounds = torch.searchsorted(delta.indices, torch.tensor(starts, dtype=torch.long)).tolist()
    with torch.no_grad():
        for i, spec in enumerate(delta.specs):
            lo, hi = bounds[i], bounds[i + 1]
            if lo == hi:
                continue
            target = targets[spec.name].data
            flat = target.view(-1)  # parameters are contiguous (checked by check_delta_targets)
            flat[delta.indices[lo:hi] - starts[i]] = delta.values[lo:hi].to(flat.dtype)
    return int(delta.indices.numel())


def check_delta_targets(model: torch.nn.Module, specs: Sequence[TensorSpec]) -> None:
    """A delta writes into the weights in place: every target must be contiguous."""
    targets = model_tensors(model)
    scattered = [s.name for s in specs if not targets[s.name].is_contiguous()]
    if scattered:
        raise WeightUpdateError(f"cannot apply a delta to non-contiguous tensors {scattered[:10]}; push in full")


# -- the model's side --------------------------------------------------------


# Per model: its Parameter objects never change (every update swaps or copies into their
# .data), and state_dict costs milliseconds, which a push spent again on every bucket.
_tensors_of: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, torch.Tensor]] = weakref.WeakKeyDictionary()


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by Hugging Face name, tied aliases included (the
    Parameter objects themselves: read-only to callers)."""
    tensors = _tensors_of.get(model)
    if tensors is None:
        tensors = _tensors_of[model] = dict(model.state_dict(keep_vars=True))
    return tensors


def check_against_model(model: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]]) -> None:
    targets = model_tensors(model)
    unknown, mismatched = [], []
    for name, tensor in named:
        target = targets.get(name)
        if target is None:
            unknown.append(name)
        elif tuple(target.shape) != tuple(tensor.shape):
            mismatched.append(f"{name}: model {list(target.shape)}, sent {list(tensor.shape)}")
    problems = []
    if unknown:
        problems.append(f"unknown parameter name(s) {unknown[:10]}{' ...' if len(unknown) > 10 else ''}")
    if mismatched:
        problems.append(f"shape mismatch: {'; '.join(mismatched[:10])}")
    if problems:
        raise WeightUpdateError("; ".join(problems) + ". No weights were changed.")


def load_into_model(model: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy tensors into the model (converting dtype/device); run between decode steps."""
    targets = model_tensors(model)
    count = 0
    with torch.no_grad():
        for name, tensor in named:
            targets[name].data.copy_(tensor)
            count += 1
    return count


def alias_into_model(model: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Make the model's tensors the given ones where dtype, device and shape match (they
    become its memory: no copy), copy the others in; run between decode steps."""
    targets = model_tensors(model)
    count = 0
    with torch.no_grad():
        for name, tensor in named:
            target = targets[name]
            if target.dtype == tensor.dtype and target.device == tensor.device and target.shape == tensor.shape:
                target.data = tensor
            else:
                target.data.copy_(tensor)
            count += 1
    return count


def install_into_model(model: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]], pool: TensorPool) -> int:
    """Put received tensors (each its own memory, from receive with load_format null) in
    the model: swapped in for the old ones where dtype, device and layout match (the old
    memory goes to `pool`), copied in otherwise (the received memory goes to `pool`).
    Run between decode steps."""
    targets = model_tensors(model)
    count = 0
    with torch.no_grad():
        for name, tensor in named:
            target = targets[name]
            if (
                target.dtype == tensor.dtype
                and target.device == tensor.device
                and target.shape == tensor.shape
                and target.is_contiguous()
                and tensor.is_contiguous()
            ):
                old, target.data = target.data, tensor
                pool.give(old)
            else:
                target.data.copy_(tensor)
                pool.give(tensor)
            count += 1
    return count


def read_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a Hugging Face checkpoint directory (safetensors, else .bin)."""
    directory = Path(path)
    if not directory.is_dir():
        raise WeightUpdateError(f"model_path {str(path)!r} is not a directory")
    tensors: dict[str, torch.Tensor] = {}
    files = sorted(directory.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        for f in files:
            tensors.update(load_file(str(f)))
    else:
        for f in sorted(directory.glob("*.bin")):
            tensors.update(torch.load(f, map_location="cpu", weights_only=True))
    if not tensors:
        raise WeightUpdateError(f"no *.safetensors or *.bin weight files in {str(path)!r}")
    return tensors


def checkpoint_for_model(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint tensors this model has (extra ones, e.g. rotary inv_freq, are skipped);
    shapes must match and at least one must be found."""
    targets = model_tensors(model)
    named = [(n, t) for n, t in tensors.items() if n in targets]
    if not named:
        raise WeightUpdateError(f"none of the checkpoint's {len(tensors)} tensors match this model's parameter names")
    check_against_model(model, named)
    return named


def weights_by_name(model: torch.nn.Module, name: str, truncate_size: int) -> Any:
    """A parameter as (nested) lists of float32 values, its first dimension cut to
    truncate_size, like SGLang's /get_weights_by_name."""
    tensor = model_tensors(model).get(name)
    if tensor is None:
        raise WeightUpdateError(f"unknown parameter name {name!r}")
    data = tensor.detach()
    if data.dim() > 0:
        data = data[:truncate_size]
    return data.to(device="cpu", dtype=torch.float32).tolist()
