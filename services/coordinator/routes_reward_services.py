"""Routes under /reward-services: register, list and unregister remote reward services
(relayed to the reward service, app.state.reward), refused while the active run's rewards
would change."""

from __future__ import annotations

from fastapi import APIRouter, Request
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.json_format import MessageToDict

from rlmesh.common.errors import FailedPrecondition
from rlmesh.common.reward_service import remote_service_to_proto
from rlmesh.common.run_config import RunConfig
from rlmesh.coordinator.config import Settings
from rlmesh.coordinator.schemas import RELAYED, SERVICE_NAME, RewardServiceRegistration, error_responses
from rlmesh.v1 import reward_pb2


def services_named(components) -> set[str]:
    """The reward services a spec's components name ("judge" or "judge/<score>")."""
    return {c.split("/", 1)[0] for c in components}


def check_reward_service_change(
    run_id: str, config: RunConfig, name: str, registered: dict[str, float], removes: bool, new_weight: float = 0.0
) -> None:
    """FailedPrecondition (409) when a change to the registered reward services would change
    the rewards of the active run `run_id`: deleting or replacing (`removes`) a registered
    service that its reward spec names ("judge" or "judge/<score>"); for a spec without
    components (it takes every service registered with a weight), deleting or replacing one
    with a weight, or registering one with a weight. registered: name -> weight."""
    removes = removes and name in registered
    components = config.reward.components
    if components:
        uses = removes and name in services_named(components)
    else:
        uses = (removes and bool(registered[name])) or bool(new_weight)
    if uses:
        raise FailedPrecondition(
            f"run {run_id} is active and its reward uses the reward service '{name}' (or would take it in); "
            f"stop the run first (POST /runs/{run_id}/stop), or register the new service under another name"
        )


def check_queued_run_keeps(run_id: str, config: RunConfig, name: str, registered: dict[str, float]) -> None:
    """FailedPrecondition (409) when deleting the registered service `name` would take away a
    reward component that the queued run `run_id` names: it would fail when it starts, after
    its warm start. (A spec without components takes what is registered then.)"""
    if name in registered and name in services_named(config.reward.components):
        raise FailedPrecondition(
            f"run {run_id} is queued and its reward uses the reward service '{name}'; delete that run from the "
            f"queue first (DELETE /runs/{run_id}), then the service"
        )


def _service_dict(msg) -> dict:
    """A reply as JSON, every field present, its 64-bit counts as numbers (proto3's JSON
    mapping writes them as strings, which no client adds up)."""
    return _counts_as_numbers(
        msg.DESCRIPTOR, MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    )


_INT64 = {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64}


def _counts_as_numbers(descriptor, d: dict) -> dict:
    for field in descriptor.fields:
        if field.name not in d:
            continue
        value, kind = d[field.name], field.message_type
        if kind is not None and kind.GetOptions().map_entry:
            item = kind.fields_by_name["value"]
            if item.type in _INT64:
                d[field.name] = {k: int(v) for k, v in value.items()}
        elif kind is not None:
            d[field.name] = (
                [_counts_as_numbers(kind, v) for v in value]
                if isinstance(value, list)
                else _counts_as_numbers(kind, value)
            )
        elif field.type in _INT64:
            d[field.name] = [int(v) for v in value] if isinstance(value, list) else int(value)
    return d


def reward_services_router(settings: Settings) -> APIRouter:
    router = APIRouter()
    deadline = settings.call_deadline_seconds

    async def refuse_if_a_run_uses(
        request: Request, name: str, removes: bool, new_weight: float = 0.0, deletes: bool = False
    ):
        """409 when the change would swap the rewards of the run training now, or (`deletes`)
        take away one a queued run names (the reward service knows no runs). Checked just
        before the change, not atomically with it."""
        store = request.app.state.store
        active, queued = await store.active(), await store.queued_configs() if deletes else []
        if active is None and not queued:
            return
        listed = await request.app.state.reward.ListServices(reward_pb2.ListServicesRequest(), timeout=deadline)
        registered = {s.name: s.weight for s in listed.services}
        if active is not None:
            check_reward_service_change(*active, name, registered, removes, new_weight)
        for run_id, config in queued:
            check_queued_run_keeps(run_id, config, name, registered)

    @router.post("/reward-services", status_code=201, responses=error_responses(*RELAYED, 413))
    async def register_reward_service(spec: RewardServiceRegistration, request: Request):
        """Register a remote reward service by URL; refused (400) when its host is not allowed by the
        reward service's address policy, 409 when it does not answer the probe, when the name is taken
        and replace is not set, or when the active run uses the name."""
        await refuse_if_a_run_uses(request, spec.name, removes=spec.replace, new_weight=spec.weight)
        # (registration probes the remote service, which may take its whole timeout)
        msg = await request.app.state.reward.RegisterService(
            reward_pb2.RegisterServiceRequest(
                service=remote_service_to_proto(spec, with_token=True), replace=spec.replace
            ),
            timeout=deadline + spec.timeout_seconds,
        )
        return _service_dict(msg)

    @router.get("/reward-services", responses=error_responses(*RELAYED))
    async def list_reward_services(request: Request):
        resp = await request.app.state.reward.ListServices(reward_pb2.ListServicesRequest(), timeout=deadline)
        return [_service_dict(s) for s in resp.services]

    @router.delete("/reward-services/{name}", responses=error_responses(*RELAYED))
    async def unregister_reward_service(request: Request, name: str = SERVICE_NAME):
        """Unregister a remote reward service; 409 while the active run or a queued run uses it."""
        await refuse_if_a_run_uses(request, name, removes=True, deletes=True)
        resp = await request.app.state.reward.UnregisterService(
            reward_pb2.UnregisterServiceRequest(name=name), timeout=deadline
        )
        return {"removed": resp.removed}

    @router.get("/reward-services/stats", responses=error_responses(*RELAYED))
    async def reward_stats(request: Request):
        """Per remote service: calls, failures, retries, breaker state, latency."""
        stats = await request.app.state.reward.GetStats(reward_pb2.GetRewardStatsRequest(), timeout=deadline)
        return _service_dict(stats)

    return router
