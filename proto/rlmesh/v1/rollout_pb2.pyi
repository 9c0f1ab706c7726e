from rlmesh.v1 import reward_pb2 as _reward_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "ignore_eos", "no_stop_trim", "repetition_penalty", "frequency_penalty", "presence_penalty", "min_new_tokens")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    NO_STOP_TRIM_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    no_stop_trim: bool
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    min_new_tokens: int
    def __init__(self, max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., no_stop_trim: _Optional[bool] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., min_new_tokens: _Optional[int] = ...) -> None: ...

class GenerateRolloutRequest(_message.Message):
    __slots__ = ("run_id", "num_groups", "sampling", "reward", "group_filter", "over_sampling_groups", "partial_rollout", "mode", "max_concurrency", "apply_chat_template", "generate", "min_weight_version", "dataset", "dataset_offset", "weight_version", "within_queue_cap", "max_groups_ahead")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    GROUP_FILTER_FIELD_NUMBER: _ClassVar[int]
    OVER_SAMPLING_GROUPS_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_ROLLOUT_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    APPLY_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    MIN_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    DATASET_OFFSET_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    WITHIN_QUEUE_CAP_FIELD_NUMBER: _ClassVar[int]
    MAX_GROUPS_AHEAD_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    num_groups: int
    sampling: SamplingParams
    reward: _reward_pb2.RewardSpec
    group_filter: str
    over_sampling_groups: int
    partial_rollout: bool
    mode: str
    max_concurrency: int
    apply_chat_template: bool
    generate: GenerateFunction
    min_weight_version: int
    dataset: str
    dataset_offset: int
    weight_version: int
    within_queue_cap: bool
    max_groups_ahead: int
    def __init__(self, run_id: _Optional[str] = ..., num_groups: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., reward: _Optional[_Union[_reward_pb2.RewardSpec, _Mapping]] = ..., group_filter: _Optional[str] = ..., over_sampling_groups: _Optional[int] = ..., partial_rollout: _Optional[bool] = ..., mode: _Optional[str] = ..., max_concurrency: _Optional[int] = ..., apply_chat_template: _Optional[bool] = ..., generate: _Optional[_Union[GenerateFunction, _Mapping]] = ..., min_weight_version: _Optional[int] = ..., dataset: _Optional[str] = ..., dataset_offset: _Optional[int] = ..., weight_version: _Optional[int] = ..., within_queue_cap: _Optional[bool] = ..., max_groups_ahead: _Optional[int] = ...) -> None: ...

