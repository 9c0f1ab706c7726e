"""gRPC transport for the buffer: thin handlers over BufferStore.

Groups cross the buffer as bytes: PutGroups stores each group's bytes exactly as the
client sent them, and LeaseBatch / GetPrompts answer with responses the store already
built in wire form (their method handlers take bytes; see rlmesh.buffer.wire)."""

from __future__ import annotations

import functools
import logging

import grpc
import redis
import redis.asyncio as aioredis
from google.protobuf import message_factory

from rlmesh.buffer import metrics, transfer, wire
from rlmesh.buffer.config import Settings
from rlmesh.buffer.filters import load_filter
from rlmesh.buffer.sources import DataFiles
from rlmesh.buffer.store import BufferStore
from rlmesh.common.dataset_spec import dataset_from_proto
from rlmesh.common.errors import InvalidArgument, ResourceExhausted, Unavailable
from rlmesh.common.grpc_server import Service, ServiceBinding, start_service
from rlmesh.common.limits import MAX_DATASETS, Limits, at_most, seconds, within
from rlmesh.v1 import buffer_pb2, buffer_pb2_grpc, check_pb2

log = logging.getLogger(__name__)

_SERVICE = buffer_pb2.DESCRIPTOR.services_by_name["Buffer"]
_STALE_POLICIES = {  # policy -> keep stale groups
    buffer_pb2.LeaseBatchRequest.STALE_POLICY_DROP: False,
    buffer_pb2.LeaseBatchRequest.STALE_POLICY_KEEP: True,
}


