"""gRPC transport for the rollout service: thin handlers over RolloutManager and the
engine pool (weight-update calls are relayed to every engine with its rank offset)."""

from __future__ import annotations

import asyncio
import functools

from rlmesh.common.errors import InvalidArgument, Unavailable, Unimplemented
from rlmesh.common.grpc_server import Service, ServiceBinding, aio_channel, start_service
from rlmesh.rollout.config import Settings
from rlmesh.rollout.engine_client import EnginePool
from rlmesh.rollout.rollout import RolloutManager
from rlmesh.v1 import buffer_pb2_grpc, reward_pb2_grpc, rollout_pb2, rollout_pb2_grpc


class RolloutServicer(rollout_pb2_grpc.RolloutServicer):
    def __init__(self, manager: RolloutManager, pool: EnginePool) -> None:
        self.manager = manager
        self.pool = pool

    async def GenerateRollout(self, request, context):
        return await self.manager.generate_rollout(request)

    async def Evaluate(self, request, context):
        return await self.manager.evaluate(request)

    async def StartAsyncRollout(self, request, context):
        raise Unimplemented("StartAsyncRollout is not implemented yet: it will keep generations in flight across steps")

    async def StopAsyncRollout(self, request, context):
        raise Unimplemented("StopAsyncRollout is not implemented yet")

    async def ListEngines(self, request, context):
        states = await self.pool.states()
        return rollout_pb2.ListEnginesResponse(
            engines=[rollout_pb2.EngineInfo(url=s.url, tp_size=s.tp_size, weight_version=s.weight_version,
                                            healthy=s.healthy, model_path=s.model_path) for s in states],
            weight_group_world_size=1 + sum(s.tp_size for s in states),
        )

    async def PauseGeneration(self, request, context):
        mode = request.mode or "abort"
        if mode not in ("abort", "retract", "in_place"):
            raise InvalidArgument(f"pause mode must be abort, retract or in_place, got {mode!r}")
        await asyncio.gather(*(e.pause(mode) for e in self.pool.engines))
        return self._done("paused")

    async def ContinueGeneration(self, request, context):
        await asyncio.gather(*(e.resume() for e in self.pool.engines))
        return self._done("continued")

    async def InitWeightUpdateGroup(self, request, context):
        if request.world_size < 2:
            raise InvalidArgument("world_size must count the trainer (rank 0) and every engine rank")
        states = await self.pool.states()
        unhealthy = [s.url for s in states if not s.healthy]
        if unhealthy:
            raise Unavailable(f"engines not answering: {unhealthy}")
        expected = 1 + sum(s.tp_size for s in states)
        if request.world_size != expected:
            raise InvalidArgument(f"world_size {request.world_size} does not match the engines: 1 + TP sizes = {expected}")
        offsets, offset = [], 1
        for s in states:
            offsets.append(offset)
            offset += s.tp_size
        await asyncio.gather(*(
            e.weight_call("/init_weights_update_group", {
                "master_address": request.master_address, "master_port": request.master_port,
                "rank_offset": rank_offset, "world_size": request.world_size,
                "group_name": request.group_name or "weight_update_group", "backend": request.backend or "nccl",
            })
            for e, rank_offset in zip(self.pool.engines, offsets)
        ))
        return self._done(f"{len(states)} engines joined group {request.group_name!r}")

    async def UpdateWeights(self, request, context):
        if not request.tensors:
            raise InvalidArgument("UpdateWeights needs at least one tensor")
        body = {
            "names": [t.name for t in request.tensors],
            "dtypes": [t.dtype for t in request.tensors],
            "shapes": [list(t.shape) for t in request.tensors],
            "group_name": request.group_name or "weight_update_group",
            "flush_cache": request.flush_cache,
            "abort_all_requests": False,
            "weight_version": request.weight_version or None,  # None: unchanged (earlier buckets)
            "load_format": request.load_format or None,
        }

        async def one(engine):
            await engine.begin_weight_update()
            try:
                await engine.weight_call("/update_weights_from_distributed", body)
            finally:
                await engine.end_weight_update()

        await asyncio.gather(*(one(e) for e in self.pool.engines))
        return self._done(f"{len(request.tensors)} tensors at version {request.weight_version}")

    async def DestroyWeightUpdateGroup(self, request, context):
        await asyncio.gather(*(e.weight_call("/destroy_weights_update_group",
                                             {"group_name": request.group_name or "weight_update_group"})
                               for e in self.pool.engines))
        return self._done("destroyed")

    async def UpdateWeightsFromDisk(self, request, context):
        if not request.model_path:
            raise InvalidArgument("model_path is required")
        await asyncio.gather(*(e.weight_call("/update_weights_from_disk", {
            "model_path": request.model_path, "weight_version": request.weight_version, "flush_cache": True})
            for e in self.pool.engines))
        return self._done(f"loaded {request.model_path}")

    def _done(self, message: str) -> rollout_pb2.EngineCallResponse:
        return rollout_pb2.EngineCallResponse(engines=[e.url for e in self.pool.engines], message=message)


async def build(settings: Settings) -> Service:
    """The servicer over an engine pool and clients of the buffer and reward services."""
    pool = EnginePool(settings.engine_urls, settings.router_url, settings.request_timeout_seconds,
                      settings.weight_update_timeout_seconds)
    buffer_channel = aio_channel(settings.buffer_address, settings.max_message_bytes)
    reward_channel = aio_channel(settings.reward_address, settings.max_message_bytes)
    manager = RolloutManager(settings, pool, buffer_pb2_grpc.BufferStub(buffer_channel),
                             reward_pb2_grpc.RewardStub(reward_channel))

    async def close() -> None:
        await pool.close()
        await buffer_channel.close()
        await reward_channel.close()

    binding = ServiceBinding(RolloutServicer(manager, pool), rollout_pb2_grpc.add_RolloutServicer_to_server,
                             rollout_pb2.DESCRIPTOR.services_by_name["Rollout"].full_name)
    return Service([binding], on_shutdown=close)


start = functools.partial(start_service, build)
