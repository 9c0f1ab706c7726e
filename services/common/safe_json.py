"""JSON that callers send, parsed without crashing on text nested deeper than the
decoder's stack allows: such text is bad JSON like any other (json.JSONDecodeError, a
ValueError), never a RecursionError that escapes as an internal error."""

from __future__ import annotations

import json
from typing import Any


def loads(text: str | bytes) -> Any:
    try:
        return json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply", text if isinstance(text, str) else "", 0) from None
