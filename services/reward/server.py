"""gRPC transport for the reward service: thin handlers over rlmesh.reward.scoring
(scoring) and rlmesh.reward.registry (remote reward services registered by URL)."""

from __future__ import annotations

import functools

from rlmesh.common.errors import InvalidArgument
from rlmesh.common.grpc_server import Service, ServiceBinding, start_service
from rlmesh.common.sample import group_from_proto, group_to_proto, sample_from_proto, sample_to_proto
from rlmesh.reward.config import Settings
from rlmesh.reward.registry import RemoteRegistry
from rlmesh.reward.remote import RemoteDefaults, RemoteServiceConfig
from rlmesh.reward.resilience import CallPolicy
from rlmesh.reward.scoring import RewardSpec, Scorer
from rlmesh.reward.verifiers import VERIFIERS
from rlmesh.v1 import reward_pb2, reward_pb2_grpc


def spec_from_proto(msg: reward_pb2.RewardSpec) -> RewardSpec:
    return RewardSpec(components=dict(msg.components), reward_key=msg.reward_key)


def remote_from_proto(msg: reward_pb2.RemoteService) -> RemoteServiceConfig:
    return RemoteServiceConfig(
        name=msg.name, url=msg.url, protocol=msg.protocol, timeout_seconds=msg.timeout_seconds,
        max_concurrency=msg.max_concurrency, weight=msg.weight, max_batch_size=msg.max_batch_size,
        bearer_token=msg.bearer_token,
    )


def remote_to_proto(config: RemoteServiceConfig) -> reward_pb2.RemoteService:
    return reward_pb2.RemoteService(
        name=config.name, url=config.url, protocol=config.protocol, timeout_seconds=config.timeout_seconds,
        max_concurrency=config.max_concurrency, weight=config.weight, max_batch_size=config.max_batch_size,
    )


class RewardServicer(reward_pb2_grpc.RewardServicer):
    def __init__(self, scorer: Scorer, registry: RemoteRegistry) -> None:
        self.scorer = scorer
        self.registry = registry

    async def Score(self, request, context):
        if not request.samples:
            raise InvalidArgument("ScoreRequest has no samples: send at least one sample to score")
        samples = [sample_from_proto(s) for s in request.samples]
        await self.scorer.score_samples(samples, spec_from_proto(request.spec))
        return reward_pb2.ScoreResponse(samples=[sample_to_proto(s) for s in samples])

    async def ScoreGroups(self, request, context):
        if not request.groups:
            raise InvalidArgument("ScoreGroupsRequest has no groups: send at least one group to score")
        for g in request.groups:
            if not g.samples:
                raise InvalidArgument(f"group {g.group_id!r} (index {g.group_index}) has no samples")
        groups = [group_from_proto(g) for g in request.groups]
        await self.scorer.score_groups(groups, spec_from_proto(request.spec))
        return reward_pb2.ScoreGroupsResponse(groups=[group_to_proto(g) for g in groups])

    async def RegisterService(self, request, context):
        if not request.HasField("service"):
            raise InvalidArgument("RegisterServiceRequest has no service: give at least its name and URL")
        config = await self.registry.register(remote_from_proto(request.service))
        return remote_to_proto(config)

    async def ListServices(self, request, context):
        configs = await self.registry.configs()
        return reward_pb2.ListServicesResponse(services=[remote_to_proto(configs[n]) for n in sorted(configs)])

    async def UnregisterService(self, request, context):
        if not request.name:
            raise InvalidArgument("UnregisterServiceRequest has no name")
        return reward_pb2.UnregisterServiceResponse(removed=await self.registry.unregister(request.name))

    async def GetStats(self, request, context):
        await self.registry.callers()  # counters for services registered through another replica too
        stats = self.scorer.stats
        services = []
        for name, caller in sorted(self.registry.known_callers().items()):
            s, breaker = caller.stats, caller.breaker
            services.append(reward_pb2.RemoteServiceStats(
                name=name, url=caller.config.url, breaker_state=breaker.state, calls=s.calls, failures=s.failures,
                retries=s.retries, consecutive_failures=breaker.consecutive_failures, samples_scored=s.samples_scored,
                samples_failed=s.samples_failed, last_error=s.last_error, mean_latency_seconds=s.mean_latency,
                breaker_opened=breaker.times_opened,
            ))
        return reward_pb2.RewardStats(
            samples_scored=stats.samples_scored, samples_failed=stats.samples_failed,
            failures_by_component=stats.failures_by_component, services=services,
        )


def build_scorer(settings: Settings) -> tuple[Scorer, RemoteRegistry]:
    """The scorer and the registry of remote services, as the settings describe them."""
    reserved = {*VERIFIERS, *settings.custom_functions, *settings.group_functions}
    registry = RemoteRegistry(
        settings.redis_url,
        RemoteDefaults(settings.remote_timeout_seconds, settings.remote_max_concurrency, settings.remote_max_batch_size),
        CallPolicy(
            max_retries=settings.remote_max_retries, backoff_base_seconds=settings.remote_backoff_seconds,
            backoff_max_seconds=settings.remote_backoff_max_seconds,
            breaker_failure_threshold=settings.breaker_failure_threshold,
            breaker_cooldown_seconds=settings.breaker_cooldown_seconds, max_reply_bytes=settings.max_reply_bytes,
        ),
        reserved,
    )
    scorer = Scorer.from_config(settings.default_components, settings.custom_functions, settings.group_functions, registry)
    return scorer, registry


def _binding(scorer: Scorer, registry: RemoteRegistry) -> ServiceBinding:
    return ServiceBinding(
        RewardServicer(scorer, registry),
        reward_pb2_grpc.add_RewardServicer_to_server,
        reward_pb2.DESCRIPTOR.services_by_name["Reward"].full_name,
    )


async def build(settings: Settings) -> Service:
    scorer, registry = build_scorer(settings)
    return Service([_binding(scorer, registry)], on_shutdown=registry.close)


start = functools.partial(start_service, build)
