"""Plug-in points: the operator's code, named by import path in a service's settings.

One syntax, `package.module:attribute` (the attribute may be dotted, `module:Class.method`),
one loader, and one setting type, `PluginPath`, that imports the object when the settings are
built: a typo stops the service at start-up, never a run halfway. Built-in defaults are import
paths too, so built-in and custom code go through the same door. Requests never carry import
paths; they pick plug-ins by the names the operator registered."""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import AfterValidator, Field

_SYNTAX = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


class PluginError(ValueError):
    """An import path that does not name a callable; the message says which part is wrong."""


@functools.cache
def load_plugin(path: str) -> Callable[..., Any]:
    """'package.module:function' (or 'package.module:Class.method') -> the callable."""
    if not _SYNTAX.match(path):
        raise PluginError(f"{path!r} is not an import path like 'my_pkg.module:function'")
    module_name, _, attribute = path.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as e:  # a module that fails while importing is as unusable as a missing one
        raise PluginError(f"cannot import module '{module_name}' for '{path}': {type(e).__name__}: {e}") from None
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise PluginError(f"'{path}': '{module_name}' has no attribute '{attribute}'") from None
    if not callable(target):
        raise PluginError(f"'{path}' is not callable")
    return target


def _loadable(path: str) -> str:
    load_plugin(path)
    return path


# A setting that names a plug-in: checked (imported) when the settings are built, kept as text
# so settings still print, serialise and pass to subprocesses as they were written.
PluginPath = Annotated[str, AfterValidator(_loadable), Field(examples=["my_pkg.module:function"])]
