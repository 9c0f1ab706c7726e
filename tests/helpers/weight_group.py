"""The trainer's end of an engine's weight-update group, for tests that drive the engine's
weight routes themselves."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import torch

from rlmesh.common.net import free_port
from rlmesh.common.weight_group import destroy_weight_group, init_weight_group


def in_background(fn, *args, **kwargs) -> Future:
    pool = ThreadPoolExecutor(max_workers=1)
    future = pool.submit(fn, *args, **kwargs)
    pool.shutdown(wait=False)
    return future


def join_body(port: int, group_name: str) -> dict:
    """/init_weights_update_group's body for an engine joining as rank 1 of 2 over gloo, rank 0
    (the test, as the trainer) listening on `port` of loopback."""
    return {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": group_name,
        "backend": "gloo",
    }


class WeightSender:
    """Rank 0 of a weight-update group, as the trainer runs it."""

    def __init__(self, client: httpx.Client, group_name: str) -> None:
        self.client = client
        self.group_name = group_name
        port = free_port()
        joined = in_background(client.post, "/init_weights_update_group", json=join_body(port, group_name))
        self.group = init_weight_group("gloo", "127.0.0.1", port, 2, 0, group_name, timeout_seconds=60)
        r = joined.result(60)
        assert r.status_code == 200 and r.json()["success"] is True, r.text

    def send(self, named: list[tuple[str, torch.Tensor]], version: str, flattened: bool = False) -> httpx.Response:
        body = {
            "names": [n for n, _ in named],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
            "shapes": [list(t.shape) for _, t in named],
            "group_name": self.group_name,
            "weight_version": version,
            "load_format": "flattened_bucket" if flattened else None,
        }
        answer = in_background(self.client.post, "/update_weights_from_distributed", json=body)
        if flattened:
            bucket = torch.cat([t.contiguous().view(-1).view(torch.uint8) for _, t in named])
            torch.distributed.broadcast(bucket, src=0, group=self.group)
        else:
            for _, t in named:
                torch.distributed.broadcast(t, src=0, group=self.group)
        return answer.result(60)

    def close(self) -> None:
        r = self.client.post("/destroy_weights_update_group", json={"group_name": self.group_name})
        assert r.status_code == 200 and r.json()["success"] is True
        destroy_weight_group(self.group, self.group_name)
