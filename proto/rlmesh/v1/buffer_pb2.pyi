from rlmesh.v1 import check_pb2 as _check_pb2
from rlmesh.v1 import sample_pb2 as _sample_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DatasetSpec(_message.Message):
    __slots__ = ("name", "path", "prompt_key", "label_key", "metadata_key", "weight", "shuffle", "seed", "eval", "tools_key", "tokenizer_path", "apply_chat_template", "max_prompt_length", "split")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    PROMPT_KEY_FIELD_NUMBER: _ClassVar[int]
    LABEL_KEY_FIELD_NUMBER: _ClassVar[int]
    METADATA_KEY_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    SHUFFLE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    EVAL_FIELD_NUMBER: _ClassVar[int]
    TOOLS_KEY_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_PATH_FIELD_NUMBER: _ClassVar[int]
    APPLY_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    prompt_key: str
    label_key: str
    metadata_key: str
    weight: float
    shuffle: bool
    seed: int
    eval: bool
    tools_key: str
    tokenizer_path: str
    apply_chat_template: bool
    max_prompt_length: int
    split: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., prompt_key: _Optional[str] = ..., label_key: _Optional[str] = ..., metadata_key: _Optional[str] = ..., weight: _Optional[float] = ..., shuffle: _Optional[bool] = ..., seed: _Optional[int] = ..., eval: _Optional[bool] = ..., tools_key: _Optional[str] = ..., tokenizer_path: _Optional[str] = ..., apply_chat_template: _Optional[bool] = ..., max_prompt_length: _Optional[int] = ..., split: _Optional[str] = ...) -> None: ...

class CreateRunRequest(_message.Message):
    __slots__ = ("run_id", "datasets", "n_samples_per_prompt", "max_queued_groups", "tokenizer_path", "apply_chat_template", "max_prompt_length", "vocab_size")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    DATASETS_FIELD_NUMBER: _ClassVar[int]
    N_SAMPLES_PER_PROMPT_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_PATH_FIELD_NUMBER: _ClassVar[int]
    APPLY_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    datasets: _containers.RepeatedCompositeFieldContainer[DatasetSpec]
    n_samples_per_prompt: int
    max_queued_groups: int
    tokenizer_path: str
    apply_chat_template: bool
    max_prompt_length: int
    vocab_size: int
    def __init__(self, run_id: _Optional[str] = ..., datasets: _Optional[_Iterable[_Union[DatasetSpec, _Mapping]]] = ..., n_samples_per_prompt: _Optional[int] = ..., max_queued_groups: _Optional[int] = ..., tokenizer_path: _Optional[str] = ..., apply_chat_template: _Optional[bool] = ..., max_prompt_length: _Optional[int] = ..., vocab_size: _Optional[int] = ...) -> None: ...

class CreateRunResponse(_message.Message):
    __slots__ = ("created",)
    CREATED_FIELD_NUMBER: _ClassVar[int]
    created: bool
    def __init__(self, created: _Optional[bool] = ...) -> None: ...

class DeleteRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class DeleteRunResponse(_message.Message):
    __slots__ = ("keys_deleted",)
    KEYS_DELETED_FIELD_NUMBER: _ClassVar[int]
    keys_deleted: int
    def __init__(self, keys_deleted: _Optional[int] = ...) -> None: ...

class CloseRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class CloseRunResponse(_message.Message):
    __slots__ = ("keys_deleted",)
    KEYS_DELETED_FIELD_NUMBER: _ClassVar[int]
    keys_deleted: int
    def __init__(self, keys_deleted: _Optional[int] = ...) -> None: ...

class GetPromptsRequest(_message.Message):
    __slots__ = ("run_id", "num_groups", "lease_seconds", "within_queue_cap", "max_groups_ahead", "reclaim_leases")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WITHIN_QUEUE_CAP_FIELD_NUMBER: _ClassVar[int]
    MAX_GROUPS_AHEAD_FIELD_NUMBER: _ClassVar[int]
    RECLAIM_LEASES_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    num_groups: int
    lease_seconds: float
    within_queue_cap: bool
    max_groups_ahead: int
    reclaim_leases: bool
    def __init__(self, run_id: _Optional[str] = ..., num_groups: _Optional[int] = ..., lease_seconds: _Optional[float] = ..., within_queue_cap: _Optional[bool] = ..., max_groups_ahead: _Optional[int] = ..., reclaim_leases: _Optional[bool] = ...) -> None: ...

