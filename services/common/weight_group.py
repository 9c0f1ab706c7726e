"""The process group that carries weight updates from the trainer (rank 0) to the
inference engines (ranks 1..N). It is built the way SGLang builds it on the engine side
(a TCP store hosted by rank 0, wrapped in a prefix named after the group), so that the
trainer can join real SGLang servers as well as the reference engine. It is a separate
group, not the default one, so a trainer that already runs torch.distributed for its
own parallelism is unaffected."""

from __future__ import annotations

import inspect
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

# The rlmesh delta-update format (docs/engine-api.md, "Delta weight updates"): engines that
# accept it say so in /get_server_info as "rlmesh_weight_delta"; SGLang says nothing.
WEIGHT_DELTA_FORMAT = "rlmesh-delta-v1"

# The key of /get_server_info where the reference engine names its GPU (absent on CPU; SGLang
# never says): the trainer gives NCCL no group where two ranks share one GPU.
GPU_KEY = "rlmesh_gpu_uuid"


def gpu_uuid(device: torch.device | str | None = None) -> str:
    """The CUDA device's UUID (one per physical GPU, whatever CUDA_VISIBLE_DEVICES numbers
    it), or "" off CUDA. NCCL refuses a group with two ranks on one GPU ("Duplicate GPU
    detected"), so ranks compare these before choosing NCCL."""
    device = torch.device(device) if device is not None else None
    if not torch.cuda.is_available() or (device is not None and device.type != "cuda"):
        return ""
    index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    return str(torch.cuda.get_device_properties(index).uuid)


# Rank 0's TCP store is the rendezvous server: keep it alive as long as its group.
_stores: dict[str, dist.Store] = {}


def init_weight_group(
    backend: str,
    master_address: str,
    master_port: int,
    world_size: int,
    rank: int,
    group_name: str,
    timeout_seconds: float = 300.0,
    listen_fd: int | None = None,
) -> dist.ProcessGroup:
    """Join (rank 0: host) the group. Rank 0 passes `listen_fd` from rendezvous_socket so
    that its store listens on one interface only.

    The store is the one torch's `tcp://` rendezvous builds, which is what SGLang and the
    RL trainers that drive it (slime, AReaL, OpenRLHF, SkyRL) use on both sides: every rank
    checks in, and rank 0's store waits until all `world_size` ranks have. A rank that does
    not check in leaves such a rank 0 waiting ("1/2 clients joined") until it times out.
    So this blocks rank 0 until every engine has joined: call it concurrently with the
    engines' /init_weights_update_group."""
    timeout = timedelta(seconds=timeout_seconds)
    store = dist.TCPStore(
        master_address,
        master_port,
        world_size,
        is_master=(rank == 0),
        timeout=timeout,
        wait_for_workers=True,
        multi_tenant=True,
        master_listen_fd=listen_fd,
    )
    prefixed = PrefixStore(group_name, store)
    # torch renamed pg_options -> backend_options; accept either.
    options = (
        "backend_options"
        if "backend_options" in inspect.signature(_new_process_group_helper).parameters
        else "pg_options"
    )
    group, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), prefixed, group_name=group_name, timeout=timeout, **{options: None}
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    _stores[group_name] = store
    return group


def rendezvous_socket(bind_address: str) -> tuple[int, int]:
    """A listening socket on `bind_address` (a free port) for rank 0's store, which would
    otherwise listen on every interface. Returns (port, fd); the store takes the fd over."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(bind_address, 0, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.bind(address)
            sock.listen(128)
        except OSError:
            sock.close()
            raise
    except OSError as e:
        raise OSError(
            f"cannot listen for the weight group's rendezvous on {bind_address!r}: {e}; set the trainer's "
            "weight_sync_bind_address to an address of this machine"
        ) from None
    return sock.getsockname()[1], sock.detach()


def destroy_weight_group(group: dist.ProcessGroup, group_name: str) -> None:
    _stores.pop(group_name, None)
    try:
        dist.destroy_process_group(group)
    except (ValueError, RuntimeError, AssertionError):
        # Not registered with the default world (no default group): drop our entry.
        _world.pg_group_ranks.pop(group, None)
