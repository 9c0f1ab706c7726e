"""The tools an agent loop may call: Python functions named by import path and HTTP
endpoints named by URL, both registered in the rollout service's settings. A call never
raises and never hangs: whatever goes wrong (unknown tool, bad arguments, an exception,
a timeout, an HTTP error) comes back as text for the model's next turn."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import random
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from rlmesh.common.plugins import load_plugin
from rlmesh.rollout.config import HttpTool, Settings

log = logging.getLogger(__name__)

_JSON_TYPES = {int: "integer", float: "number", bool: "boolean", str: "string", list: "array", dict: "object"}


def function_schema(name: str, fn: Callable[..., Any]) -> dict[str, Any]:
    """OpenAI function schema of a Python tool: its `tool_schema` attribute, else built
    from its signature (annotated builtin types; parameters without a default are
    required) and the first paragraph of its docstring."""
    declared = getattr(fn, "tool_schema", None)
    if declared is not None:
        return declared if "function" in declared else {"type": "function", "function": declared}
    properties: dict[str, Any] = {}
    required: list[str] = []
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # annotations that do not resolve: no types, still a schema
        hints = {}
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        json_type = _JSON_TYPES.get(hints.get(param.name))
        properties[param.name] = {"type": json_type} if json_type else {}
        if param.default is param.empty:
            required.append(param.name)
    doc = (inspect.getdoc(fn) or "").split("\n\n")[0].strip()
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": doc,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


@dataclass(frozen=True)
class ToolResult:
    text: str
    ok: bool


class ToolBox:
    """The operator's tools, by name. Python tools run in the rollout service's process (a
    plain function in a worker thread); HTTP tools get the call's arguments as a JSON body,
    with the tool's timeout, retries and concurrency cap."""

    def __init__(self, settings: Settings, http: httpx.AsyncClient | None = None) -> None:
        self.functions = {name: load_plugin(path) for name, path in settings.tools.items()}
        self.http_tools: dict[str, HttpTool] = {t.name: t for t in settings.http_tools}
        clash = set(self.functions) & set(self.http_tools)
        if clash:
            raise ValueError(f"tools named both in tools and http_tools: {', '.join(sorted(clash))}")
        self._http = http
        self._limits = {name: asyncio.Semaphore(t.max_concurrency) for name, t in self.http_tools.items()}

    @property
    def names(self) -> list[str]:
        return sorted([*self.functions, *self.http_tools])

    def schemas(self, names: list[str]) -> list[dict[str, Any]]:
        """The schemas of the named tools, in that order, for the chat template."""
        out = []
        for name in names:
            if name in self.functions:
                out.append(function_schema(name, self.functions[name]))
            else:
                t = self.http_tools[name]
                out.append(
                    {
                        "type": "function",
                        "function": {"name": name, "description": t.description, "parameters": t.parameters},
                    }
                )
        return out

    async def call(self, name: str, arguments: dict[str, Any], allowed: list[str], timeout: float) -> ToolResult:
        if name not in allowed:
            return ToolResult(
                f"error: there is no tool named {name!r}; the tools are: {', '.join(allowed) or 'none'}", False
            )
        try:
            if name in self.functions:
                value = await asyncio.wait_for(self._call_function(self.functions[name], arguments), timeout)
            else:
                value = await self._call_http(self.http_tools[name], arguments)
        except TimeoutError:
            return ToolResult(f"error: tool {name!r} did not answer within {timeout:g} s", False)
        except Exception as e:  # the tool's own failure is the model's information, not ours
            return ToolResult(f"error: tool {name!r} failed: {type(e).__name__}: {e}", False)
        return ToolResult(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str), True)

    @staticmethod
    async def _call_function(fn: Callable[..., Any], arguments: dict[str, Any]) -> Any:
        if inspect.iscoroutinefunction(fn):
            return await fn(**arguments)
        # A thread cannot be killed: a timed-out call is abandoned (its sample goes on).
        return await asyncio.to_thread(fn, **arguments)

    async def _call_http(self, tool: HttpTool, arguments: dict[str, Any]) -> str:
        if self._http is None:
            self._http = httpx.AsyncClient()
        async with self._limits[tool.name]:
            for attempt in range(tool.retries + 1):
                try:
                    r = await self._http.post(tool.url, json=arguments, timeout=tool.timeout_seconds)
                except (httpx.TransportError, httpx.TimeoutException) as e:
                    problem = f"{type(e).__name__}: {e}"
                else:
                    if r.status_code < 500:
                        if r.status_code >= 400:
                            return f"error: tool {tool.name!r} answered HTTP {r.status_code}: {r.text[:1000]}"
                        return r.text
                    problem = f"HTTP {r.status_code}"
                if attempt < tool.retries:
                    log.warning("tool %s at %s: %s; retrying", tool.name, tool.url, problem)
                    await asyncio.sleep(min(0.2 * 2**attempt, 5.0) * (0.5 + random.random()))
            raise ConnectionError(f"{problem} after {tool.retries + 1} tries")

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
