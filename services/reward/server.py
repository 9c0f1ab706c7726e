"""gRPC transport for the reward service: thin handlers over services.reward.scoring."""

from __future__ import annotations

import grpc

from rlmesh.v1 import reward_pb2, reward_pb2_grpc
from services.common.errors import InvalidArgument, Unimplemented
from services.common.grpc_server import ServiceBinding, serve_forever, start_server
from services.common.sample import group_from_proto, group_to_proto, sample_from_proto, sample_to_proto
from services.reward.config import Settings
from services.reward.scoring import RewardSpec, Scorer


def spec_from_proto(msg: reward_pb2.RewardSpec) -> RewardSpec:
    return RewardSpec(components=dict(msg.components), reward_key=msg.reward_key)


class RewardServicer(reward_pb2_grpc.RewardServicer):
    def __init__(self, scorer: Scorer) -> None:
        self.scorer = scorer

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
        raise Unimplemented(
            "RegisterService is not implemented yet: it will register a remote reward service by URL "
            "(called with timeouts, retries and a circuit breaker) as a named component"
        )

    async def ListServices(self, request, context):
        raise Unimplemented("ListServices is not implemented yet: it will list the registered remote reward services")

    async def UnregisterService(self, request, context):
        raise Unimplemented("UnregisterService is not implemented yet: it will remove a registered remote reward service")


def _binding(settings: Settings) -> ServiceBinding:
    scorer = Scorer.from_config(settings.default_components, settings.custom_functions, settings.group_functions)
    return ServiceBinding(
        RewardServicer(scorer),
        reward_pb2_grpc.add_RewardServicer_to_server,
        reward_pb2.DESCRIPTOR.services_by_name["Reward"].full_name,
    )


async def start(settings: Settings) -> tuple[grpc.aio.Server, int]:
    server, port, _ = await start_server([_binding(settings)], f"{settings.host}:{settings.port}", settings.max_message_bytes)
    return server, port


async def serve(settings: Settings) -> None:
    await serve_forever([_binding(settings)], f"{settings.host}:{settings.port}", settings.max_message_bytes)
