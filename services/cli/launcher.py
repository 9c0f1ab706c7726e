"""`rlmesh up`: every service as a local process, wired together on free loopback ports,
with an embedded Redis when no Redis URL is given. Logs go to <data_dir>/logs/. The stack's
token (RLMESH_TOKEN, generated when not set) reaches the services through their environment
and other local clients through <data_dir>/token (readable by this user only). Once up, a
Supervisor starts any process that exits again, on the same port, with backoff."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Protocol

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rlmesh.cli import agent_demo
from rlmesh.cli.embedded_redis import EmbeddedRedis, EmbeddedRedisSettings, start_redis
from rlmesh.cli.stack_config import ADDED_LISTS, overridden, write_sections
from rlmesh.common import auth
from rlmesh.common.grpc_server import sync_channel
from rlmesh.common.net import free_port, redacted

# Start order: each service's dependencies come before it.
SERVICES = ("engine", "reward", "buffer", "rollout", "trainer", "coordinator")
# gRPC services with a Prometheus endpoint of their own (metrics_port); the coordinator and the engine
# serve /metrics on their HTTP port.
METRICS_SERVICES = ("reward", "buffer", "rollout", "trainer")
HTTP_SERVICES = ("engine", "coordinator")


@dataclass
class Stack:
    data_dir: Path
    redis_url: str
    ports: dict[str, int]
    model_path: str = ""
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    redis: EmbeddedRedis | None = None
    # `rlmesh up --config`: service -> its section (stack_config.py), and the file each reads
    service_config: dict[str, dict] = field(default_factory=dict)
    config_files: dict[str, Path] = field(default_factory=dict)

    @property
    def coordinator_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['coordinator']}"

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def log_file(self, name: str) -> Path:
        return self.data_dir / "logs" / f"{name}.log"

    def flags(self, name: str) -> list[str]:
        """The service's command line: its --config (the stack config's section), then what the
        launcher wires (which wins), with the section's data_roots and model_roots added."""
        own = ["--config", str(self.config_files[name])] if name in self.config_files else []
        wired = self.wired_flags(name)
        section = self.service_config.get(name, {})
        for key in ADDED_LISTS:
            flag = "--" + key.replace("_", "-")
            if section.get(key) and flag in wired:
                i = wired.index(flag) + 1
                wired[i] = json.dumps(json.loads(wired[i]) + [str(Path(r).resolve()) for r in section[key]])
        return own + wired

    def wired_flags(self, name: str) -> list[str]:
        a = self.address
        common = ["--host", "127.0.0.1", "--port", str(self.ports[name])]
        if name in METRICS_SERVICES:  # Prometheus /metrics of each gRPC service, on loopback
            common += ["--metrics-port", str(self.ports[f"{name}_metrics"])]
        return (
            common
            + {
                "engine": [
                    "--model-path",
                    self.model_path,
                    "--enable-metrics",
                    # (the trainer's disk pushes: under its work_dir, in the data directory)
                    "--weight-roots",
                    json.dumps(self.model_roots()),
                ],
                # A local stack's judges run on this machine: let the reward service call loopback.
                "reward": ["--remote-allowed-networks", json.dumps(["127.0.0.0/8", "::1"])],
                "buffer": [
                    "--data-roots",
                    json.dumps([str(Path("data").resolve()), str(datasets_dir(self.data_dir))]),
                    "--model-roots",
                    json.dumps(self.model_roots()),
                    "--export-dir",
                    str(self.data_dir / "buffer" / "exports"),
                ],
                "rollout": [
                    "--buffer-address",
                    a("buffer"),
                    "--reward-address",
                    a("reward"),
                    "--engine-urls",
                    json.dumps([f"http://{a('engine')}"]),
                ],
                "trainer": [
                    "--buffer-address",
                    a("buffer"),
                    "--rollout-address",
                    a("rollout"),
                    "--work-dir",
                    str(self.data_dir / "trainer"),
                    "--model-roots",
                    json.dumps(self.model_roots()),
                ],
                "coordinator": [
                    "--buffer-address",
                    a("buffer"),
                    "--rollout-address",
                    a("rollout"),
                    "--reward-address",
                    a("reward"),
                    "--trainer-address",
                    a("trainer"),
                    "--log-dir",
                    str(self.data_dir / "run-logs"),
                ],
            }[name]
        )

    def model_roots(self) -> list[str]:
        """Where the stack's runs may load models and tokenizers: ./models, the stack's data
        directory (its tiny models, the demo's), and the engine's model."""
        roots = [str(Path("models").resolve()), str(self.data_dir.resolve())]
        return roots + [str(Path(self.model_path).resolve())] if self.model_path else roots

    def env(self) -> dict[str, str]:
        """Secrets reach the services by environment (flags show in `ps`): the Redis URL, which
        may hold a password, and the stack's token, which the engine demands as its API key."""
        token = auth.ensure_stack_token()
        redis = {f"RLMESH_{name.upper()}_REDIS_URL": self.redis_url for name in ("buffer", "reward", "coordinator")}
        # The agent demo's tool, unless the operator registers tools of their own.
        tools = {"RLMESH_ROLLOUT_TOOLS": json.dumps({agent_demo.TOOL_NAME: agent_demo.TOOL_IMPORT_PATH})}
        if "tools" in self.service_config.get("rollout", {}):  # (the environment would win over the file)
            tools = {}
        return {
            **tools,
            **os.environ,
            **redis,
            "RLMESH_ENGINE_API_KEY": token,
            "RLMESH_ROLLOUT_ENGINE_API_KEY": token,
            "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }

    def spawn(self, name: str) -> subprocess.Popen:
        """Start (or start again) one service on its port with its flags and environment."""
        with open(self.log_file(name), "ab") as log:  # the child keeps its own descriptor
            self.processes[name] = subprocess.Popen(
                [sys.executable, "-m", "rlmesh.cli", "serve", name, *self.flags(name)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env(),
            )
        return self.processes[name]

    def restart_redis(self) -> subprocess.Popen:
        """The embedded Redis again on its port, data directory and settings (its redis.conf
        keeps the passwords, its append-only file the data), so the services' URL stays valid."""
        assert self.redis is not None
        self.redis = start_redis(self.redis.data_dir, port=self.redis.port, settings=self.redis.settings)
        return self.redis.process

    def supervisor(self, echo=print, clock: Callable[[], float] = time.monotonic) -> Supervisor:
        """A Supervisor watching the embedded Redis (if any) and every service."""
        supervisor = Supervisor(echo=echo, clock=clock)
        if self.redis is not None:
            supervisor.watch("redis", self.redis.process, self.restart_redis, self.redis.data_dir / "redis.log")
        for name in SERVICES:
            supervisor.watch(name, self.processes[name], lambda n=name: self.spawn(n), self.log_file(name))
        return supervisor

    def write_state(self) -> None:
        _write_private(
            self.data_dir / "up.json",
            json.dumps(
                {
                    "pid": os.getpid(),
                    "redis_url": self.redis_url,
                    "ports": self.ports,
                    "coordinator_url": self.coordinator_url,
                }
            ),
        )

    @property
    def token_file(self) -> Path:
        return self.data_dir / "token"

    def stop(self) -> None:
        """SIGTERM in reverse start order (each service finishes in-flight work), then Redis."""
        for name in reversed(SERVICES):
            p = self.processes.get(name)
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
        if self.redis is not None:
            self.redis.stop()
        (self.data_dir / "up.json").unlink(missing_ok=True)
        self.token_file.unlink(missing_ok=True)


def datasets_dir(data_dir: Path) -> Path:
    """The stack's buffer reads datasets from here and from ./data (its data_roots); the demo's are here."""
    return data_dir / "datasets"


def http_ready(url: str) -> bool:
    """An HTTP service (engine, coordinator) answers GET /health with 200."""
    try:
        return httpx.get(url.rstrip("/") + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def wait_until_ready(ready: Callable[[], bool], process: subprocess.Popen, what: str, timeout: float = 180.0) -> None:
    """Poll `ready` until it holds; fail at once if the process exits, or after timeout."""
    deadline = time.monotonic() + timeout
    while not ready():
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with code {process.returncode} before it was ready")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} was not ready after {timeout:.0f} s")
        time.sleep(0.1)


def grpc_health(address: str, timeout: float = 2.0) -> str:
    """The server's overall grpc.health.v1 status ("SERVING", "NOT_SERVING", ...), or the
    gRPC error that kept it from answering. Health is open: no token is needed."""
    with sync_channel(address) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
            return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
        except grpc.RpcError as e:
            return f"{e.code().name}: {e.details()}"


def _ready(name: str, address: str) -> bool:
    if name in HTTP_SERVICES:
        return http_ready(f"http://{address}")
    return grpc_health(address) == "SERVING"


def start_stack(
    data_dir: str | Path,
    model_path: str,
    redis_url: str = "",
    timeout: float = 180.0,
    echo=print,
    redis_settings: EmbeddedRedisSettings | None = None,
    service_config: dict[str, dict] | None = None,
) -> Stack:
    data_dir = Path(data_dir).resolve()
    (data_dir / "logs").mkdir(parents=True, exist_ok=True)
    data_dir.chmod(0o700)  # the stack's token, its Redis, logs and checkpoints: this user's alone
    redis = None
    if not redis_url:
        redis = start_redis(data_dir / "redis", settings=redis_settings)
        redis_url = redis.url
        limit = redis.settings.maxmemory_bytes()
        echo(
            f"  redis        {redacted(redis_url)} (embedded, append-only file in {data_dir / 'redis'}, "
            f"appendfsync {redis.settings.appendfsync}, maxmemory {f'{limit / 1024**3:.1f} GiB' if limit else 'none'})"
        )
    ports = {n: free_port() for n in (*SERVICES, *(f"{m}_metrics" for m in METRICS_SERVICES))}
    stack = Stack(data_dir=data_dir, redis_url=redis_url, ports=ports, model_path=model_path, redis=redis)
    if service_config:
        stack.service_config = service_config
        stack.config_files = write_sections(service_config, data_dir / "config", _write_private)
        for setting in overridden(service_config, {n: wired_settings(stack.wired_flags(n)) for n in SERVICES}):
            echo(f"  note: {setting} in the stack config is ignored: rlmesh up sets it")
    _write_private(stack.token_file, auth.ensure_stack_token())
    try:
        for name in SERVICES:
            # The first start fails fast (a wrong flag or model should stop `up` at once);
            # only a stack that came up is supervised.
            process = stack.spawn(name)
            try:
                wait_until_ready(lambda: _ready(name, stack.address(name)), process, name, timeout)  # noqa: B023 - called at once
            except RuntimeError as e:
                raise RuntimeError(f"{e}; see {stack.log_file(name)}") from None
            echo(f"  {name:<12} {stack.address(name)}")
        for name in METRICS_SERVICES:
            echo(f"  {'metrics':<12} http://127.0.0.1:{stack.ports[name + '_metrics']}/metrics ({name}, Prometheus)")
        echo(
            f"  {'metrics':<12} http://{stack.address('coordinator')}/metrics, http://{stack.address('engine')}/metrics"
        )
    except BaseException:
        stack.stop()
        raise
    stack.write_state()
    return stack


class Process(Protocol):
    pid: int

    def poll(self) -> int | None: ...


def exit_reason(code: int) -> str:
    """Popen's returncode in words: a negative code is the signal that ended the process."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


@dataclass
class _Watched:
    name: str
    start: Callable[[], Process]
    log_file: Path | None
    process: Process
    started_at: float
    failures: int = 0  # restarts since the process last stayed up `stable_after`
    restart_at: float | None = None  # set while it is down


class Supervisor:
    """Keeps processes running: one that exits (any code, any signal) is started again by
    its `start` after a delay that doubles from `initial` up to `maximum`, back to `initial`
    once it has stayed up `stable_after` seconds. It never gives up: only the owner stops it.
    Each exit and restart is said on `echo` and appended to the process's log file. The
    clock is injectable so that the decisions are tested without real time."""

    def __init__(
        self,
        initial: float = 1.0,
        maximum: float = 30.0,
        stable_after: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        echo=print,
    ) -> None:
        self.initial, self.maximum, self.stable_after = initial, maximum, stable_after
        self.clock, self.echo = clock, echo
        self.watched: dict[str, _Watched] = {}

    def watch(self, name: str, process: Process, start: Callable[[], Process], log_file: Path | None = None) -> None:
        self.watched[name] = _Watched(name, start, log_file, process, started_at=self.clock())

    def check_once(self) -> None:
        """Notice exits and start what is due; call it every fraction of a second."""
        for w in self.watched.values():
            now = self.clock()
            if w.restart_at is None:
                code = w.process.poll()
                if code is not None:
                    self._schedule(w, now, f"exited ({exit_reason(code)}) after {now - w.started_at:.0f} s")
            elif now >= w.restart_at:
                try:
                    w.process = w.start()
                except Exception as e:  # e.g. Redis not answering yet: try again later
                    w.started_at = now
                    self._schedule(w, now, f"did not start again ({e})")
                    continue
                w.started_at, w.restart_at = self.clock(), None
                self._say(w, f"{w.name} restarted (pid {w.process.pid}, attempt {w.failures})")

    def _schedule(self, w: _Watched, now: float, what: str) -> None:
        if now - w.started_at >= self.stable_after:
            w.failures = 0
        delay = min(self.initial * 2**w.failures, self.maximum)
        w.failures += 1
        w.restart_at = now + delay
        self._say(w, f"{w.name} {what}; restart attempt {w.failures} in {delay:g} s")

    def _say(self, w: _Watched, message: str) -> None:
        self.echo(message)
        if w.log_file is not None:
            with open(w.log_file, "a") as f:
                f.write(f"{datetime.now().isoformat(sep=' ', timespec='seconds')} rlmesh up: {message}\n")


def supervise(
    stack: Stack,
    stop: threading.Event,
    interval: float = 0.5,
    echo=print,
    reload: threading.Event | None = None,
    on_reload: Callable[[], None] | None = None,
) -> None:
    """`rlmesh up`'s loop: restart what exits until `stop` is set, then stop the whole stack;
    `on_reload` whenever `reload` is set (SIGHUP)."""
    supervisor = stack.supervisor(echo=echo)
    try:
        while not stop.is_set():
            if reload is not None and reload.is_set() and on_reload is not None:
                reload.clear()
                on_reload()
            supervisor.check_once()
            stop.wait(interval)
    finally:
        stack.stop()


def wired_settings(flags: list[str]) -> list[str]:
    """The settings a command line sets ('--engine-urls' -> 'engine_urls')."""
    return [f[2:].replace("-", "_") for f in flags if f.startswith("--")]


def reload_config(stack: Stack, config: dict[str, dict], echo=print) -> list[str]:
    """Take a new stack config: the services whose section changed get their file rewritten
    and are stopped (SIGTERM); the Supervisor starts each again on its port, reading it. The
    rest keep running. Returns the services restarted."""
    changed = [n for n in SERVICES if config.get(n, {}) != stack.service_config.get(n, {})]
    stack.service_config = config
    stack.config_files = write_sections(config, stack.data_dir / "config", _write_private)
    for name in changed:
        echo(f"{name}: its settings changed; restarting it on its port")
        stack.processes[name].send_signal(signal.SIGTERM)
    return changed


def _write_private(path: Path, text: str) -> None:
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def running_stack(data_dir: str | Path) -> dict | None:
    """The state file of an `rlmesh up` that is still running, if any; its token file is
    made this process's token (RLMESH_TOKEN_FILE) so that its clients are let in."""
    state_file = Path(data_dir) / "up.json"
    if not state_file.exists():
        return None
    state = json.loads(state_file.read_text())
    try:
        os.kill(state["pid"], 0)
    except OSError:
        return None
    if auth.stack_token() is None and (Path(data_dir) / "token").exists():
        os.environ[auth.TOKEN_FILE_ENV] = str(Path(data_dir).resolve() / "token")
    return state