class GetPromptsResponse(_message.Message):
    __slots__ = ("groups", "lease_id")
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[_sample_pb2.SampleGroup]
    lease_id: str
    def __init__(self, groups: _Optional[_Iterable[_Union[_sample_pb2.SampleGroup, _Mapping]]] = ..., lease_id: _Optional[str] = ...) -> None: ...

class GetEvalPromptsRequest(_message.Message):
    __slots__ = ("run_id", "dataset", "n_samples_per_prompt", "offset", "limit", "wrap")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    N_SAMPLES_PER_PROMPT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    WRAP_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    dataset: str
    n_samples_per_prompt: int
    offset: int
    limit: int
    wrap: bool
    def __init__(self, run_id: _Optional[str] = ..., dataset: _Optional[str] = ..., n_samples_per_prompt: _Optional[int] = ..., offset: _Optional[int] = ..., limit: _Optional[int] = ..., wrap: _Optional[bool] = ...) -> None: ...

class PutGroupsRequest(_message.Message):
    __slots__ = ("run_id", "groups")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    groups: _containers.RepeatedCompositeFieldContainer[_sample_pb2.SampleGroup]
    def __init__(self, run_id: _Optional[str] = ..., groups: _Optional[_Iterable[_Union[_sample_pb2.SampleGroup, _Mapping]]] = ...) -> None: ...

class PutGroupsResponse(_message.Message):
    __slots__ = ("stored", "duplicates")
    STORED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    stored: int
    duplicates: int
    def __init__(self, stored: _Optional[int] = ..., duplicates: _Optional[int] = ...) -> None: ...

class DropGroupsRequest(_message.Message):
    __slots__ = ("run_id", "group_ids", "reason")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_IDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    group_ids: _containers.RepeatedScalarFieldContainer[str]
    reason: str
    def __init__(self, run_id: _Optional[str] = ..., group_ids: _Optional[_Iterable[str]] = ..., reason: _Optional[str] = ...) -> None: ...

class DropGroupsResponse(_message.Message):
    __slots__ = ("dropped",)
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    dropped: int
    def __init__(self, dropped: _Optional[int] = ...) -> None: ...

class LeaseBatchRequest(_message.Message):
    __slots__ = ("run_id", "num_groups", "lease_seconds", "wait_seconds", "min_weight_version", "num_samples", "stale_policy", "lease_id", "min_groups_by_dataset")
    class StalePolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STALE_POLICY_DROP: _ClassVar[LeaseBatchRequest.StalePolicy]
        STALE_POLICY_KEEP: _ClassVar[LeaseBatchRequest.StalePolicy]
    STALE_POLICY_DROP: LeaseBatchRequest.StalePolicy
    STALE_POLICY_KEEP: LeaseBatchRequest.StalePolicy
    class MinGroupsByDatasetEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MIN_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    STALE_POLICY_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    MIN_GROUPS_BY_DATASET_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    num_groups: int
    lease_seconds: float
    wait_seconds: float
    min_weight_version: int
    num_samples: int
    stale_policy: LeaseBatchRequest.StalePolicy
    lease_id: str
    min_groups_by_dataset: _containers.ScalarMap[str, int]
    def __init__(self, run_id: _Optional[str] = ..., num_groups: _Optional[int] = ..., lease_seconds: _Optional[float] = ..., wait_seconds: _Optional[float] = ..., min_weight_version: _Optional[int] = ..., num_samples: _Optional[int] = ..., stale_policy: _Optional[_Union[LeaseBatchRequest.StalePolicy, str]] = ..., lease_id: _Optional[str] = ..., min_groups_by_dataset: _Optional[_Mapping[str, int]] = ...) -> None: ...

class LeaseBatchResponse(_message.Message):
    __slots__ = ("lease_id", "groups", "stale_groups", "stale_groups_dropped")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    STALE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    STALE_GROUPS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    groups: _containers.RepeatedCompositeFieldContainer[_sample_pb2.SampleGroup]
    stale_groups: int
    stale_groups_dropped: int
    def __init__(self, lease_id: _Optional[str] = ..., groups: _Optional[_Iterable[_Union[_sample_pb2.SampleGroup, _Mapping]]] = ..., stale_groups: _Optional[int] = ..., stale_groups_dropped: _Optional[int] = ...) -> None: ...

