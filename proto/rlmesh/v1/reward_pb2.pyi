from rlmesh.v1 import check_pb2 as _check_pb2
from rlmesh.v1 import sample_pb2 as _sample_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RewardSpec(_message.Message):
    __slots__ = ("components", "reward_key")
    class ComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    REWARD_KEY_FIELD_NUMBER: _ClassVar[int]
    components: _containers.ScalarMap[str, float]
    reward_key: str
    def __init__(self, components: _Optional[_Mapping[str, float]] = ..., reward_key: _Optional[str] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("samples", "spec")
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[_sample_pb2.Sample]
    spec: RewardSpec
    def __init__(self, samples: _Optional[_Iterable[_Union[_sample_pb2.Sample, _Mapping]]] = ..., spec: _Optional[_Union[RewardSpec, _Mapping]] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("samples",)
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[_sample_pb2.Sample]
    def __init__(self, samples: _Optional[_Iterable[_Union[_sample_pb2.Sample, _Mapping]]] = ...) -> None: ...

class ScoreGroupsRequest(_message.Message):
    __slots__ = ("groups", "spec")
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[_sample_pb2.SampleGroup]
    spec: RewardSpec
    def __init__(self, groups: _Optional[_Iterable[_Union[_sample_pb2.SampleGroup, _Mapping]]] = ..., spec: _Optional[_Union[RewardSpec, _Mapping]] = ...) -> None: ...

class ScoreGroupsResponse(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[_sample_pb2.SampleGroup]
    def __init__(self, groups: _Optional[_Iterable[_Union[_sample_pb2.SampleGroup, _Mapping]]] = ...) -> None: ...

class RemoteService(_message.Message):
    __slots__ = ("name", "url", "protocol", "timeout_seconds", "max_concurrency", "weight", "max_batch_size", "bearer_token")
    NAME_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    BEARER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    name: str
    url: str
    protocol: str
    timeout_seconds: float
    max_concurrency: int
    weight: float
    max_batch_size: int
    bearer_token: str
    def __init__(self, name: _Optional[str] = ..., url: _Optional[str] = ..., protocol: _Optional[str] = ..., timeout_seconds: _Optional[float] = ..., max_concurrency: _Optional[int] = ..., weight: _Optional[float] = ..., max_batch_size: _Optional[int] = ..., bearer_token: _Optional[str] = ...) -> None: ...

class RegisterServiceRequest(_message.Message):
    __slots__ = ("service", "replace")
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    service: RemoteService
    replace: bool
    def __init__(self, service: _Optional[_Union[RemoteService, _Mapping]] = ..., replace: _Optional[bool] = ...) -> None: ...

class ListServicesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListServicesResponse(_message.Message):
    __slots__ = ("services",)
    SERVICES_FIELD_NUMBER: _ClassVar[int]
    services: _containers.RepeatedCompositeFieldContainer[RemoteService]
    def __init__(self, services: _Optional[_Iterable[_Union[RemoteService, _Mapping]]] = ...) -> None: ...

class UnregisterServiceRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnregisterServiceResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: bool
    def __init__(self, removed: _Optional[bool] = ...) -> None: ...

class GetRewardStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RemoteServiceStats(_message.Message):
    __slots__ = ("name", "url", "breaker_state", "calls", "failures", "retries", "consecutive_failures", "samples_scored", "samples_failed", "last_error", "mean_latency_seconds", "breaker_opened")
    NAME_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    BREAKER_STATE_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    RETRIES_FIELD_NUMBER: _ClassVar[int]
    CONSECUTIVE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_SCORED_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FAILED_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    MEAN_LATENCY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BREAKER_OPENED_FIELD_NUMBER: _ClassVar[int]
    name: str
    url: str
    breaker_state: str
    calls: int
    failures: int
    retries: int
    consecutive_failures: int
    samples_scored: int
    samples_failed: int
    last_error: str
    mean_latency_seconds: float
    breaker_opened: int
    def __init__(self, name: _Optional[str] = ..., url: _Optional[str] = ..., breaker_state: _Optional[str] = ..., calls: _Optional[int] = ..., failures: _Optional[int] = ..., retries: _Optional[int] = ..., consecutive_failures: _Optional[int] = ..., samples_scored: _Optional[int] = ..., samples_failed: _Optional[int] = ..., last_error: _Optional[str] = ..., mean_latency_seconds: _Optional[float] = ..., breaker_opened: _Optional[int] = ...) -> None: ...

class RewardStats(_message.Message):
    __slots__ = ("samples_scored", "samples_failed", "failures_by_component", "services")
    class FailuresByComponentEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    SAMPLES_SCORED_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FAILED_FIELD_NUMBER: _ClassVar[int]
    FAILURES_BY_COMPONENT_FIELD_NUMBER: _ClassVar[int]
    SERVICES_FIELD_NUMBER: _ClassVar[int]
    samples_scored: int
    samples_failed: int
    failures_by_component: _containers.ScalarMap[str, int]
    services: _containers.RepeatedCompositeFieldContainer[RemoteServiceStats]
    def __init__(self, samples_scored: _Optional[int] = ..., samples_failed: _Optional[int] = ..., failures_by_component: _Optional[_Mapping[str, int]] = ..., services: _Optional[_Iterable[_Union[RemoteServiceStats, _Mapping]]] = ...) -> None: ...
