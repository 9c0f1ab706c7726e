"""gRPC transport for the buffer: thin handlers over BufferStore."""

from __future__ import annotations

import grpc
import redis.asyncio as aioredis

from rlmesh.v1 import buffer_pb2, buffer_pb2_grpc
from services.buffer.config import Settings
from services.buffer.store import BufferStore
from services.common.grpc_server import ServiceBinding, serve_forever, start_server
from services.common.errors import Unimplemented


class BufferServicer(buffer_pb2_grpc.BufferServicer):
    def __init__(self, store: BufferStore, settings: Settings) -> None:
        self.store = store
        self.settings = settings

    async def CreateRun(self, request, context):
        return buffer_pb2.CreateRunResponse(created=await self.store.create_run(request))

    async def DeleteRun(self, request, context):
        return buffer_pb2.DeleteRunResponse(keys_deleted=await self.store.delete_run(request.run_id))

    async def GetPrompts(self, request, context):
        lease = request.lease_seconds or self.settings.prompt_lease_seconds
        groups = await self.store.get_prompts(request.run_id, request.num_groups, lease)
        return buffer_pb2.GetPromptsResponse(groups=groups)

    async def GetEvalPrompts(self, request, context):
        return buffer_pb2.GetPromptsResponse(groups=await self.store.get_eval_prompts(request))

    async def PutGroups(self, request, context):
        stored, duplicates = await self.store.put_groups(request.run_id, request.groups)
        return buffer_pb2.PutGroupsResponse(stored=stored, duplicates=duplicates)

    async def ReturnPartialGroups(self, request, context):
        stored = await self.store.return_partial_groups(request.run_id, request.groups)
        return buffer_pb2.PutGroupsResponse(stored=stored)

    async def DropGroups(self, request, context):
        dropped = await self.store.drop_groups(request.run_id, request.group_ids, request.reason)
        return buffer_pb2.DropGroupsResponse(dropped=dropped)

    async def LeaseBatch(self, request, context):
        lease_id, groups = await self.store.lease_batch(
            request, self.settings.batch_lease_seconds, self.settings.poll_interval_seconds
        )
        return buffer_pb2.LeaseBatchResponse(lease_id=lease_id, groups=groups)

    async def AckBatch(self, request, context):
        return buffer_pb2.AckBatchResponse(acknowledged=await self.store.ack_batch(request.run_id, request.lease_id))

    async def GetStats(self, request, context):
        return await self.store.stats(request.run_id)

    async def ExportGroups(self, request, context):
        raise Unimplemented("ExportGroups is not implemented yet: it will write a run's queued groups to JSONL")

    async def ImportGroups(self, request, context):
        raise Unimplemented("ImportGroups is not implemented yet: it will load groups from a JSONL export")


def _binding(settings: Settings) -> ServiceBinding:
    store = BufferStore(aioredis.Redis.from_url(settings.redis_url), settings.key_prefix)
    return ServiceBinding(
        BufferServicer(store, settings),
        buffer_pb2_grpc.add_BufferServicer_to_server,
        buffer_pb2.DESCRIPTOR.services_by_name["Buffer"].full_name,
    )


async def start(settings: Settings) -> tuple[grpc.aio.Server, int]:
    server, port, _ = await start_server([_binding(settings)], f"{settings.host}:{settings.port}", settings.max_message_bytes)
    return server, port


async def serve(settings: Settings) -> None:
    await serve_forever([_binding(settings)], f"{settings.host}:{settings.port}", settings.max_message_bytes)
