"""`rlmesh up --config STACK.yaml`: one section per service, each holding the settings that
`rlmesh serve SERVICE --help` lists (plug-in registrations among them: the rollout
service's tools and generate functions, the reward service's custom functions, the
buffer's filter). Each section is checked against the service's Settings when the stack
starts, written to <data_dir>/config/<service>.yaml and given to the service as its
--config. What `rlmesh up` wires itself (host, ports, the services' addresses, the engine's
model) stays the launcher's; data_roots and model_roots add to the launcher's.

Reload: plug-ins are imported when a service starts, so a running process cannot take new
ones. SIGHUP to `rlmesh up` reads the file again and restarts only the services whose
section changed, on their ports; the rest of the stack, and the run, carry on (the run's
calls to a restarting service are retried, docs/fault-tolerance.md)."""

from __future__ import annotations

import importlib
from pathlib import Path

import yaml
from pydantic import ValidationError

SECTIONS = ("engine", "reward", "buffer", "rollout", "trainer", "coordinator")
# Settings the launcher adds to rather than sets.
ADDED_LISTS = ("data_roots", "model_roots", "weight_roots")
MAX_BYTES = 1024 * 1024


class StackConfigError(Exception):
    """A stack config that cannot work, said in one line."""


def settings_class(service: str):
    package = "rlmesh.coordinator" if service == "coordinator" else f"rlmesh.{service}"
    return importlib.import_module(f"{package}.config").Settings


def load_stack_config(path: str | Path) -> dict[str, dict]:
    """The file's sections, each checked against its service's Settings (a StackConfigError
    names the file, the section and the setting)."""
    path = Path(path)
    try:
        if path.stat().st_size > MAX_BYTES:
            raise StackConfigError(f"{path} is larger than {MAX_BYTES} bytes")
        raw = yaml.safe_load(path.read_text()) or {}
    except OSError as e:
        raise StackConfigError(f"{path} cannot be read: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise StackConfigError(f"{path} is not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise StackConfigError(f"{path} must map service names ({', '.join(SECTIONS)}) to their settings")
    config = {}
    for service, section in raw.items():
        if service not in SECTIONS:
            raise StackConfigError(f"{path}: no service {service!r}; the sections are {', '.join(SECTIONS)}")
        section = section or {}
        if not isinstance(section, dict):
            raise StackConfigError(f"{path}: {service} must map setting names to values")
        try:
            settings_class(service).model_validate(section)
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors())
            raise StackConfigError(
                f"{path}: {service}: {problems} (`rlmesh serve {service} --help` lists its settings)"
            ) from None
        config[service] = section
    return config


def overridden(config: dict[str, dict], wired: dict[str, list[str]]) -> list[str]:
    """'service.setting' for each setting of the file that the launcher sets itself (its
    flags `wired[service]`), so `rlmesh up` can say it ignores them."""
    return [
        f"{service}.{name}"
        for service, section in config.items()
        for name in section
        if name in wired.get(service, []) and name not in ADDED_LISTS
    ]


def write_sections(config: dict[str, dict], out_dir: Path, write) -> dict[str, Path]:
    """Each service's section as its own YAML file (by `write`, which keeps it private);
    service -> file."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {}
    for service, section in config.items():
        files[service] = out_dir / f"{service}.yaml"
        write(files[service], yaml.safe_dump({k: v for k, v in section.items() if k not in ADDED_LISTS}))
    return files
