"""A remote reward service's registration, declared once: the body of the coordinator's
POST /reward-services, the RemoteService message that carries it to the reward service,
and the record the reward service keeps are all this model, converted to and from
protobuf here and nowhere else.

The model holds what any registration must satisfy (its bounds); what depends on the
reward service (its defaults for the fields left at 0, its reserved names, its address
policy) the reward service checks when it registers one (rlmesh.reward.registration)."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, ValidationError

from rlmesh.common.errors import InvalidArgument, validation_problems
from rlmesh.common.limits import (
    MAX_REMOTE_BATCH_SIZE,
    MAX_REMOTE_CONCURRENCY,
    MAX_REMOTE_TIMEOUT_SECONDS,
    MAX_REWARD_WEIGHT,
    MAX_TOKEN_CHARS,
)
from rlmesh.common.run_config import StrictModel
from rlmesh.v1 import reward_pb2

# A service's name: the reward component runs name it by (also the REST API's path parameter).
SERVICE_NAME_PATTERN = r"^[A-Za-z][A-Za-z0-9_.-]{0,62}$"


class RemoteServiceSpec(StrictModel):
    """A remote reward service, registered by URL (the reward service checks it answers)."""

    model_config = ConfigDict(frozen=True)

    name: str = Field(max_length=63, description="Component name runs use in reward.components.")
    url: str = Field(max_length=2048, description="http://, https:// or grpc:// address of the service.")
    protocol: Literal["", "http-json", "grpc"] = Field("", description="Empty = from the URL's scheme.")
    timeout_seconds: float = Field(
        0.0, ge=0, le=MAX_REMOTE_TIMEOUT_SECONDS, description="Per call; 0 = the reward service's default."
    )
    max_concurrency: int = Field(
        0, ge=0, le=MAX_REMOTE_CONCURRENCY, description="Calls in flight at once; 0 = the default."
    )
    weight: float = Field(
        0.0, ge=-MAX_REWARD_WEIGHT, le=MAX_REWARD_WEIGHT, description="Weight when a run names no components."
    )
    max_batch_size: int = Field(
        0, ge=0, le=MAX_REMOTE_BATCH_SIZE, description="Samples per call (groups are kept whole); 0 = the default."
    )
    bearer_token: str = Field(
        "",
        max_length=MAX_TOKEN_CHARS,
        repr=False,
        description="The service's own credential, sent as 'Authorization: Bearer <token>'; "
        "write-only (never listed back).",
    )


def remote_service(fields: dict) -> RemoteServiceSpec:
    """A registration from plain values; InvalidArgument names each field that is out of bounds."""
    try:
        return RemoteServiceSpec(**fields)
    except ValidationError as e:
        where = validation_problems(e, "registration")
        raise InvalidArgument(f"reward service {fields.get('name', '')!r}: {where}") from None


def remote_service_to_proto(spec: RemoteServiceSpec, with_token: bool = False) -> reward_pb2.RemoteService:
    """The message; the credential only on the way in (with_token), never when listed back."""
    return reward_pb2.RemoteService(
        **spec.model_dump(include=set(RemoteServiceSpec.model_fields) - (set() if with_token else {"bearer_token"}))
    )


def remote_service_from_proto(msg: reward_pb2.RemoteService) -> RemoteServiceSpec:
    return remote_service({name: getattr(msg, name) for name in RemoteServiceSpec.model_fields})
