"""Sampling parameters: the run config's SamplingConfig, the SamplingParams protobuf, and
the dict SGLang's /generate takes. proto3 cannot tell "unset" from zero, so the sender
always fills every field (from SamplingConfig) and zeros that SGLang would reject map
back to SGLang's defaults."""

from __future__ import annotations

from pydantic import ValidationError

from rlmesh.common.errors import InvalidArgument, validation_problems
from rlmesh.common.run_config import SamplingConfig
from rlmesh.v1 import rollout_pb2


def sampling_to_proto(cfg: SamplingConfig) -> rollout_pb2.SamplingParams:
    return rollout_pb2.SamplingParams(**cfg.model_dump())


def sampling_to_sglang(p: rollout_pb2.SamplingParams) -> dict:
    """SGLang's parameters, checked as the run config checks them: InvalidArgument names the
    field out of bounds (the same answer as a 422 from the REST API)."""
    values = {
        "max_new_tokens": p.max_new_tokens or 128,
        "temperature": p.temperature,
        "top_p": p.top_p or 1.0,
        "top_k": p.top_k or -1,
        "min_p": p.min_p,
        "ignore_eos": p.ignore_eos,
        "no_stop_trim": p.no_stop_trim,
        "repetition_penalty": p.repetition_penalty or 1.0,
        "frequency_penalty": p.frequency_penalty,
        "presence_penalty": p.presence_penalty,
        "min_new_tokens": p.min_new_tokens,
        "stop": list(p.stop),
        "stop_token_ids": list(p.stop_token_ids),
    }
    try:
        params = SamplingConfig.model_validate(values).model_dump()
    except ValidationError as e:
        where = validation_problems(e, "sampling")
        raise InvalidArgument(f"sampling: {where}") from None
    for name in ("stop", "stop_token_ids"):
        if not params[name]:
            del params[name]
    return params
