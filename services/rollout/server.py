"""gRPC transport for the rollout service: requests become plain values for RolloutManager
and the engine pool (which relays weight updates to every engine), results become replies."""

from __future__ import annotations

import asyncio
import functools
import logging

from rlmesh.common import auth, safe_json
from rlmesh.common.errors import InvalidArgument
from rlmesh.common.grpc_server import Service, ServiceBinding, aio_channel, start_service
from rlmesh.common.paths import validate_run_id
from rlmesh.common.prometheus import ServiceMetrics
from rlmesh.common.sampling import sampling_to_sglang
from rlmesh.common.tasks import cancel_and_wait
from rlmesh.rollout import colocated
from rlmesh.rollout.agents.openai_server import close_shared_endpoint
from rlmesh.rollout.async_rollout import AsyncRollouts, AsyncStatus
from rlmesh.rollout.config import Settings
from rlmesh.rollout.discovery import DiscoveryFailed, EngineDiscovery, watch
from rlmesh.rollout.engine_client import EnginePool, EngineState, TensorMeta, WeightDelta, weight_group_world_size
from rlmesh.rollout.metrics import RolloutMetrics
from rlmesh.rollout.rollout import EvalRequest, GenerateChoice, RewardChoice, RolloutManager, RolloutRequest
from rlmesh.v1 import buffer_pb2_grpc, reward_pb2, reward_pb2_grpc, rollout_pb2, rollout_pb2_grpc

DEFAULT_GROUP = "weight_update_group"

log = logging.getLogger(__name__)


class RolloutServicer(rollout_pb2_grpc.RolloutServicer):
    def __init__(
        self,
        manager: RolloutManager,
        pool: EnginePool,
        async_rollouts: AsyncRollouts,
        discovery: EngineDiscovery | None = None,
    ) -> None:
        self.manager = manager
        self.pool = pool
        self.async_rollouts = async_rollouts
        self.discovery = discovery

    async def GenerateRollout(self, request, context):
        result = await self.manager.generate_rollout(rollout_request_from_proto(request))
        return rollout_pb2.GenerateRolloutResponse(
            groups_written=result.groups_written, groups_filtered=result.groups_filtered, metrics=result.metrics
        )

    async def Evaluate(self, request, context):
        return rollout_pb2.EvaluateResponse(metrics=await self.manager.evaluate(eval_request_from_proto(request)))

    async def StartAsyncRollout(self, request, context):
        return _async_response(await self.async_rollouts.start(rollout_request_from_proto(request)))

    async def CheckGenerateFunction(self, request, context):
        self.manager.generator(generate_choice_from_proto(request))
        return rollout_pb2.CheckGenerateFunctionResponse()

    async def StopAsyncRollout(self, request, context):
        return _async_response(await self.async_rollouts.stop(validate_run_id(request.run_id)))

    async def GetWaiting(self, request, context):
        return rollout_pb2.Waiting(reasons=self.manager.waits.current())

    async def ListEngines(self, request, context):
        states = await self.pool.states()
        status = self.discovery.status if self.discovery is not None else None
        return rollout_pb2.ListEnginesResponse(
            engines=[engine_info(s) for s in states],
            # The weight group holds the engines that answer (one that is down joins a later one).
            weight_group_world_size=weight_group_world_size([s for s in states if s.healthy]),
            leaving=[engine_info(s) for s in self.pool.leaving()],
            discovery=status.description if status else "",
            discovery_error=status.error if status else "",
        )

    async def PauseGeneration(self, request, context):
        await self.pool.pause(request.mode or "abort")
        return self._done("paused")

    async def ContinueGeneration(self, request, context):
        await self.pool.resume()
        return self._done("continued")

    async def InitWeightUpdateGroup(self, request, context):
        joined = await self.pool.init_weight_group(
            request.master_address,
            request.master_port,
            request.world_size,
            request.group_name or DEFAULT_GROUP,
            request.backend or "nccl",
        )
        return self._done(f"{joined} engines joined group {request.group_name!r}")

    async def UpdateWeights(self, request, context):
        await self.pool.update_weights(
            [TensorMeta(t.name, t.dtype, tuple(t.shape)) for t in request.tensors],
            request.group_name or DEFAULT_GROUP,
            request.weight_version,
            request.flush_cache,
            request.load_format,
            WeightDelta(request.delta.count, request.delta.index_dtype, request.delta.base_version)
            if request.HasField("delta")
            else None,
        )
        return self._done(f"{len(request.tensors)} tensors at version {request.weight_version}")

    async def DestroyWeightUpdateGroup(self, request, context):
        await self.pool.destroy_weight_group(request.group_name or DEFAULT_GROUP)
        return self._done("destroyed")

    async def UpdateWeightsFromDisk(self, request, context):
        await self.pool.update_weights_from_disk(request.model_path, request.weight_version)
        return self._done(f"loaded {request.model_path}")

    async def ReleaseMemoryOccupation(self, request, context):
        tags = await colocated.release_memory(self.pool, list(request.tags))
        return self._done(f"released {', '.join(tags)}")

    async def ResumeMemoryOccupation(self, request, context):
        tags = await colocated.resume_memory(self.pool, list(request.tags))
        return self._done(f"resumed {', '.join(tags)}")

    async def UpdateWeightsFromTensor(self, request, context):
        await colocated.update_weights_from_tensor(
            self.pool,
            list(request.serialized_named_tensors),
            request.load_format,
            request.weight_version,
            request.flush_cache,
        )
        return self._done(f"updated in place at version {request.weight_version or '(unchanged)'}")

    def _done(self, message: str) -> rollout_pb2.EngineCallResponse:
        return rollout_pb2.EngineCallResponse(engines=[e.url for e in self.pool.engines], message=message)


