"""gRPC transport for the reward service: thin handlers over rlmesh.reward.scoring
(scoring) and rlmesh.reward.registry (remote reward services registered by URL)."""

from __future__ import annotations

import functools
import logging

from grpc_health.v1 import health, health_pb2

from rlmesh.common.errors import InvalidArgument
from rlmesh.common.grpc_server import Service, ServiceBinding, start_service
from rlmesh.common.limits import Limits, at_most, within
from rlmesh.common.reward_service import remote_service_from_proto, remote_service_to_proto
from rlmesh.common.sample import group_from_proto, group_to_proto, sample_from_proto, sample_to_proto
from rlmesh.reward import metrics
from rlmesh.reward.config import Settings
from rlmesh.reward.registration import RemoteDefaults
from rlmesh.reward.registry import RemoteRegistry
from rlmesh.reward.resilience import CallPolicy
from rlmesh.reward.scoring import RewardSpec, Scorer
from rlmesh.reward.url_policy import UrlPolicy
from rlmesh.reward.verifiers import VERIFIERS
from rlmesh.reward.workers import VerifierPool
from rlmesh.v1 import check_pb2, reward_pb2, reward_pb2_grpc

log = logging.getLogger(__name__)

REWARD_SERVICE = reward_pb2.DESCRIPTOR.services_by_name["Reward"].full_name


def spec_from_proto(msg: reward_pb2.RewardSpec) -> RewardSpec:
    return RewardSpec(components=dict(msg.components), reward_key=msg.reward_key)


class RewardServicer(reward_pb2_grpc.RewardServicer):
    def __init__(self, scorer: Scorer, registry: RemoteRegistry, limits: Limits | None = None) -> None:
        self.scorer = scorer
        self.registry = registry
        self.limits = limits or Limits()

    async def Score(self, request, context):
        if not request.samples:
            raise InvalidArgument("ScoreRequest has no samples: send at least one sample to score")
        at_most(len(request.samples), self.limits.max_samples_per_call, "samples in one call", "max_samples_per_call")
        samples = [sample_from_proto(s) for s in request.samples]
        await self.scorer.score_samples(samples, spec_from_proto(request.spec))
        return reward_pb2.ScoreResponse(samples=[sample_to_proto(s) for s in samples])

    async def ScoreGroups(self, request, context):
        if not request.groups:
            raise InvalidArgument("ScoreGroupsRequest has no groups: send at least one group to score")
        within(
            [
                (len(request.groups), self.limits.max_groups_per_call, "groups in one call", "max_groups_per_call"),
                (
                    sum(len(g.samples) for g in request.groups),
                    self.limits.max_samples_per_call,
                    "samples in one call",
                    "max_samples_per_call",
                ),
            ]
        )
        for g in request.groups:
            if not g.samples:
                raise InvalidArgument(f"group {g.group_id!r} (index {g.group_index}) has no samples")
        groups = [group_from_proto(g) for g in request.groups]
        await self.scorer.score_groups(groups, spec_from_proto(request.spec))
        return reward_pb2.ScoreGroupsResponse(groups=[group_to_proto(g) for g in groups])

    async def RegisterService(self, request, context):
        if not request.HasField("service"):
            raise InvalidArgument("RegisterServiceRequest has no service: give at least its name and URL")
        config = await self.registry.register(remote_service_from_proto(request.service), replace=request.replace)
        return remote_service_to_proto(config)

    async def ListServices(self, request, context):
        configs = await self.registry.configs()
        return reward_pb2.ListServicesResponse(services=[remote_service_to_proto(configs[n]) for n in sorted(configs)])

    async def UnregisterService(self, request, context):
        if not request.name:
            raise InvalidArgument("UnregisterServiceRequest has no name")
        return reward_pb2.UnregisterServiceResponse(removed=await self.registry.unregister(request.name))

    async def CheckSpec(self, request, context):
        problems = await self.scorer.check_spec(spec_from_proto(request))
        return check_pb2.CheckResponse(problems=[check_pb2.FieldProblem(field=f, message=m) for f, m in problems])

    async def GetStats(self, request, context):
        await self.registry.callers()  # counters for services registered through another replica too
        stats = self.scorer.stats
        services = []
        for name, caller in sorted(self.registry.known_callers().items()):
            s, breaker = caller.stats, caller.breaker
            services.append(
                reward_pb2.RemoteServiceStats(
                    name=name,
                    url=caller.config.url,
                    breaker_state=breaker.state,
                    calls=s.calls,
                    failures=s.failures,
                    retries=s.retries,
                    consecutive_failures=breaker.consecutive_failures,
                    samples_scored=s.samples_scored,
                    samples_failed=s.samples_failed,
                    last_error=s.last_error,
                    mean_latency_seconds=s.mean_latency,
                    breaker_opened=breaker.times_opened,
                )
            )
        return reward_pb2.RewardStats(
            samples_scored=stats.samples_scored,
            samples_failed=stats.samples_failed,
            failures_by_component=stats.failures_by_component,
            services=services,
        )


