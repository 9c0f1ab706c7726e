"""Building a transformers model: one at a time in a process.

transformers builds a model under process-wide patches (it replaces
`PreTrainedModel.tie_weights` with a no-op, sets torch's default dtype, patches creation ops),
each put back, on exit, to what it found on entry. Two builds at once in one process can each
put back the other's patch: tying then stays off for good, and every model built afterwards
keeps an lm_head that was never loaded, on the meta device ("Cannot copy out of meta tensor").
A trainer that loaded a run's model while its previous run's final model was loaded beside it
failed every run after. Every model rlmesh builds goes through `build_hf_model`."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

_BUILDING = threading.Lock()


def build_hf_model(build: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """`build(*args, **kwargs)` (a `from_pretrained` or `from_config`), with no other build
    in this process meanwhile."""
    with _BUILDING:
        return build(*args, **kwargs)
