"""The base of every run-config model: unknown fields, NaN and infinities, invalid
Unicode and overlong text refused (shared by run_config.py and training_config.py)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from rlmesh.common.limits import INT32_MAX

Key = Annotated[str, StringConstraints(min_length=1, max_length=128)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
# A stop string (SGLang's sampling_params.stop): an empty one would end every response at once.
StopText = Annotated[str, Field(min_length=1, max_length=4096)]


class StrictModel(BaseModel):
    """Refuses unknown fields, NaN and infinities, text that is not valid Unicode (lone
    surrogates cannot be stored or sent on) and text longer than 4096 characters."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, str_max_length=4096)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        _refuse_surrogates(data, ())
        return data


def _refuse_surrogates(value: Any, where: tuple) -> None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            at = ".".join(map(str, where)) or "a text"
            raise ValueError(f"{at} is not valid Unicode (it holds a lone surrogate)") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _refuse_surrogates(k, where)
            _refuse_surrogates(v, (*where, k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _refuse_surrogates(v, (*where, i))