def build_scorer(settings: Settings, verifiers: dict[str, str] | None = None) -> tuple[Scorer, RemoteRegistry]:
    """The scorer and the registry of remote services, as the settings describe them;
    `verifiers` (name -> import path) replaces the built-in verifiers' table."""
    reserved = {*VERIFIERS, *settings.custom_functions, *settings.group_functions}
    registry = RemoteRegistry(
        settings.redis_url,
        RemoteDefaults(
            settings.remote_timeout_seconds, settings.remote_max_concurrency, settings.remote_max_batch_size
        ),
        CallPolicy(
            max_retries=settings.remote_max_retries,
            backoff_base_seconds=settings.remote_backoff_seconds,
            backoff_max_seconds=settings.remote_backoff_max_seconds,
            breaker_failure_threshold=settings.breaker_failure_threshold,
            breaker_cooldown_seconds=settings.breaker_cooldown_seconds,
            max_reply_bytes=settings.max_reply_bytes,
        ),
        reserved,
        UrlPolicy(settings.remote_allowed_networks),
    )
    pool = VerifierPool(
        settings.verifier_workers, settings.verifier_timeout_seconds, settings.verifier_overload_seconds, verifiers
    )
    scorer = Scorer.from_config(
        settings.default_components,
        settings.custom_functions,
        settings.group_functions,
        registry,
        pool,
        settings.max_answer_chars,
    )
    return scorer, registry


def _binding(scorer: Scorer, registry: RemoteRegistry, limits: Limits) -> ServiceBinding:
    return ServiceBinding(
        RewardServicer(scorer, registry, limits),
        reward_pb2_grpc.add_RewardServicer_to_server,
        REWARD_SERVICE,
    )


async def build(settings: Settings, verifiers: dict[str, str] | None = None) -> Service:
    """The reward service; its verifier workers start with the server (`verifiers`: see build_scorer)."""
    scorer, registry = build_scorer(settings, verifiers)
    pool = scorer.verifier_pool
    assert pool is not None

    async def on_start(health_servicer: health.aio.HealthServicer) -> None:
        # Overload rule (settings.verifier_overload_seconds): NOT_SERVING, for the server and
        # for rlmesh.v1.Reward, while a verifier call has waited that long for a free worker;
        # SERVING again once none has. Load balancers then send work to another replica.
        async def report(overloaded: bool) -> None:
            if overloaded:
                log.warning(
                    "verifier workers overloaded: a call waited over %g s for one; health is NOT_SERVING",
                    pool.overload_seconds,
                )
            else:
                log.info("verifier workers caught up; health is SERVING")
            status = (
                health_pb2.HealthCheckResponse.NOT_SERVING if overloaded else health_pb2.HealthCheckResponse.SERVING
            )
            for name in ("", REWARD_SERVICE):
                await health_servicer.set(name, status)

        pool.on_overload = report
        pool.start()

    async def on_shutdown() -> None:
        pool.close()
        await registry.close()

    service = Service([_binding(scorer, registry, settings.limits)], on_shutdown=on_shutdown, on_start=on_start)
    metrics.register(service.metrics, scorer, registry)
    return service


start = functools.partial(start_service, build)