class BufferServicer(buffer_pb2_grpc.BufferServicer):
    def __init__(self, store: BufferStore, settings: Settings) -> None:
        self.store = store
        self.settings = settings

    async def CreateRun(self, request, context):
        within(
            [
                (len(request.datasets), MAX_DATASETS, "datasets of a run", ""),
                (
                    request.n_samples_per_prompt,
                    self.settings.limits.max_samples_per_prompt,
                    "n_samples_per_prompt",
                    "max_samples_per_prompt",
                ),
            ]
        )
        datasets = [dataset_from_proto(d, request) for d in request.datasets]
        created = await self.store.create_run(
            request.run_id, datasets, request.n_samples_per_prompt, request.max_queued_groups, request.vocab_size
        )
        return buffer_pb2.CreateRunResponse(created=created)

    async def CheckDatasets(self, request, context):
        within([(len(request.datasets), MAX_DATASETS, "datasets of a run", "")])
        problems = []
        for i, spec in enumerate(request.datasets):
            try:
                dataset = dataset_from_proto(spec, request)
            except InvalidArgument as e:
                problems.append(check_pb2.FieldProblem(field=f"datasets.{i}", message=str(e)))
                continue
            # (a tokenizer the dataset does not name is the run's model)
            named = bool(spec.tokenizer_path)
            for name, message in self.store.prompts.data_files.check(dataset, named):
                field = "model_path" if name == "tokenizer_path" and not named else f"datasets.{i}.{name}"
                problems.append(check_pb2.FieldProblem(field=field, message=message))
        return check_pb2.CheckResponse(problems=problems)

    async def DeleteRun(self, request, context):
        return buffer_pb2.DeleteRunResponse(keys_deleted=await self.store.delete_run(request.run_id))

    async def CloseRun(self, request, context):
        return buffer_pb2.CloseRunResponse(keys_deleted=await self.store.close_run(request.run_id))

    async def GetPrompts(self, request, context) -> bytes:
        at_most(request.num_groups, self.settings.limits.max_groups_per_call, "num_groups", "max_groups_per_call")
        lease = seconds(request.lease_seconds, "lease_seconds") or self.settings.prompt_lease_seconds
        groups = await self.store.prompts.get_prompts(
            request.run_id,
            request.num_groups,
            lease,
            within_queue_cap=request.within_queue_cap,
            max_groups_ahead=request.max_groups_ahead,
            reclaim_leases=request.reclaim_leases,
        )
        return wire.repeated_messages(1, groups)  # GetPromptsResponse.groups

    async def GetEvalPrompts(self, request, context) -> bytes:
        limits = self.settings.limits
        n = request.n_samples_per_prompt or 1
        within(
            [
                (n, limits.max_samples_per_prompt, "n_samples_per_prompt", "max_samples_per_prompt"),
                (
                    request.limit * n,
                    limits.max_samples_per_call,
                    "samples asked for (limit x n_samples_per_prompt)",
                    "max_samples_per_call",
                ),
            ]
        )
        groups = await self.store.prompts.get_eval_prompts(
            request.run_id,
            request.dataset,
            request.offset,
            request.limit,
            request.n_samples_per_prompt or 1,
            wrap=request.wrap,
        )
        return wire.repeated_messages(1, groups)  # GetPromptsResponse.groups

    async def PutGroups(self, request: wire.PutGroupsWire, context):
        _check_counts(request.groups, self.settings.limits)
        stored, duplicates = await self.store.put_groups(request.run_id, request.groups, request.raw_groups)
        return buffer_pb2.PutGroupsResponse(stored=stored, duplicates=duplicates)

    async def ReturnPartialGroups(self, request: wire.PutGroupsWire, context):
        _check_counts(request.groups, self.settings.limits)
        stored = await self.store.return_partial_groups(request.run_id, request.groups, request.raw_groups)
        return buffer_pb2.PutGroupsResponse(stored=stored)

    async def DropGroups(self, request, context):
        at_most(
            len(request.group_ids),
            self.settings.limits.max_groups_per_call,
            "group ids in one call",
            "max_groups_per_call",
        )
        dropped = await self.store.drop_groups(request.run_id, request.group_ids, request.reason)
        return buffer_pb2.DropGroupsResponse(dropped=dropped)

    async def LeaseBatch(self, request, context) -> bytes:
        if request.stale_policy not in _STALE_POLICIES:
            raise InvalidArgument(f"unknown stale_policy {request.stale_policy}; use DROP (0) or KEEP (1)")
        limits = self.settings.limits
        within(
            [
                (request.num_groups, limits.max_groups_per_call, "num_groups", "max_groups_per_call"),
                (request.num_samples, limits.max_samples_per_call, "num_samples", "max_samples_per_call"),
            ]
        )
        batch = await self.store.lease_batch(
            request.run_id,
            num_groups=request.num_groups,
            num_samples=request.num_samples,
            lease_seconds=seconds(request.lease_seconds, "lease_seconds") or self.settings.batch_lease_seconds,
            wait_seconds=seconds(request.wait_seconds, "wait_seconds"),
            min_weight_version=request.min_weight_version,
            keep_stale=_STALE_POLICIES[request.stale_policy],
            poll_seconds=self.settings.poll_interval_seconds,
            lease_id=request.lease_id,
            min_groups=dict(request.min_groups_by_dataset),
        )
        return batch.response

    async def AckBatch(self, request, context):
        return buffer_pb2.AckBatchResponse(
            acknowledged=await self.store.ack_batch(
                request.run_id, request.lease_id, request.step, request.provisional, request.load_id
            )
        )

    async def CommitAcks(self, request, context):
        committed, requeued = await self.store.commit_acks(
            request.run_id, request.through_step, request.load_id, request.loaded_step
        )
        return buffer_pb2.CommitAcksResponse(committed=committed, requeued=requeued)

    async def RollbackToCheckpoint(self, request, context):
        committed, requeued, released = await self.store.rollback_to_checkpoint(request.run_id, request.step)
        return buffer_pb2.RollbackToCheckpointResponse(committed=committed, requeued=requeued, leases_released=released)

    async def RejectGroups(self, request, context):
        at_most(
            len(request.groups), self.settings.limits.max_groups_per_call, "groups in one call", "max_groups_per_call"
        )
        reasons = {g.group_id: g.reason for g in request.groups}
        return buffer_pb2.RejectGroupsResponse(
            rejected=await self.store.reject_groups(request.run_id, request.lease_id, reasons)
        )

    async def ReleaseBatch(self, request, context):
        return buffer_pb2.ReleaseBatchResponse(
            released=await self.store.release_batch(request.run_id, request.lease_id)
        )

    async def GetStats(self, request, context):
        return buffer_pb2.BufferStats(**await self.store.stats(request.run_id, request.min_weight_version))

    async def ExportGroups(self, request, context):
        exported = await transfer.export_groups(
            self.store, request.run_id, request.path, self.settings.export_dir, dead_letters=request.dead_letters
        )
        return buffer_pb2.ExportGroupsResponse(groups=exported)

    async def ImportGroups(self, request, context):
        stored, duplicates = await transfer.import_groups(
            self.store, request.run_id, request.path, self.settings.export_dir, self.settings.limits.max_groups_per_call
        )
        return buffer_pb2.ImportGroupsResponse(groups=stored, duplicates=duplicates)

    async def GetRecentGroups(self, request, context) -> bytes:
        if request.offset < 0 or request.limit < 0:
            raise InvalidArgument(f"offset and limit must not be negative, got {request.offset} and {request.limit}")
        at_most(request.limit, self.settings.limits.max_groups_per_call, "limit", "max_groups_per_call")
        groups, total = await self.store.recent(request.run_id, request.offset, request.limit)
        head = buffer_pb2.GetRecentGroupsResponse(total=total).SerializeToString()
        return wire.repeated_messages(1, groups, head)  # GetRecentGroupsResponse.groups