class GenerateFunction(_message.Message):
    __slots__ = ("name", "options_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    options_json: str
    def __init__(self, name: _Optional[str] = ..., options_json: _Optional[str] = ...) -> None: ...

class CheckGenerateFunctionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GenerateRolloutResponse(_message.Message):
    __slots__ = ("groups_written", "groups_filtered", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    GROUPS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FILTERED_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    groups_written: int
    groups_filtered: int
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, groups_written: _Optional[int] = ..., groups_filtered: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class EvaluateRequest(_message.Message):
    __slots__ = ("run_id", "dataset", "n_samples_per_prompt", "sampling", "reward", "limit", "apply_chat_template", "generate", "weight_version")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    N_SAMPLES_PER_PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    APPLY_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    dataset: str
    n_samples_per_prompt: int
    sampling: SamplingParams
    reward: _reward_pb2.RewardSpec
    limit: int
    apply_chat_template: bool
    generate: GenerateFunction
    weight_version: int
    def __init__(self, run_id: _Optional[str] = ..., dataset: _Optional[str] = ..., n_samples_per_prompt: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., reward: _Optional[_Union[_reward_pb2.RewardSpec, _Mapping]] = ..., limit: _Optional[int] = ..., apply_chat_template: _Optional[bool] = ..., generate: _Optional[_Union[GenerateFunction, _Mapping]] = ..., weight_version: _Optional[int] = ...) -> None: ...

class EvaluateResponse(_message.Message):
    __slots__ = ("metrics",)
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    METRICS_FIELD_NUMBER: _ClassVar[int]
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class AsyncRolloutResponse(_message.Message):
    __slots__ = ("running", "metrics", "error")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    running: bool
    metrics: _containers.ScalarMap[str, float]
    error: str
    def __init__(self, running: _Optional[bool] = ..., metrics: _Optional[_Mapping[str, float]] = ..., error: _Optional[str] = ...) -> None: ...

class StopAsyncRolloutRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class ListEnginesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetWaitingRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Waiting(_message.Message):
    __slots__ = ("reasons",)
    REASONS_FIELD_NUMBER: _ClassVar[int]
    reasons: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, reasons: _Optional[_Iterable[str]] = ...) -> None: ...

class EngineInfo(_message.Message):
    __slots__ = ("url", "tp_size", "weight_version", "healthy", "model_path", "weight_delta_format", "weight_file_format", "state", "generate_requests", "in_flight", "first_answer_version", "gpu_uuid")
    URL_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DELTA_FORMAT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FILE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    GENERATE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    FIRST_ANSWER_VERSION_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    url: str
    tp_size: int
    weight_version: str
    healthy: bool
    model_path: str
    weight_delta_format: str
    weight_file_format: str
    state: str
    generate_requests: int
    in_flight: int
    first_answer_version: str
    gpu_uuid: str
    def __init__(self, url: _Optional[str] = ..., tp_size: _Optional[int] = ..., weight_version: _Optional[str] = ..., healthy: _Optional[bool] = ..., model_path: _Optional[str] = ..., weight_delta_format: _Optional[str] = ..., weight_file_format: _Optional[str] = ..., state: _Optional[str] = ..., generate_requests: _Optional[int] = ..., in_flight: _Optional[int] = ..., first_answer_version: _Optional[str] = ..., gpu_uuid: _Optional[str] = ...) -> None: ...

class ListEnginesResponse(_message.Message):
    __slots__ = ("engines", "weight_group_world_size", "leaving", "discovery", "discovery_error")
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_GROUP_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    DISCOVERY_FIELD_NUMBER: _ClassVar[int]
    DISCOVERY_ERROR_FIELD_NUMBER: _ClassVar[int]
    engines: _containers.RepeatedCompositeFieldContainer[EngineInfo]
    weight_group_world_size: int
    leaving: _containers.RepeatedCompositeFieldContainer[EngineInfo]
    discovery: str
    discovery_error: str
    def __init__(self, engines: _Optional[_Iterable[_Union[EngineInfo, _Mapping]]] = ..., weight_group_world_size: _Optional[int] = ..., leaving: _Optional[_Iterable[_Union[EngineInfo, _Mapping]]] = ..., discovery: _Optional[str] = ..., discovery_error: _Optional[str] = ...) -> None: ...

class PauseGenerationRequest(_message.Message):
    __slots__ = ("mode",)
    MODE_FIELD_NUMBER: _ClassVar[int]
    mode: str
    def __init__(self, mode: _Optional[str] = ...) -> None: ...

class ContinueGenerationRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InitWeightUpdateGroupRequest(_message.Message):
    __slots__ = ("master_address", "master_port", "world_size", "group_name", "backend")
    MASTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    master_address: str
    master_port: int
    world_size: int
    group_name: str
    backend: str
    def __init__(self, master_address: _Optional[str] = ..., master_port: _Optional[int] = ..., world_size: _Optional[int] = ..., group_name: _Optional[str] = ..., backend: _Optional[str] = ...) -> None: ...

class TensorMeta(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("group_name", "tensors", "weight_version", "flush_cache", "load_format", "delta")
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    FLUSH_CACHE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FORMAT_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    group_name: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    weight_version: str
    flush_cache: bool
    load_format: str
    delta: WeightDelta
    def __init__(self, group_name: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., weight_version: _Optional[str] = ..., flush_cache: _Optional[bool] = ..., load_format: _Optional[str] = ..., delta: _Optional[_Union[WeightDelta, _Mapping]] = ...) -> None: ...

class WeightDelta(_message.Message):
    __slots__ = ("count", "index_dtype", "base_version")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    INDEX_DTYPE_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    count: int
    index_dtype: str
    base_version: str
    def __init__(self, count: _Optional[int] = ..., index_dtype: _Optional[str] = ..., base_version: _Optional[str] = ...) -> None: ...

class DestroyWeightUpdateGroupRequest(_message.Message):
    __slots__ = ("group_name",)
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    group_name: str
    def __init__(self, group_name: _Optional[str] = ...) -> None: ...

class UpdateWeightsFromDiskRequest(_message.Message):
    __slots__ = ("model_path", "weight_version")
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    model_path: str
    weight_version: str
    def __init__(self, model_path: _Optional[str] = ..., weight_version: _Optional[str] = ...) -> None: ...

class MemoryOccupationRequest(_message.Message):
    __slots__ = ("tags",)
    TAGS_FIELD_NUMBER: _ClassVar[int]
    tags: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tags: _Optional[_Iterable[str]] = ...) -> None: ...

class UpdateWeightsFromTensorRequest(_message.Message):
    __slots__ = ("serialized_named_tensors", "load_format", "weight_version", "flush_cache")
    SERIALIZED_NAMED_TENSORS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FORMAT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    FLUSH_CACHE_FIELD_NUMBER: _ClassVar[int]
    serialized_named_tensors: _containers.RepeatedScalarFieldContainer[str]
    load_format: str
    weight_version: str
    flush_cache: bool
    def __init__(self, serialized_named_tensors: _Optional[_Iterable[str]] = ..., load_format: _Optional[str] = ..., weight_version: _Optional[str] = ..., flush_cache: _Optional[bool] = ...) -> None: ...

class EngineCallResponse(_message.Message):
    __slots__ = ("engines", "message")
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    engines: _containers.RepeatedScalarFieldContainer[str]
    message: str
    def __init__(self, engines: _Optional[_Iterable[str]] = ..., message: _Optional[str] = ...) -> None: ...
