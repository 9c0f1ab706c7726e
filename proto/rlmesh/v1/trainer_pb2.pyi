from rlmesh.v1 import check_pb2 as _check_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InitRunRequest(_message.Message):
    __slots__ = ("run_id", "config_json")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    config_json: str
    def __init__(self, run_id: _Optional[str] = ..., config_json: _Optional[str] = ...) -> None: ...

class TrainStepRequest(_message.Message):
    __slots__ = ("run_id", "num_groups", "wait_seconds", "loss", "answer_without_batch", "min_groups_by_dataset")
    class MinGroupsByDatasetEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    ANSWER_WITHOUT_BATCH_FIELD_NUMBER: _ClassVar[int]
    MIN_GROUPS_BY_DATASET_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    num_groups: int
    wait_seconds: float
    loss: str
    answer_without_batch: bool
    min_groups_by_dataset: _containers.ScalarMap[str, int]
    def __init__(self, run_id: _Optional[str] = ..., num_groups: _Optional[int] = ..., wait_seconds: _Optional[float] = ..., loss: _Optional[str] = ..., answer_without_batch: _Optional[bool] = ..., min_groups_by_dataset: _Optional[_Mapping[str, int]] = ...) -> None: ...

class TrainStepResponse(_message.Message):
    __slots__ = ("step", "groups_trained", "samples_trained", "metrics", "no_batch", "stale_groups_dropped")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    GROUPS_TRAINED_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_TRAINED_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    NO_BATCH_FIELD_NUMBER: _ClassVar[int]
    STALE_GROUPS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    step: int
    groups_trained: int
    samples_trained: int
    metrics: _containers.ScalarMap[str, float]
    no_batch: bool
    stale_groups_dropped: int
    def __init__(self, step: _Optional[int] = ..., groups_trained: _Optional[int] = ..., samples_trained: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., no_batch: _Optional[bool] = ..., stale_groups_dropped: _Optional[int] = ...) -> None: ...

class PublishWeightsRequest(_message.Message):
    __slots__ = ("run_id", "version", "method", "again", "pause_mode", "background")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    AGAIN_FIELD_NUMBER: _ClassVar[int]
    PAUSE_MODE_FIELD_NUMBER: _ClassVar[int]
    BACKGROUND_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    version: int
    method: str
    again: bool
    pause_mode: str
    background: bool
    def __init__(self, run_id: _Optional[str] = ..., version: _Optional[int] = ..., method: _Optional[str] = ..., again: _Optional[bool] = ..., pause_mode: _Optional[str] = ..., background: _Optional[bool] = ...) -> None: ...

class WaitForPushRequest(_message.Message):
    __slots__ = ("run_id", "version")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    version: int
    def __init__(self, run_id: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class PublishWeightsResponse(_message.Message):
    __slots__ = ("version", "seconds", "bytes", "buckets", "engines_continued")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    ENGINES_CONTINUED_FIELD_NUMBER: _ClassVar[int]
    version: int
    seconds: float
    bytes: int
    buckets: int
    engines_continued: bool
    def __init__(self, version: _Optional[int] = ..., seconds: _Optional[float] = ..., bytes: _Optional[int] = ..., buckets: _Optional[int] = ..., engines_continued: _Optional[bool] = ...) -> None: ...

class SaveCheckpointRequest(_message.Message):
    __slots__ = ("run_id", "path")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    path: str
    def __init__(self, run_id: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class SaveCheckpointResponse(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ("run_id", "held_run")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    HELD_RUN_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    held_run: bool
    def __init__(self, run_id: _Optional[str] = ..., held_run: _Optional[bool] = ...) -> None: ...

class EndRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class TrainerStatus(_message.Message):
    __slots__ = ("run_id", "step", "weight_version", "model_path", "resumed_step", "step_in_flight", "unacknowledged_step", "waiting_for", "final_model", "vocab_size", "final_model_problem")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    RESUMED_STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    UNACKNOWLEDGED_STEP_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_FIELD_NUMBER: _ClassVar[int]
    FINAL_MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    FINAL_MODEL_PROBLEM_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    step: int
    weight_version: int
    model_path: str
    resumed_step: int
    step_in_flight: bool
    unacknowledged_step: int
    waiting_for: _containers.RepeatedScalarFieldContainer[str]
    final_model: str
    vocab_size: int
    final_model_problem: str
    def __init__(self, run_id: _Optional[str] = ..., step: _Optional[int] = ..., weight_version: _Optional[int] = ..., model_path: _Optional[str] = ..., resumed_step: _Optional[int] = ..., step_in_flight: _Optional[bool] = ..., unacknowledged_step: _Optional[int] = ..., waiting_for: _Optional[_Iterable[str]] = ..., final_model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., final_model_problem: _Optional[str] = ...) -> None: ...

class ListCheckpointsRequest(_message.Message):
    __slots__ = ("run_id", "checkpoint_dir")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_DIR_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    checkpoint_dir: str
    def __init__(self, run_id: _Optional[str] = ..., checkpoint_dir: _Optional[str] = ...) -> None: ...

class Checkpoint(_message.Message):
    __slots__ = ("step", "path", "automatic", "weight_version", "written_at", "final")
    STEP_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    AUTOMATIC_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_AT_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    step: int
    path: str
    automatic: bool
    weight_version: int
    written_at: float
    final: bool
    def __init__(self, step: _Optional[int] = ..., path: _Optional[str] = ..., automatic: _Optional[bool] = ..., weight_version: _Optional[int] = ..., written_at: _Optional[float] = ..., final: _Optional[bool] = ...) -> None: ...

class CheckRunRequest(_message.Message):
    __slots__ = ("config_json", "token_ids")
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    config_json: str
    token_ids: _containers.RepeatedCompositeFieldContainer[TokenIds]
    def __init__(self, config_json: _Optional[str] = ..., token_ids: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("field", "ids")
    FIELD_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    field: str
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, field: _Optional[str] = ..., ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ListCheckpointsResponse(_message.Message):
    __slots__ = ("checkpoints",)
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    checkpoints: _containers.RepeatedCompositeFieldContainer[Checkpoint]
    def __init__(self, checkpoints: _Optional[_Iterable[_Union[Checkpoint, _Mapping]]] = ...) -> None: ...