def _check_counts(groups, limits: Limits) -> None:
    """A write's counts within the operator's limits (each group's own invariants are the
    store's to check)."""
    within(
        [
            (len(groups), limits.max_groups_per_call, "groups in one write", "max_groups_per_call"),
            (
                max((len(g.samples) for g in groups), default=0),
                limits.max_samples_per_prompt,
                "samples in one group",
                "max_samples_per_prompt",
            ),
            (
                sum(len(g.samples) for g in groups),
                limits.max_samples_per_call,
                "samples in one write",
                "max_samples_per_call",
            ),
        ]
    )


# Requests parsed with their raw group bytes kept; responses that may arrive as bytes.
_REQUEST_DESERIALIZERS = {"PutGroups": wire.PutGroupsWire, "ReturnPartialGroups": wire.PutGroupsWire}
_BYTES_RESPONSES = {"GetPrompts", "GetEvalPrompts", "LeaseBatch", "GetRecentGroups"}


def _redis_failures_said_plainly(handler):
    """Redis down or still loading its data: UNAVAILABLE (callers retry). Redis full (its
    maxmemory reached, with maxmemory-policy noeviction it refuses writes): RESOURCE_EXHAUSTED,
    which writers take as backpressure, as a full queue. Neither is an INTERNAL error."""

    @functools.wraps(handler)
    async def guarded(request, context):
        try:
            return await handler(request, context)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
            raise Unavailable(f"the buffer's Redis is unavailable ({type(e).__name__}: {e}); retry shortly") from None
        except redis.exceptions.ResponseError as e:
            if not is_out_of_memory(e):
                raise
            raise ResourceExhausted(
                "the buffer's Redis is full: its memory use reached its maxmemory and it refuses writes "
                "(nothing is evicted); retry once the trainer has consumed groups, or free memory (delete "
                f"finished runs, raise maxmemory). Redis said: {e}"
            ) from None

    return guarded


def is_out_of_memory(e: redis.exceptions.ResponseError) -> bool:
    """Redis refused a write over its maxmemory (a command's OOM error, or a script's or a
    transaction's that wraps it)."""
    return isinstance(e, redis.exceptions.OutOfMemoryError) or "OOM command not allowed" in str(e)


def add_buffer_servicer(servicer: BufferServicer, server: grpc.aio.Server) -> None:
    """Like the generated add_BufferServicer_to_server, with the byte-level handlers."""
    handlers = {}
    for method in _SERVICE.methods:
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            _redis_failures_said_plainly(getattr(servicer, method.name)),
            request_deserializer=_REQUEST_DESERIALIZERS.get(method.name, request_cls.FromString),
            response_serializer=(
                wire.serialize_response if method.name in _BYTES_RESPONSES else response_cls.SerializeToString
            ),
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE.full_name, handlers),))
    server.add_registered_method_handlers(_SERVICE.full_name, handlers)


def make_store(settings: Settings) -> BufferStore:
    return BufferStore(
        aioredis.Redis.from_url(settings.redis_url),
        settings.key_prefix,
        buffer_filter=load_filter(settings.buffer_filter),
        filter_window=settings.filter_window,
        rate_window_seconds=settings.rate_window_seconds,
        cache_bytes=settings.cache_megabytes * 1024 * 1024,
        data_files=DataFiles.of(
            settings.data_roots, settings.dataset_max_files, settings.dataset_max_bytes, settings.model_roots
        ),
        max_deliveries=settings.max_deliveries,
        max_rollbacks=settings.max_rollbacks,
        recent_groups=settings.recent_groups,
    )


def _binding(store: BufferStore, settings: Settings) -> ServiceBinding:
    return ServiceBinding(BufferServicer(store, settings), add_buffer_servicer, _SERVICE.full_name)


async def build(settings: Settings) -> Service:
    store = make_store(settings)
    service = Service([_binding(store, settings)], on_shutdown=store.redis.aclose)
    metrics.register(service.metrics, store)
    return service


start = functools.partial(start_service, build)
