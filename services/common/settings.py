"""Typed configuration shared by every service: values come from (lowest to highest)
field defaults, a YAML file, RLMESH_<SERVICE>_* environment variables, command-line
flags. Each service documents its settings once, as field descriptions on its own
`Settings` class; `rlmesh serve <service> --help` prints them."""

from __future__ import annotations

import argparse
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from rlmesh.common.limits import Limits

S = TypeVar("S", bound=BaseSettings)


class ServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = 0
    max_message_bytes: int = 256 * 1024 * 1024
    log_level: str = "INFO"
    limits: Limits = Field(
        default_factory=Limits,
        description="Upper bounds on every count a caller can ask "
        'for (see rlmesh.common.limits), e.g. {"max_groups_per_call": 8192}.',
    )


class GrpcServiceSettings(ServiceSettings):
    """Settings of every gRPC service (buffer, rollout, reward, trainer): ServiceSettings and
    its Prometheus endpoint. (The coordinator and the reference engine serve /metrics on
    their own HTTP port.)"""

    metrics_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="Port of the Prometheus GET /metrics HTTP endpoint "
        "(0 = off). It needs the stack's bearer token, like every port.",
    )
    metrics_host: str = Field(
        "127.0.0.1",
        description="Address the /metrics endpoint binds to (0.0.0.0 where "
        "Prometheus scrapes from another host, e.g. in Kubernetes).",
    )


def _is_scalar(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is getattr(__import__("types"), "UnionType", None):
        return all(_is_scalar(a) for a in typing.get_args(annotation) if a is not type(None))
    if origin is typing.Literal:
        return all(isinstance(a, (str, int, float, bool)) for a in typing.get_args(annotation))
    return annotation in (str, int, float, bool, Path)


def add_settings_flags(parser: argparse.ArgumentParser, cls: type[BaseModel]) -> None:
    parser.add_argument("--config", type=Path, help="YAML file with settings (flags and env vars override it)")
    for name, f in cls.model_fields.items():
        flag = "--" + name.replace("_", "-")
        default = f.default if not callable(f.default_factory) else "(computed)"
        help_text = f"{f.description or ''} [default: {default}]"
        if f.annotation is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif _is_scalar(f.annotation):
            parser.add_argument(flag, dest=name, default=None, help=help_text)
        else:
            parser.add_argument(flag, dest=name, default=None, help=help_text + " (JSON)")


def settings_from_args(cls: type[S], args: argparse.Namespace) -> S:
    """Merge YAML file, environment and flags. Environment values are read by pydantic;
    explicit flags are passed as init kwargs so they win."""
    values: dict[str, Any] = {}
    if getattr(args, "config", None):
        values.update(yaml.safe_load(Path(args.config).read_text()) or {})
    env_settings = cls()  # defaults + environment
    merged = {**values, **{k: v for k, v in env_settings.model_dump().items() if k in env_settings.model_fields_set}}
    for name in cls.model_fields:
        v = getattr(args, name, None)
        if v is not None:
            merged[name] = _parse_flag(cls.model_fields[name].annotation, v)
    return cls(**merged)


def _parse_flag(annotation: Any, value: Any) -> Any:
    if isinstance(value, str) and not _is_scalar(annotation):
        import json

        return json.loads(value)
    return value