class AckBatchRequest(_message.Message):
    __slots__ = ("run_id", "lease_id", "step", "provisional", "load_id")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PROVISIONAL_FIELD_NUMBER: _ClassVar[int]
    LOAD_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    lease_id: str
    step: int
    provisional: bool
    load_id: str
    def __init__(self, run_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., step: _Optional[int] = ..., provisional: _Optional[bool] = ..., load_id: _Optional[str] = ...) -> None: ...

class AckBatchResponse(_message.Message):
    __slots__ = ("acknowledged",)
    ACKNOWLEDGED_FIELD_NUMBER: _ClassVar[int]
    acknowledged: int
    def __init__(self, acknowledged: _Optional[int] = ...) -> None: ...

class CommitAcksRequest(_message.Message):
    __slots__ = ("run_id", "through_step", "load_id", "loaded_step")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    THROUGH_STEP_FIELD_NUMBER: _ClassVar[int]
    LOAD_ID_FIELD_NUMBER: _ClassVar[int]
    LOADED_STEP_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    through_step: int
    load_id: str
    loaded_step: int
    def __init__(self, run_id: _Optional[str] = ..., through_step: _Optional[int] = ..., load_id: _Optional[str] = ..., loaded_step: _Optional[int] = ...) -> None: ...

class CommitAcksResponse(_message.Message):
    __slots__ = ("committed", "requeued")
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    REQUEUED_FIELD_NUMBER: _ClassVar[int]
    committed: int
    requeued: int
    def __init__(self, committed: _Optional[int] = ..., requeued: _Optional[int] = ...) -> None: ...