def engine_info(s: EngineState) -> rollout_pb2.EngineInfo:
    return rollout_pb2.EngineInfo(
        url=s.url,
        tp_size=s.tp_size,
        weight_version=s.weight_version,
        healthy=s.healthy,
        model_path=s.model_path,
        weight_delta_format=s.weight_delta_format,
        weight_file_format=s.weight_file_format,
        state=s.state,
        generate_requests=s.generate_requests,
        in_flight=s.in_flight,
        first_answer_version=s.first_answer_version,
        gpu_uuid=s.gpu_uuid,
    )


def _async_response(status: AsyncStatus) -> rollout_pb2.AsyncRolloutResponse:
    return rollout_pb2.AsyncRolloutResponse(running=status.running, metrics=status.metrics, error=status.error)


def rollout_request_from_proto(r: rollout_pb2.GenerateRolloutRequest) -> RolloutRequest:
    return RolloutRequest(
        run_id=validate_run_id(r.run_id),
        num_groups=r.num_groups,
        sampling=sampling_to_sglang(r.sampling),
        reward=reward_spec_from_proto(r.reward),
        group_filter=r.group_filter,
        over_sampling_groups=r.over_sampling_groups,
        partial_rollout=r.partial_rollout,
        within_queue_cap=r.within_queue_cap,
        max_groups_ahead=max(r.max_groups_ahead, 0),
        mode=r.mode or "rl",
        max_concurrency=r.max_concurrency,
        apply_chat_template=r.apply_chat_template,
        generate=generate_choice_from_proto(r.generate),
        min_weight_version=max(r.min_weight_version, 0),
        weight_version=max(r.weight_version, 0),
        dataset=r.dataset,
        dataset_offset=max(r.dataset_offset, 0),
    )


def eval_request_from_proto(r: rollout_pb2.EvaluateRequest) -> EvalRequest:
    return EvalRequest(
        run_id=validate_run_id(r.run_id),
        dataset=r.dataset,
        n_samples_per_prompt=r.n_samples_per_prompt or 1,
        sampling=sampling_to_sglang(r.sampling),
        reward=reward_spec_from_proto(r.reward),
        limit=r.limit,
        apply_chat_template=r.apply_chat_template,
        generate=generate_choice_from_proto(r.generate),
        weight_version=max(r.weight_version, 0),
    )


# Room for a run's generate options (a JSON object).
MAX_GENERATE_OPTIONS_BYTES = 64 * 1024


def generate_choice_from_proto(g: rollout_pb2.GenerateFunction) -> GenerateChoice:
    if len(g.options_json) > MAX_GENERATE_OPTIONS_BYTES:
        raise InvalidArgument(
            f"generate options are {len(g.options_json)} bytes, more than {MAX_GENERATE_OPTIONS_BYTES}"
        )
    try:
        options = safe_json.loads(g.options_json) if g.options_json else {}
    except ValueError as e:
        raise InvalidArgument(f"generate options are not valid JSON: {e}") from None
    if not isinstance(options, dict):
        raise InvalidArgument("generate options must be a JSON object")
    return GenerateChoice(name=g.name, options=options)


def reward_spec_from_proto(spec: reward_pb2.RewardSpec) -> RewardChoice:
    return RewardChoice(components=dict(spec.components), reward_key=spec.reward_key)


async def build(settings: Settings) -> Service:
    """The servicer over an engine pool and clients of the buffer and reward services."""
    metrics = ServiceMetrics()
    discovery = EngineDiscovery(settings.engine_discovery, settings.engine_urls)
    pool = EnginePool(
        settings.engine_urls if not discovery.dynamic else [],
        settings.router_url,
        settings.request_timeout_seconds,
        settings.weight_update_timeout_seconds,
        settings.engine_api_key or auth.stack_token() or "",
        settings.generate_timeout_seconds,
        settings.generate_seconds_per_token,
        RolloutMetrics(metrics),
        dynamic=discovery.dynamic,
    )
    watcher = await start_discovery(discovery, pool)
    buffer_channel = aio_channel(settings.buffer_address, settings.max_message_bytes)
    reward_channel = aio_channel(settings.reward_address, settings.max_message_bytes)
    manager = RolloutManager(
        settings, pool, buffer_pb2_grpc.BufferStub(buffer_channel), reward_pb2_grpc.RewardStub(reward_channel)
    )

    async_rollouts = AsyncRollouts(manager)

    async def close() -> None:
        if watcher is not None:
            await cancel_and_wait(watcher)
        await async_rollouts.close()  # (hands their prompts back to the buffer)
        await close_shared_endpoint()
        await pool.close()
        await manager.tools.close()
        await buffer_channel.close()
        await reward_channel.close()

    binding = ServiceBinding(
        RolloutServicer(manager, pool, async_rollouts, discovery),
        rollout_pb2_grpc.add_RolloutServicer_to_server,
        rollout_pb2.DESCRIPTOR.services_by_name["Rollout"].full_name,
    )
    return Service([binding], on_shutdown=close, metrics=metrics)


async def start_discovery(discovery: EngineDiscovery, pool: EnginePool) -> asyncio.Task | None:
    """The first lookup (a failed one starts the pool empty: generation waits for engines)
    and the task that repeats it; None for a static list."""
    if not discovery.dynamic:
        return None
    discovery.http = pool.http  # (carries the engines' API key: a router asks for the same)
    try:
        pool.set_members(await discovery.lookup())
    except DiscoveryFailed as e:
        log.warning("%s; starting with no engines (looked up again every %g s)", e, discovery.config.interval_seconds)
    return asyncio.create_task(watch(discovery, pool.set_members), name="engine-discovery")


start = functools.partial(start_service, build)
