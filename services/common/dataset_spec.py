"""Dataset options: the run config's `DatasetConfig` (declared and documented once) and the
`DatasetSpec` protobuf that carries it to the buffer, converted here and nowhere else.

proto3 cannot tell "unset" from zero, so on the way back an empty text or a zero number
means the config's default (or the run-wide value the CreateRun request gives); booleans
and the seed are taken as sent."""

from __future__ import annotations

from pydantic import ValidationError

from rlmesh.common.errors import InvalidArgument, validation_problems
from rlmesh.common.run_config import DatasetConfig
from rlmesh.v1 import buffer_pb2

# Fields whose zero value on the wire means "not set"; every other field is taken as sent.
_AS_SENT = ("shuffle", "seed", "eval", "apply_chat_template")


def dataset_to_proto(cfg: DatasetConfig) -> buffer_pb2.DatasetSpec:
    return buffer_pb2.DatasetSpec(**cfg.model_dump())


def dataset_from_proto(spec: buffer_pb2.DatasetSpec, run: buffer_pb2.CreateRunRequest) -> DatasetConfig:
    """The dataset's options with defaults applied: its own value, else the run's, else the
    config's default. Raises InvalidArgument naming the dataset and the bad field."""
    fields = {name: getattr(spec, name) for name in DatasetConfig.model_fields}
    values = {k: v for k, v in fields.items() if k in _AS_SENT or v}
    # Run-wide defaults (the run's tokenizer and templating) fill what the dataset leaves open.
    for name in ("tokenizer_path", "apply_chat_template", "max_prompt_length"):
        if not fields[name] and getattr(run, name):
            values[name] = getattr(run, name)
    try:
        return DatasetConfig(**values)
    except ValidationError as e:
        where = validation_problems(e, "dataset")
        raise InvalidArgument(f"dataset {spec.name!r}: {where}") from None


def dataset_defaults() -> dict:
    """The config's default for every option that has one (fills specs stored before an option existed)."""
    return {
        name: f.get_default(call_default_factory=True)
        for name, f in DatasetConfig.model_fields.items()
        if not f.is_required()
    }