class RollbackToCheckpointRequest(_message.Message):
    __slots__ = ("run_id", "step")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    step: int
    def __init__(self, run_id: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class RollbackToCheckpointResponse(_message.Message):
    __slots__ = ("committed", "requeued", "leases_released")
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    REQUEUED_FIELD_NUMBER: _ClassVar[int]
    LEASES_RELEASED_FIELD_NUMBER: _ClassVar[int]
    committed: int
    requeued: int
    leases_released: int
    def __init__(self, committed: _Optional[int] = ..., requeued: _Optional[int] = ..., leases_released: _Optional[int] = ...) -> None: ...

class RejectGroupsRequest(_message.Message):
    __slots__ = ("run_id", "lease_id", "groups")
    class Rejection(_message.Message):
        __slots__ = ("group_id", "reason")
        GROUP_ID_FIELD_NUMBER: _ClassVar[int]
        REASON_FIELD_NUMBER: _ClassVar[int]
        group_id: str
        reason: str
        def __init__(self, group_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    lease_id: str
    groups: _containers.RepeatedCompositeFieldContainer[RejectGroupsRequest.Rejection]
    def __init__(self, run_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., groups: _Optional[_Iterable[_Union[RejectGroupsRequest.Rejection, _Mapping]]] = ...) -> None: ...

class RejectGroupsResponse(_message.Message):
    __slots__ = ("rejected",)
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    rejected: int
    def __init__(self, rejected: _Optional[int] = ...) -> None: ...

class ReleaseBatchRequest(_message.Message):
    __slots__ = ("run_id", "lease_id")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    lease_id: str
    def __init__(self, run_id: _Optional[str] = ..., lease_id: _Optional[str] = ...) -> None: ...

class ReleaseBatchResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ("run_id", "min_weight_version")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MIN_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    min_weight_version: int
    def __init__(self, run_id: _Optional[str] = ..., min_weight_version: _Optional[int] = ...) -> None: ...

class BufferStats(_message.Message):
    __slots__ = ("queued_groups", "leased_groups", "partial_groups", "acknowledged_groups", "dropped_groups", "prompts_handed_out", "epoch", "offset", "next_sample_index", "groups_written", "redelivered_groups", "stale_groups_dropped", "stale_groups_kept", "prompts_skipped", "prompts_skipped_by_dataset", "prompts_reissued", "partial_groups_returned", "dropped_by_reason", "groups_written_per_second", "groups_acknowledged_per_second", "prompts_handed_out_per_second", "rate_window_seconds", "queued_samples", "dead_letter_groups", "provisional_groups", "rolled_back_groups", "dataset_rows", "queued_groups_from", "expired_lease_groups")
    class PromptsSkippedByDatasetEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class DroppedByReasonEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class DatasetRowsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    QUEUED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    LEASED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_GROUPS_FIELD_NUMBER: _ClassVar[int]
    ACKNOWLEDGED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_HANDED_OUT_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NEXT_SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    GROUPS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    REDELIVERED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    STALE_GROUPS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    STALE_GROUPS_KEPT_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_SKIPPED_BY_DATASET_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_REISSUED_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_GROUPS_RETURNED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_BY_REASON_FIELD_NUMBER: _ClassVar[int]
    GROUPS_WRITTEN_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    GROUPS_ACKNOWLEDGED_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_HANDED_OUT_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    RATE_WINDOW_SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    DEAD_LETTER_GROUPS_FIELD_NUMBER: _ClassVar[int]
    PROVISIONAL_GROUPS_FIELD_NUMBER: _ClassVar[int]
    ROLLED_BACK_GROUPS_FIELD_NUMBER: _ClassVar[int]
    DATASET_ROWS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_GROUPS_FROM_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_LEASE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    queued_groups: int
    leased_groups: int
    partial_groups: int
    acknowledged_groups: int
    dropped_groups: int
    prompts_handed_out: int
    epoch: int
    offset: int
    next_sample_index: int
    groups_written: int
    redelivered_groups: int
    stale_groups_dropped: int
    stale_groups_kept: int
    prompts_skipped: int
    prompts_skipped_by_dataset: _containers.ScalarMap[str, int]
    prompts_reissued: int
    partial_groups_returned: int
    dropped_by_reason: _containers.ScalarMap[str, int]
    groups_written_per_second: float
    groups_acknowledged_per_second: float
    prompts_handed_out_per_second: float
    rate_window_seconds: float
    queued_samples: int
    dead_letter_groups: int
    provisional_groups: int
    rolled_back_groups: int
    dataset_rows: _containers.ScalarMap[str, int]
    queued_groups_from: int
    expired_lease_groups: int
    def __init__(self, queued_groups: _Optional[int] = ..., leased_groups: _Optional[int] = ..., partial_groups: _Optional[int] = ..., acknowledged_groups: _Optional[int] = ..., dropped_groups: _Optional[int] = ..., prompts_handed_out: _Optional[int] = ..., epoch: _Optional[int] = ..., offset: _Optional[int] = ..., next_sample_index: _Optional[int] = ..., groups_written: _Optional[int] = ..., redelivered_groups: _Optional[int] = ..., stale_groups_dropped: _Optional[int] = ..., stale_groups_kept: _Optional[int] = ..., prompts_skipped: _Optional[int] = ..., prompts_skipped_by_dataset: _Optional[_Mapping[str, int]] = ..., prompts_reissued: _Optional[int] = ..., partial_groups_returned: _Optional[int] = ..., dropped_by_reason: _Optional[_Mapping[str, int]] = ..., groups_written_per_second: _Optional[float] = ..., groups_acknowledged_per_second: _Optional[float] = ..., prompts_handed_out_per_second: _Optional[float] = ..., rate_window_seconds: _Optional[float] = ..., queued_samples: _Optional[int] = ..., dead_letter_groups: _Optional[int] = ..., provisional_groups: _Optional[int] = ..., rolled_back_groups: _Optional[int] = ..., dataset_rows: _Optional[_Mapping[str, int]] = ..., queued_groups_from: _Optional[int] = ..., expired_lease_groups: _Optional[int] = ...) -> None: ...

class ExportGroupsRequest(_message.Message):
    __slots__ = ("run_id", "path", "dead_letters")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    DEAD_LETTERS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    path: str
    dead_letters: bool
    def __init__(self, run_id: _Optional[str] = ..., path: _Optional[str] = ..., dead_letters: _Optional[bool] = ...) -> None: ...

class ExportGroupsResponse(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: int
    def __init__(self, groups: _Optional[int] = ...) -> None: ...

class ImportGroupsRequest(_message.Message):
    __slots__ = ("run_id", "path")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    path: str
    def __init__(self, run_id: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class ImportGroupsResponse(_message.Message):
    __slots__ = ("groups", "duplicates")
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    groups: int
    duplicates: int
    def __init__(self, groups: _Optional[int] = ..., duplicates: _Optional[int] = ...) -> None: ...

class GetRecentGroupsRequest(_message.Message):
    __slots__ = ("run_id", "offset", "limit")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    offset: int
    limit: int
    def __init__(self, run_id: _Optional[str] = ..., offset: _Optional[int] = ..., limit: _Optional[int] = ...) -> None: ...

class GetRecentGroupsResponse(_message.Message):
    __slots__ = ("groups", "total")
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[_sample_pb2.SampleGroup]
    total: int
    def __init__(self, groups: _Optional[_Iterable[_Union[_sample_pb2.SampleGroup, _Mapping]]] = ..., total: _Optional[int] = ...) -> None: ...
