"""The process group that carries weight updates from the trainer (rank 0) to the
inference engines (ranks 1..N). It is built the way SGLang builds it on the engine side
(a TCP store hosted by rank 0, wrapped in a prefix named after the group), so that the
trainer can join real SGLang servers as well as the reference engine. It is a separate
group, not the default one, so a trainer that already runs torch.distributed for its
own parallelism is unaffected."""

from __future__ import annotations

import inspect
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

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
) -> dist.ProcessGroup:
    timeout = timedelta(seconds=timeout_seconds)
    store = dist.TCPStore(
        master_address, master_port, world_size, is_master=(rank == 0), timeout=timeout, wait_for_workers=False
    )
    prefixed = PrefixStore(group_name, store)
    # torch renamed pg_options -> backend_options; accept either.
    options = "backend_options" if "backend_options" in inspect.signature(_new_process_group_helper).parameters else "pg_options"
    group, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), prefixed, group_name=group_name, timeout=timeout, **{options: None}
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    _stores[group_name] = store
    return group


def destroy_weight_group(group: dist.ProcessGroup, group_name: str) -> None:
    _stores.pop(group_name, None)
    try:
        dist.destroy_process_group(group)
    except (ValueError, RuntimeError, AssertionError):
        # Not registered with the default world (no default group): drop our entry.
        _world.pg_group_ranks.pop(group, None)
