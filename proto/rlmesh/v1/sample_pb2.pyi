from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    name: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments_json")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments_json: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments_json: _Optional[str] = ...) -> None: ...

class MultimodalInput(_message.Message):
    __slots__ = ("kind", "uri", "data", "mime_type")
    KIND_FIELD_NUMBER: _ClassVar[int]
    URI_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    MIME_TYPE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    uri: str
    data: bytes
    mime_type: str
    def __init__(self, kind: _Optional[str] = ..., uri: _Optional[str] = ..., data: _Optional[bytes] = ..., mime_type: _Optional[str] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("index", "group_index", "prompt", "messages", "tokens", "response", "response_length", "label", "reward", "reward_components", "loss_mask", "status", "metadata_json", "rollout_log_probs", "weight_versions", "multimodal_inputs")
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATUS_UNSPECIFIED: _ClassVar[Sample.Status]
        PENDING: _ClassVar[Sample.Status]
        COMPLETED: _ClassVar[Sample.Status]
        TRUNCATED: _ClassVar[Sample.Status]
        ABORTED: _ClassVar[Sample.Status]
        FAILED: _ClassVar[Sample.Status]
    STATUS_UNSPECIFIED: Sample.Status
    PENDING: Sample.Status
    COMPLETED: Sample.Status
    TRUNCATED: Sample.Status
    ABORTED: Sample.Status
    FAILED: Sample.Status
    class RewardComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    INDEX_FIELD_NUMBER: _ClassVar[int]
    GROUP_INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    REWARD_COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    MULTIMODAL_INPUTS_FIELD_NUMBER: _ClassVar[int]
    index: int
    group_index: int
    prompt: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    tokens: bytes
    response: str
    response_length: int
    label: str
    reward: float
    reward_components: _containers.ScalarMap[str, float]
    loss_mask: bytes
    status: Sample.Status
    metadata_json: str
    rollout_log_probs: bytes
    weight_versions: _containers.RepeatedScalarFieldContainer[int]
    multimodal_inputs: _containers.RepeatedCompositeFieldContainer[MultimodalInput]
    def __init__(self, index: _Optional[int] = ..., group_index: _Optional[int] = ..., prompt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., tokens: _Optional[bytes] = ..., response: _Optional[str] = ..., response_length: _Optional[int] = ..., label: _Optional[str] = ..., reward: _Optional[float] = ..., reward_components: _Optional[_Mapping[str, float]] = ..., loss_mask: _Optional[bytes] = ..., status: _Optional[_Union[Sample.Status, str]] = ..., metadata_json: _Optional[str] = ..., rollout_log_probs: _Optional[bytes] = ..., weight_versions: _Optional[_Iterable[int]] = ..., multimodal_inputs: _Optional[_Iterable[_Union[MultimodalInput, _Mapping]]] = ...) -> None: ...

class SampleGroup(_message.Message):
    __slots__ = ("group_id", "group_index", "samples", "dataset")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_INDEX_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    group_index: int
    samples: _containers.RepeatedCompositeFieldContainer[Sample]
    dataset: str
    def __init__(self, group_id: _Optional[str] = ..., group_index: _Optional[int] = ..., samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ..., dataset: _Optional[str] = ...) -> None: ...
